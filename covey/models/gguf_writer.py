"""A Hugging Face Llama-architecture model and its byte-level BPE tokenizer as one GGUF file for llama.cpp.

Written through the `gguf` package (pip install 'covey[gguf]'), in llama.cpp's conventions, so that
llama.cpp runs the file and transformers' GGUF loader (which covey's `model.path=FILE.gguf` uses)
reads it back to the same model:

- tensors under llama.cpp's names, taken from gguf's own table (`model.layers.3.self_attn.q_proj` ->
  `blk.3.attn_q`); a tied output layer is not written (the reader ties it back when `output.weight`
  is absent);
- the rows of the query and key projections permuted from HF's rotary layout (the two halves of each
  head's dimensions) to llama.cpp's (interleaved pairs): within each head, row `i * half + j` moves to
  row `2 * j + i` (i in {0, 1}, j < half); the key projection per key-value head. Transformers'
  loader undoes exactly this;
- the hyper-parameters under `llama.*` (layers, widths, heads, rope base, norm epsilon, vocabulary);
- the tokenizer as `gpt2`-style BPE: tokens by id (spelled in the byte alphabet, as in vocab.json),
  merges, token types (added special -> control, other added -> user-defined, padding rows ->
  unused), the special token ids, whether a BOS/EOS is added, the chat template, and the
  pre-tokenizer's llama.cpp name.

Precision (`quant`): `f16` writes every matrix in float16; `q8_0` in llama.cpp's Q8_0 (blocks of 32
values along a row sharing one float16 scale d = max|x| / 127; each value round(x / d) in int8), a
matrix whose rows are not a multiple of 32 in float16. Vectors (the RMSNorm weights) stay float32 in
both, as llama.cpp writes them.

Refused in one line naming what is not supported: another architecture, rope scaling, biases in the
attention or MLP, an activation other than SiLU, a tokenizer that is not byte-level BPE or whose
pre-tokenizer llama.cpp and transformers would not both reproduce.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from covey.models.errors import ModelError

ARCHITECTURES = ("llama",)
QUANTS = ("f16", "q8_0")
MIN_GGUF = (0, 19)
GPT2_SPLIT = "gpt-2"  # a plain ByteLevel pre-tokenizer with its GPT-2 regex
# Regex splits (then ByteLevel without its regex) whose llama.cpp name transformers' GGUF loader maps back
# to the same regex (transformers/integrations/gguf/gguf_tokenizer_mapping.py): llama 3 and Qwen 2's.
SPLIT_NAMES = ("llama-bpe", "qwen2")


def _gguf():
    """The `gguf` package, at least the release this writer is tested with (0.19)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        import gguf
        release = tuple(int(part) for part in version("gguf").split(".")[:2] if part.isdigit())
    except (ImportError, PackageNotFoundError):
        raise ModelError("exporting to GGUF needs the 'gguf' package: pip install 'covey[gguf]'") from None
    if release < MIN_GGUF:
        raise ModelError(f"exporting to GGUF needs gguf>={'.'.join(map(str, MIN_GGUF))} (installed: "
                         f"{version('gguf')}): pip install 'covey[gguf]'")
    return gguf


