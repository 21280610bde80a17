"""One batch through one model at train time.

- logprobs: the forward passes over a Rollout: chosen-token log-probs, entropy, critic values;
- prompt_cache: the distinct prompts of a step encoded once for all its micro-batches;
- packing: a micro-batch's responses laid end to end on their prompt's KV cache, each layer kind
  with its own mask;
- sequences: whole token sequences (supervised fine-tuning, a teacher's distributions) packed or padded
  through one forward.
"""
