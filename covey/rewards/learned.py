"""Learned reward sources: a Bradley-Terry outcome RM and a process RM (PRM).

Both are `covey.models.critic.ValueModel`s (causal-LM backbone + scalar head) saved by
`covey train-rm` with a `covey_rm.json` beside the weights. The model reads

    text = chat-formatted prompt + completion

and its score is the head's value at one token: the last token for the outcome
RM (a logit of "this answer is preferred"), the last token of every reasoning
step for the PRM (a logit of "this step is correct"; sigmoid gives a
probability). Training (`covey.rm.trainer`) and scoring share `encode`, so a
step is read at exactly the token it was trained on.

As reward functions both have TRL's shape `fn(prompts, completions, **columns)`:
the outcome RM returns its logit, the PRM the minimum of its step
probabilities (a solution is as good as its worst step; Lightman et al. 2023).
For process supervision the loop asks the PRM for every step's probability
(`step_probabilities`) and maps the steps to policy tokens (`step_token_ends`).
"""

from __future__ import annotations

import codecs
import json
import threading
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from covey.models.critic import ValueModel
from covey.models.hf_compat import cache_of, with_cache
from covey.models.load import load_tokenizer
from covey.rewards.rules import completion_text

RM_META_FILE = "covey_rm.json"
OBJECTIVES = ("bt", "prm")


class RewardModelError(ValueError):
    """A reward model folder cannot be used as asked (one line)."""


def decode_separator(separator: str) -> str:
    r"""'\\n' typed on a command line -> a real newline; a real newline stays one."""
    out = codecs.decode(separator, "unicode_escape") if "\\" in separator else separator
    if not out:
        raise RewardModelError("the step separator must not be empty")
    return out


def prompt_text(tokenizer, prompt) -> str:
    """The text before the completion: chat messages or a raw question get the chat template;
    a string that already holds the tokenizer's special tokens (the loop's formatted prompts) is kept."""
    if isinstance(prompt, (list, tuple)):
        return tokenizer.apply_chat_template(list(prompt), tokenize=False, add_generation_prompt=True)
    specials = [t for t in tokenizer.all_special_tokens if t]
    if getattr(tokenizer, "chat_template", None) and not any(t in prompt for t in specials):
        return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                             add_generation_prompt=True)
    return prompt


def step_spans(text: str, separator: str = "\n") -> list[tuple[int, int]]:
    """Character spans (start, end) of the stripped, non-empty steps: the pieces of `split_steps`."""
    spans, start = [], 0
    for piece in text.split(separator):
        stripped = piece.strip()
        if stripped:
            left = start + piece.index(stripped)
            spans.append((left, left + len(stripped)))
        start += len(piece) + len(separator)
    return spans


def end_marker_text(tokenizer, end_marker: bool) -> str:
    """The end marker's text (the tokenizer's EOS token), or "" when off or the tokenizer has none."""
    return (getattr(tokenizer, "eos_token", None) or "") if end_marker else ""


@dataclass
class Encoded:
    """A right-padded batch and the token positions whose values are read.

    input_ids, attention_mask: (n, T). positions: (n, S) token index of each read-out
    (S = 1 for an outcome RM, the number of steps for a PRM); position_mask: (n, S)
    real read-outs (False for padding and for steps cut off by `max_length`); counts: read-outs
    per row (steps of each completion, cut ones included).
    """
    input_ids: Tensor
    attention_mask: Tensor
    positions: Tensor
    position_mask: Tensor
    counts: list[int]

    def to(self, device) -> "Encoded":
        """The batch's tensors on the reward model's device."""
        return Encoded(self.input_ids.to(device), self.attention_mask.to(device), self.positions.to(device),
                       self.position_mask.to(device), self.counts)


def _last_token_before(offsets: list, char_end: int) -> int:
    """Index of the last token that starts before `char_end` (-1 if none)."""
    index = -1
    for i, (start, _) in enumerate(offsets):
        if start < char_end:
            index = i
        else:
            break
    return index