def check_exportable(config) -> None:
    """One-line ModelError unless `config` is a Llama model this writer reproduces exactly."""
    arch = getattr(config, "model_type", "?")
    if arch not in ARCHITECTURES:
        raise ModelError(f"export to gguf: architecture '{arch}' is not supported (supported: "
                         f"{', '.join(ARCHITECTURES)})")
    rope = dict(getattr(config, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        raise ModelError(f"export to gguf: rope scaling '{rope['rope_type']}' is not supported (default rope only)")
    for key in ("attention_bias", "mlp_bias"):
        if getattr(config, key, False):
            raise ModelError(f"export to gguf: {key}=true is not supported (llama without biases only)")
    if getattr(config, "hidden_act", "silu") != "silu":
        raise ModelError(f"export to gguf: hidden_act '{config.hidden_act}' is not supported (silu only)")


def permute_qk(weight: np.ndarray, n_head: int) -> np.ndarray:
    """HF's rotary row order -> llama.cpp's, per head (llama.cpp's convert_hf_to_gguf `permute`).

    Rows (n_head * 2 * half, ...) viewed as (head, i, j): HF keeps a head's rotated pairs as
    (j, j + half); llama.cpp as (2j, 2j + 1). Row head * 2 * half + i * half + j goes to
    head * 2 * half + 2 * j + i.
    """
    half = weight.shape[0] // n_head // 2
    return weight.reshape(n_head, 2, half, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def llama_tensors(model) -> list[tuple[str, np.ndarray]]:
    """(llama.cpp name, float32 array) for every weight of a Llama causal LM, q/k permuted."""
    gguf = _gguf()
    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_hidden_layers)
    tied = getattr(config, "tie_word_embeddings", False)
    out = []
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        base, _, suffix = hf_name.rpartition(".")
        name = names.get_name(base)
        if name is None:
            raise ModelError(f"export to gguf: weight {hf_name} has no llama.cpp name")
        array = tensor.detach().to(torch.float32).cpu().numpy()
        if name.endswith(".attn_q"):
            array = permute_qk(array, config.num_attention_heads)
        elif name.endswith(".attn_k"):
            array = permute_qk(array, config.num_key_value_heads)
        out.append((f"{name}.{suffix}", array))
    return out


def encode(array: np.ndarray, quant: str):
    """(data, raw GGML type or None) to hand gguf's writer: vectors float32, matrices as `quant` says."""
    gguf = _gguf()
    if array.ndim == 1:
        return array.astype(np.float32), None
    if quant == "q8_0" and array.shape[-1] % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0] == 0:
        q8 = gguf.GGMLQuantizationType.Q8_0
        return gguf.quants.quantize(np.ascontiguousarray(array, dtype=np.float32), q8), q8
    return array.astype(np.float16), None


def add_hparams(writer, config, name: str, quant: str) -> None:
    gguf = _gguf()
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_vocab_size(config.vocab_size)
    file_type = {"f16": gguf.LlamaFileType.MOSTLY_F16, "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[quant]
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# --------------------------------------------------------------------------- tokenizer


def pre_tokenizer_name(spec: dict | None) -> str:
    """llama.cpp's `tokenizer.ggml.pre` for a tokenizer.json pre-tokenizer both readers reproduce."""
    try:  # transformers' table of the splits its GGUF loader restores (a module of recent 5.x releases)
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:
        GGUF_PRE_TOKENIZER_SPLITS = {}
    spec = spec or {}
    if spec.get("type") == "ByteLevel" and spec.get("use_regex", True) and not spec.get("add_prefix_space"):
        return GPT2_SPLIT
    parts = spec.get("pretokenizers", []) if spec.get("type") == "Sequence" else []
    if (len(parts) == 2 and parts[0].get("type") == "Split" and parts[1].get("type") == "ByteLevel"
            and not parts[1].get("use_regex", True) and not parts[1].get("add_prefix_space")):
        pattern = parts[0].get("pattern", {}).get("Regex")
        for name in SPLIT_NAMES:
            if GGUF_PRE_TOKENIZER_SPLITS.get(name) == pattern:
                return name
    raise ModelError(f"export to gguf: the tokenizer's pre-tokenizer {json.dumps(spec)[:120]} has no llama.cpp "
                     "name that transformers reads back the same")


def token_table(tokenizer, vocab_size: int) -> tuple[list[str], list[int]]:
    """(tokens by id, llama.cpp token types) for ids 0 .. vocab_size - 1; ids past the tokenizer are padding."""
    gguf = _gguf()
    by_id = {i: t for t, i in tokenizer.get_vocab().items()}
    if len(by_id) > vocab_size or max(by_id) >= vocab_size:
        raise ModelError(f"export to gguf: the tokenizer has {len(by_id)} tokens, more than the model's "
                         f"vocab_size {vocab_size}")
    added = tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(vocab_size):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif i in added:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.CONTROL if added[i].special else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
    return tokens, [int(t) for t in types]


def add_tokenizer(writer, tokenizer, vocab_size: int) -> None:
    """The tokenizer as llama.cpp's gpt2-style BPE metadata."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or spec.get("normalizer") is not None or model.get("byte_fallback"):
        raise ModelError(f"export to gguf: only byte-level BPE tokenizers are exported (this one: "
                         f"{model.get('type')} model, normalizer {(spec.get('normalizer') or {}).get('type')})")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_tokenizer_name(spec.get("pre_tokenizer")))
    tokens, types = token_table(tokenizer, vocab_size)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])])
    ids = {"bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id, "unk": tokenizer.unk_token_id,
           "pad": tokenizer.pad_token_id}
    for kind, token_id in ids.items():
        if token_id is not None:
            getattr(writer, f"add_{kind}_token_id")(token_id)
    sample = tokenizer("a")["input_ids"]
    writer.add_add_bos_token(ids["bos"] is not None and sample[:1] == [ids["bos"]])
    writer.add_add_eos_token(ids["eos"] is not None and sample[-1:] == [ids["eos"]])
    template = tokenizer.chat_template
    if isinstance(template, dict):
        template = template.get("default")
    if template:
        writer.add_chat_template(template)


# --------------------------------------------------------------------------- the file


def write_gguf(model, tokenizer, path: str | Path, quant: str = "f16", name: str = "") -> Path:
    """Write `model` and `tokenizer` to `path` (a temporary sibling renamed into place when complete)."""
    if quant not in QUANTS:
        raise ModelError(f"export to gguf: quant '{quant}' is not one of {', '.join(QUANTS)}")
    check_exportable(model.config)
    gguf = _gguf()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    writer = gguf.GGUFWriter(str(tmp), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.LLAMA])
    try:
        add_hparams(writer, model.config, name or path.stem, quant)
        add_tokenizer(writer, tokenizer, model.config.vocab_size)
        for tensor_name, array in llama_tensors(model):
            data, raw = encode(array, quant)
            writer.add_tensor(tensor_name, data, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.replace(path)
    finally:
        writer.close()
        tmp.unlink(missing_ok=True)
    return path
