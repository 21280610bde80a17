"""One batch through one model at train time: log-probs, entropy, values, the prompt cache, packing."""
