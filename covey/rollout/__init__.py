"""Sampling engines behind one interface (base): hf (`generate`), fast (covey's own decode loop) with its cache by
layer kind (decode_cache), lean_decode, static_decode and static_step (the CUDA-graph step), the bf16 sampling copy
(precision), vLLM, local; the engine factory (factory); tool episodes: tools, environments (TRL's conventions,
checked before loading), agents, episodes (turn by turn), fast_episodes (one loop)."""
