"""Sampling engines behind one interface.

- base: the engine interface every sampler implements; factory: the sampling and evaluation
  engines a run's settings ask for; local: the engines on this process's policy module;
- hf: Hugging Face `generate`; fast: covey's own decode loop, with its cache by layer kind
  (decode_cache), lean_decode (a Llama step in plain tensor ops) and slots (its one decode loop: a
  call's rows through S slots, each refilled as its row ends, for answers and tool episodes alike),
  paged (single answers with their keys in blocks, memory by tokens in flight), sampling (the warpers
  and one uniform per row and step), speculate (n-gram drafts from a row's group and recent answers,
  verified by the rejection rule),
  stream (the slot loop over a stream of jobs, each joining the running decode: the policy server's);
  static_decode and static_step: the decode loop on a static KV cache, its step replayed as a CUDA
  graph; precision: sampling from a bf16 copy of the policy; vllm: vLLM on the training GPUs;
- tool episodes: tools (TRL's conventions), environments (tools and environments checked before
  loading), agents (an engine whose `generate` runs whole episodes), episodes (turn by turn),
  fast_episodes (the rows of whole episodes in the slot loop: sampled turns, waits, replies fed as
  tokens).
"""
