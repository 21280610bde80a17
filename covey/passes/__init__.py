"""One batch through one model at train time: logprobs (log-probs, entropy, values), prompt_cache, packing (each
layer kind its own mask)."""