def read_points(offsets: list, start_char: int, completion: str, separator: str | None) -> list[int]:
    """Token indices whose values are read: the last token (separator None) or each step's last
    token; `offsets` are the tokens' character spans, the completion starting at `start_char`."""
    if separator is None:
        return [len(offsets) - 1]
    return [_last_token_before(offsets, start_char + end) for _, end in step_spans(completion, separator)]


def with_end(completion: str, end_text: str) -> str:
    """The completion as a PRM with an end marker reads it: `end_text` (the tokenizer's EOS) right
    after the last step, so that step's read-out sits on the marker and sees that the solution ends
    there (a solution that stops before its answer ends on a wrong step, `label_steps`).
    Trailing whitespace goes first, so the steps stay the pieces of `split_steps`."""
    if not end_text or not completion.strip():
        return completion
    return completion.rstrip() + end_text


def encode(tokenizer, prompts: list, completions: list[str], max_length: int,
           separator: str | None = None, end_text: str = "") -> Encoded:
    """Tokenise prompt + completion; read-outs at the last token (separator None) or at step ends.

    Inputs longer than `max_length` keep their last `max_length` tokens (the
    completion matters most); a step whose end falls in the cut part is masked.
    `end_text`: see `with_end`.
    """
    rows, reads = [], []
    for prompt, completion in zip(prompts, completions):
        completion = with_end(completion, end_text)
        head = prompt_text(tokenizer, prompt)
        enc = tokenizer(head + completion, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = list(enc["input_ids"]), list(enc["offset_mapping"])
        cut = max(len(ids) - max_length, 0)
        ids, offsets = ids[cut:], offsets[cut:]
        rows.append(ids)
        reads.append(read_points(offsets, len(head), completion, separator))
    return _right_padded(tokenizer, rows, reads)


def _right_padded(tokenizer, rows: list[list[int]], reads: list[list[int]]) -> Encoded:
    width, n_reads = max(len(r) for r in rows), max([len(p) for p in reads] + [1])
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    input_ids = torch.full((len(rows), width), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    positions = torch.zeros((len(rows), n_reads), dtype=torch.long)
    position_mask = torch.zeros((len(rows), n_reads), dtype=torch.bool)
    for i, (ids, points) in enumerate(zip(rows, reads)):
        input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[i, :len(ids)] = 1
        for s, p in enumerate(points):
            positions[i, s], position_mask[i, s] = max(p, 0), p >= 0
    return Encoded(input_ids, attention_mask, positions, position_mask, [len(p) for p in reads])


def completion_piece(tokenizer, head_ids: list[int], head: str, completion: str, max_length: int,
                     separator: str | None, end_text: str = "") -> tuple[list[int], list[int]] | None:
    """(completion token ids, read-outs among them) when `head + completion` tokenises as the head's
    tokens followed by the completion's and fits `max_length`: then the head's KV cache can serve every
    completion of a prompt. None otherwise (a token merging across the boundary, a cut input)."""
    completion = with_end(completion, end_text)
    joint = tokenizer(head + completion, add_special_tokens=False)["input_ids"]
    enc = tokenizer(completion, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    if len(joint) > max_length or not ids or list(joint) != head_ids + ids:
        return None
    return ids, read_points(list(enc["offset_mapping"]), 0, completion, separator)


def read_values(model, enc: Encoded) -> Tensor:
    """Head values at the read-out positions, (n, S); differentiable (no no_grad here)."""
    values = model(input_ids=enc.input_ids, attention_mask=enc.attention_mask)
    return values.gather(1, enc.positions)


def read_rm_meta(path: str | Path) -> dict:
    """The `covey_rm.json` of a folder written by `covey train-rm` (objective, separator, ...)."""
    meta_file = Path(path) / RM_META_FILE
    if not meta_file.is_file():
        raise RewardModelError(f"{path}: not a covey reward model folder (no {RM_META_FILE})")
    return json.loads(meta_file.read_text())


class LearnedReward:
    """A loaded reward model; scoring is batched, gradient-free and thread-safe (one lock)."""

    objective = "bt"

    def __init__(self, model, tokenizer, *, max_length: int = 384, separator: str = "\n",
                 batch_size: int = 16, end_marker: bool = False):
        self.model, self.tokenizer = model, tokenizer
        self.max_length, self.batch_size = max_length, batch_size
        self.separator = decode_separator(separator)
        self.end_text = end_marker_text(tokenizer, end_marker)
        self.share_prompt = True  # False: every input runs whole (the reference path, for tests)
        self.lock = threading.Lock()

    @classmethod
    def load(cls, path: str | Path, **kwargs):
        """Load a folder written by `covey train-rm`, checking that it holds this objective."""
        path = Path(path)
        meta = read_rm_meta(path)
        if meta.get("objective") != cls.objective:
            raise RewardModelError(f"{path} holds a '{meta.get('objective')}' reward model, "
                                   f"expected '{cls.objective}'")
        kwargs.setdefault("max_length", meta.get("max_length", 384))
        kwargs.setdefault("separator", meta.get("separator", "\n"))
        kwargs.setdefault("end_marker", meta.get("end_marker", False))  # folders from before it: none
        model = ValueModel.from_pretrained(path)
        model.eval()
        out = cls(model, load_tokenizer(str(path)), **kwargs)
        out.path = path
        return out

    def _values(self, prompts: list, completions: list[str], separator: str | None) -> list[list[float]]:
        """Read-out values per completion. Completions of one prompt share one pass over the prompt
        (its KV cache, expanded); those that cannot (see `completion_piece`) run whole, padded."""
        out: list[list[float] | None] = [None] * len(completions)
        end = self.end_text if separator is not None else ""  # the marker is for step read-outs only
        with self.lock, torch.inference_mode():
            was_training = self.model.training
            self.model.eval()
            whole = []
            for head, rows in self._by_prompt(prompts).items():
                head_ids = list(self.tokenizer(head, add_special_tokens=False)["input_ids"])
                pieces = ({i: completion_piece(self.tokenizer, head_ids, head, completions[i], self.max_length,
                                               separator, end) for i in rows}
                          if self.share_prompt else dict.fromkeys(rows))
                whole += [i for i in rows if pieces[i] is None]
                shared = [i for i in rows if pieces[i] is not None]
                for start in range(0, len(shared), self.batch_size):
                    batch = shared[start:start + self.batch_size]
                    values = self._prefix_values(head_ids, [pieces[i] for i in batch])
                    for i, v in zip(batch, values):
                        out[i] = v
            for start in range(0, len(whole), self.batch_size):
                batch = whole[start:start + self.batch_size]
                enc = encode(self.tokenizer, [prompts[i] for i in batch], [completions[i] for i in batch],
                             self.max_length, separator, end).to(self.device)
                for i, v in zip(batch, self._read(read_values(self.model, enc), enc)):
                    out[i] = v
            self.model.train(was_training)
        return out

    @property
    def device(self) -> torch.device:
        return self.model.head.weight.device

    def _by_prompt(self, prompts: list) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for i, prompt in enumerate(prompts):
            groups.setdefault(prompt_text(self.tokenizer, prompt), []).append(i)
        return groups

    @staticmethod
    def _read(values: Tensor, enc: Encoded) -> list[list[float]]:
        # A step cut off by max_length reads as logit 0 (probability 0.5: no evidence).
        values = values.float().masked_fill(~enc.position_mask, 0.0)
        return [v[:n].tolist() for v, n in zip(values, enc.counts)]

    def _prefix_values(self, head_ids: list[int], pieces: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """Values of completions of one prompt: the prompt runs once, the completions on its cache."""
        backbone, n, width, device = self.model.backbone, len(pieces), len(head_ids), self.device
        cache = cache_of(backbone(input_ids=torch.tensor([head_ids], device=device), use_cache=True))
        cache.batch_repeat_interleave(n)
        enc = _right_padded(self.tokenizer, [ids for ids, _ in pieces], [points for _, points in pieces]).to(device)
        mask = torch.cat([enc.attention_mask.new_ones(n, width), enc.attention_mask], dim=1)
        positions = width + torch.arange(enc.input_ids.shape[1], device=device).expand(n, -1)
        hidden = backbone(input_ids=enc.input_ids, attention_mask=mask, position_ids=positions,
                          **with_cache(cache), use_cache=True).last_hidden_state
        values = self.model.head(hidden.float()).squeeze(-1)
        return self._read(values.gather(1, enc.positions), enc)


class OutcomeRewardModel(LearnedReward):
    """Bradley-Terry RM: reward = the head's logit at the last token."""

    objective = "bt"

    def scores(self, prompts: list, completions: list[str]) -> list[float]:
        return [v[0] for v in self._values(list(prompts), [completion_text(c) for c in completions], None)]

    def __call__(self, prompts, completions, **columns) -> list[float]:
        return self.scores(prompts, completions)


class ProcessRewardModel(LearnedReward):
    """PRM: P(step correct) = sigmoid(logit at the step's last token); reward = min over steps."""

    objective = "prm"

    def step_probabilities(self, prompts: list, completions: list[str]) -> list[list[float]]:
        logits = self._values(list(prompts), [completion_text(c) for c in completions], self.separator)
        return [torch.sigmoid(torch.tensor(v)).tolist() for v in logits]

    def __call__(self, prompts, completions, **columns) -> list[float]:
        # A completion without any step has no evidence of correctness: 0.
        return [min(p) if p else 0.0 for p in self.step_probabilities(prompts, completions)]


# --------------------------------------------------------------------------- policy tokens


def token_char_ends(tokenizer, response_ids: list[int]) -> list[int]:
    """Characters of the decoded response covered by tokens 0..k, for every k.

    Decoding prefixes (not single tokens) keeps multi-byte characters and
    tokenizer clean-up identical to how the completion text was decoded.
    """
    return [len(tokenizer.decode(response_ids[:k + 1], skip_special_tokens=True))
            for k in range(len(response_ids))]


def step_token_ends(tokenizer, response_ids: list[int], separator: str = "\n") -> tuple[str, list[int]]:
    """(decoded text, index of the response token where each step ends).

    A step ends at the first token whose decoded prefix covers the step's last
    character. The last step is stretched to the last response token (EOS
    included), so the tokens after the final step still receive its credit.
    """
    text = tokenizer.decode(response_ids, skip_special_tokens=True)
    spans = step_spans(text, separator)
    if not spans:
        return text, []
    char_ends = token_char_ends(tokenizer, response_ids)
    ends = []
    for _, end in spans:
        ends.append(next((k for k, c in enumerate(char_ends) if c >= end), len(response_ids) - 1))
    ends[-1] = len(response_ids) - 1
    return text, ends


@dataclass
class LearnedRewards:
    """The learned reward models of a run (either may be absent)."""
    outcome: OutcomeRewardModel | None = None
    process: ProcessRewardModel | None = None


def load_learned_rewards(model_path: str = "", prm_path: str = "", separator: str = "\n",
                         device: str = "cpu") -> LearnedRewards:
    """Load the outcome reward model at `model_path` (reward.model_path) and the PRM at `prm_path`
    (reward.prm_path, reading steps split by `separator`, reward.step_separator) onto `device`; '' = none."""
    learned = LearnedRewards(
        outcome=OutcomeRewardModel.load(model_path) if model_path else None,
        process=ProcessRewardModel.load(prm_path, separator=separator) if prm_path else None)
    for model in (learned.outcome, learned.process):
        if model is not None:
            model.model.to(device)
    return learned
