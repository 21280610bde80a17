"""The tiny test model: a random Llama-architecture causal LM and a small byte-level BPE tokenizer
with SmolLM2's special tokens and chat format, built in memory in seconds (tests, `model.path=tiny`)."""

from __future__ import annotations

import random
from pathlib import Path

import torch

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content']"
    " + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _tiny_corpus(rng: random.Random, n: int = 400) -> list[str]:
    """Arithmetic sentences in chat form: what the tiny tokenizer will mostly see."""
    ops = ["+", "-", "*", "plus", "minus", "times"]
    lines = []
    for _ in range(n):
        a, b = rng.randint(0, 999), rng.randint(0, 99)
        lines.append(f"<|im_start|>user\nWhat is {a} {rng.choice(ops)} {b}? Answer with a number."
                     f"<|im_end|>\n<|im_start|>assistant\nThe answer is {a + b}. #### {a * b} "
                     f"\\boxed{{{a - b}}}<|im_end|>")
    return lines


def tiny_tokenizer(vocab_size: int = 512, seed: int = 0):
    """Byte-level BPE trained in memory (ms) with SmolLM2's special tokens and chat format."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    bpe.train_from_iterator(_tiny_corpus(random.Random(seed)), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|im_end|>", unk_token="<|endoftext|>", model_max_length=1024)
    tokenizer.chat_template = TINY_CHAT_TEMPLATE
    tokenizer.padding_side = "left"
    return tokenizer


def tiny_llama(vocab_size: int, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4,
               num_kv_heads: int = 2, max_positions: int = 1024, seed: int = 0):
    """Randomly initialised Llama-architecture causal LM (GQA, tied embeddings like SmolLM2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build_tiny_model(out_dir: str | Path, seed: int = 0) -> Path:
    """Write a tiny random Llama + tokenizer as an HF folder that `covey train model=...` loads."""
    out_dir = Path(out_dir)
    tokenizer = tiny_tokenizer(seed=seed)
    model = tiny_llama(len(tokenizer), seed=seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir


TINY_WINDOW = 8  # sliding window of the tiny family models: tests run responses longer than it
FAMILY_NAMES = ("llama", "qwen2_window", "qwen3", "qwen3_5", "qwen3_moe", "gemma3", "gpt_oss", "smollm3",
                "mistral_window")


def tiny_family_config(family: str, vocab_size: int, num_layers: int = 4, window: int = TINY_WINDOW):
    """The config of a tiny random model of `family` (FAMILY_NAMES): 4 layers of width 64, each family's own
    layer pattern (sliding windows of `window` positions, Gated DeltaNet layers, experts), ids as the tiny
    tokenizer's."""
    import transformers as hf

    common = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                  eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)
    half = num_layers // 2
    every_other = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]
    one_full_in_four = ["full_attention" if i % 4 == 3 else "sliding_attention" for i in range(num_layers)]
    one_full_in_four_linear = [k.replace("sliding", "linear") for k in one_full_in_four]
    builders = {
        "llama": lambda: hf.LlamaConfig(**common),
        "qwen2_window": lambda: hf.Qwen2Config(**common, use_sliding_window=True, sliding_window=window,
                                               max_window_layers=half),
        "qwen3": lambda: hf.Qwen3Config(**common, head_dim=16),
        "qwen3_5": lambda: hf.Qwen3_5TextConfig(**common, head_dim=16, linear_num_value_heads=4,
                                                linear_num_key_heads=2, linear_key_head_dim=16,
                                                linear_value_head_dim=16, layer_types=one_full_in_four_linear),
        "qwen3_moe": lambda: hf.Qwen3MoeConfig(**common, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                               moe_intermediate_size=32, output_router_logits=False),
        "gemma3": lambda: hf.Gemma3TextConfig(**common, head_dim=16, sliding_window=window,
                                              layer_types=one_full_in_four),
        "gpt_oss": lambda: hf.GptOssConfig(**{**common, "intermediate_size": 64}, head_dim=16,
                                           sliding_window=window, layer_types=every_other, num_local_experts=4,
                                           num_experts_per_tok=2,
                                           rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
        "smollm3": lambda: hf.SmolLM3Config(**common),
        "mistral_window": lambda: hf.MistralConfig(**common, sliding_window=window),
    }
    if family not in builders:
        raise ValueError(f"unknown tiny family {family!r}: {', '.join(FAMILY_NAMES)}")
    return builders[family]()


def tiny_family_model(family: str, vocab_size: int, seed: int = 0, **kwargs):
    """A randomly initialised causal LM of `family` (`tiny_family_config`), in train mode on the CPU."""
    from transformers import AutoModelForCausalLM

    config = tiny_family_config(family, vocab_size, **kwargs)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config)


def build_tiny_family(out_dir: str | Path, family: str, seed: int = 0) -> Path:
    """`build_tiny_model` for another family: an HF folder `covey train model.path=...` loads."""
    out_dir = Path(out_dir)
    tokenizer = tiny_tokenizer(seed=seed)
    model = tiny_family_model(family, len(tokenizer), seed=seed)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return out_dir
