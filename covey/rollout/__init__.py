"""Sampling engines behind one interface (base): hf (`generate`), fast (covey's own decode loop), the bf16 sampling
copy (precision), vLLM; the engine factory (factory)."""
