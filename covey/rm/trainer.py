"""Reward model training: Bradley-Terry outcome RMs, process RMs, their data, iterative refresh.

Data (JSONL, one object per line):
- `bt`:  {"prompt", "chosen", "rejected"}: a preference pair;
- `prm`: {"prompt", "completion", "labels"}: one 0/1 label per step of the completion.
Both can be generated instead of hand-made: sample the policy on the task and
label with the exact verifier (`correctness_reward` for pairs: every correct
sample is paired with an incorrect one of the same prompt; `label_steps` for
the multi-step task, plus the reference solution and copies with one injected
error each, so a PRM also sees correct steps the base policy rarely writes;
`rm.samples_per_prompt=0` skips the policy and labels only those).
`rm.counterfactuals` adds training-only examples that differ from real ones in a
number alone (a swapped final answer; a wrong result in one step), so the RM has
to check the arithmetic rather than the wording; held-out data stay as generated.

Losses (ref. 002: reward models are trained with the Bradley-Terry loss):
    bt:  -log sigmoid(r_chosen - r_rejected - margin)      mean over pairs
    prm: BCE(logit at each step's last token, label)        mean over real steps

Iterative GRPO (ref. 000): `RewardModelRefresher` collects the policy's latest
samples with their verifier labels and every K policy steps continues training
the RM / PRM on them mixed with a replay buffer (`replay_fraction` of the mix is
historical data, 10% by default).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from covey.rewards.learned import (RM_META_FILE, OutcomeRewardModel, ProcessRewardModel, decode_separator,
                                 encode, end_marker_text, read_rm_meta, read_values)
from covey.tasks.answers import NUMBER_RE, extract_answer, math_equal, normalize_number
from covey.rewards.rules import correctness_reward
from covey.tasks.multistep import (corrupt_solution, label_steps, parse_corruptions, reference_steps,
                                   split_steps, step_categories)


class RewardDataError(ValueError):
    """Bad reward-model training data (one line naming file and line)."""


@dataclass
class PreferencePair:
    prompt: str
    chosen: str
    rejected: str


@dataclass
class StepExample:
    prompt: str
    completion: str
    labels: list[int] = field(default_factory=list)


# --------------------------------------------------------------------------- data files


def load_rm_data(path: str | Path, objective: str, separator: str = "\n") -> list:
    """PreferencePairs (bt) or StepExamples (prm) from JSONL; errors name file and line."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"reward-model data file not found: {path}")
    keys = ("prompt", "chosen", "rejected") if objective == "bt" else ("prompt", "completion", "labels")
    out = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise RewardDataError(f"{path}:{number}: invalid JSON ({e.msg})") from None
        missing = [k for k in keys if not isinstance(row, dict) or k not in row]
        if missing:
            raise RewardDataError(f"{path}:{number}: missing key(s) {', '.join(missing)} for objective {objective}")
        out.append(_row_to_example(row, objective, f"{path}:{number}", separator))
    if not out:
        raise RewardDataError(f"{path}: no examples")
    return out


def _row_to_example(row: dict, objective: str, where: str, separator: str):
    if objective == "bt":
        return PreferencePair(str(row["prompt"]), str(row["chosen"]), str(row["rejected"]))
    labels = row["labels"]
    if not isinstance(labels, list) or any(v not in (0, 1) for v in labels):
        raise RewardDataError(f"{where}: labels must be a list of 0/1")
    steps = split_steps(str(row["completion"]), separator)
    if len(labels) != len(steps):
        raise RewardDataError(f"{where}: {len(labels)} labels for {len(steps)} steps")
    return StepExample(str(row["prompt"]), str(row["completion"]), [int(v) for v in labels])


def save_rm_data(path: str | Path, examples: list) -> None:
    """JSONL, one example per line; written to a temporary sibling and renamed (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as handle:
        for ex in examples:
            handle.write(json.dumps(asdict(ex)) + "\n")
    os.replace(tmp, path)


def split_by_prompt(examples: list, eval_fraction: float, seed: int) -> tuple[list, list]:
    """(train, held-out) with no prompt on both sides."""
    prompts = sorted({ex.prompt for ex in examples})
    random.Random(seed).shuffle(prompts)
    held_prompts = set(prompts[:max(1, round(len(prompts) * eval_fraction))])
    train = [ex for ex in examples if ex.prompt not in held_prompts]
    held = [ex for ex in examples if ex.prompt in held_prompts]
    if not train or not held:
        raise RewardDataError(f"need examples from at least 2 prompts to hold some out, got {len(prompts)}")
    return train, held


# --------------------------------------------------------------------------- labelled samples


def pairs_from_group(prompt: str, completions: list[str], correct: list[float], limit: int) -> list[PreferencePair]:
    """Pair distinct correct completions with distinct incorrect ones of the same prompt (at most `limit`)."""
    good = list(dict.fromkeys(c for c, ok in zip(completions, correct) if ok > 0.5 and c.strip()))
    bad = list(dict.fromkeys(c for c, ok in zip(completions, correct) if ok <= 0.5 and c.strip()))
    return [PreferencePair(prompt, g, b) for g, b in zip(good, bad)][:limit]


def swap_final_answer(prompt: str, text: str, old: str, new: str) -> str | None:
    """`text` with its final answer `old` written as `new`, or None if the result does not read as `new`.

    Every number in the text equal to `old` is rewritten (the answer is often restated:
    "42 * 9 = 378. The answer is 378."), except when `old` is also a number of the prompt
    (then it may be an operand, and only the last occurrence is rewritten)."""
    spans = [m.span() for m in NUMBER_RE.finditer(text) if normalize_number(m.group()) == old]
    if not spans:
        return None
    if old in {normalize_number(m.group()) for m in NUMBER_RE.finditer(prompt)}:
        spans = spans[-1:]
    for start, end in reversed(spans):
        text = text[:start] + new + text[end:]
    return text if math_equal(extract_answer(text), new) else None


def counterfactual_pairs(pairs: list[PreferencePair], per_pair: int, rng: random.Random,
                         spread: int = 30) -> list[PreferencePair]:
    """Up to `per_pair` extra pairs per sampled pair whose two sides differ only in the final number,
    so the only way to rank them is to check the arithmetic (style, length and wording match):
    the correct text with the wrong answer swapped in, the wrong text with the right answer
    swapped in, then the correct text against nearby wrong numbers (|error| <= spread, the size of
    the policy's own slips: 374, 380, 349 for 42 * 9 = 378). Each pair is re-checked by the verifier."""
    out = []
    for pair in pairs:
        right, wrong = extract_answer(pair.chosen), extract_answer(pair.rejected)
        if right is None or wrong is None or math_equal(wrong, right) or not right.lstrip("-").isdigit():
            continue
        value = int(right)
        offsets = [d for d in range(-spread, spread + 1) if d and (value + d >= 0) == (value >= 0)]
        near = [str(value + d) for d in rng.sample(offsets, min(per_pair, len(offsets)))]
        answering = lambda w: swap_final_answer(pair.prompt, pair.chosen, right, w)  # noqa: E731
        candidates = [(pair.chosen, answering(wrong)),
                      (swap_final_answer(pair.prompt, pair.rejected, wrong, right), pair.rejected)]
        candidates += [(pair.chosen, answering(w)) for w in near if w != wrong]
        sampled = (pair.chosen, pair.rejected)
        made = dict.fromkeys(c for c in candidates if all(c) and c[0] != c[1] and c != sampled)
        out += [PreferencePair(pair.prompt, c, r) for c, r in list(made)[:per_pair]]
    return out


def counterfactual_steps(train: list[StepExample], task_examples: list, per_prompt: int, rng: random.Random,
                         separator: str = "\n") -> list[StepExample]:
    """prm: for every training prompt of the multistep task, `per_prompt` copies of its reference
    solution with one wrong result (right operands, result off by 1-12; later steps follow it),
    exactly labelled: the one error a PRM can only catch by doing the arithmetic."""
    by_prompt = {ex.prompt: ex for ex in task_examples}
    seen = {(e.prompt, e.completion) for e in train}
    out = []
    for prompt in dict.fromkeys(e.prompt for e in train):
        example = by_prompt.get(prompt)
        if example is None:
            continue
        texts = [t.replace("\n", separator) for t in corrupted_solutions(example, rng, per_prompt, ("result",))[1:]]
        for row in step_examples_from_group(example, texts, separator=separator):
            if (row.prompt, row.completion) not in seen:
                seen.add((row.prompt, row.completion))
                out.append(row)
    return out


def corrupted_solutions(example, rng: random.Random, n: int = 1, kinds: tuple[str, ...] = ("result",)) -> list[str]:
    """The reference solution and `n` copies with one injected error each (kind drawn from `kinds`)."""
    right = "\n".join(reference_steps(example.meta["start"], example.meta["ops"]) + [f"Answer: {example.answer}"])
    return [right] + [corrupt_solution(example, rng, rng.choice(kinds)) for _ in range(n)]


def step_examples_from_group(example, completions: list[str], rng: random.Random | None = None,
                             separator: str = "\n", corruptions: int = 1,
                             kinds: tuple[str, ...] = ("result",)) -> list[StepExample]:
    """Exactly labelled steps of every distinct non-empty completion, plus (if rng) the reference
    solution and `corruptions` copies of it with one injected error each."""
    texts = list(completions)
    if rng is not None:
        texts += [sol.replace("\n", separator) for sol in corrupted_solutions(example, rng, corruptions, kinds)]
    out = []
    for text in dict.fromkeys(texts):
        steps, labels = label_steps(example, text, separator)
        if steps:
            out.append(StepExample(example.prompt, text, labels))
    return out


def generate_rm_data(cfg, objective: str, log=print) -> list:
    """Label the task's training prompts exactly: policy samples (`model.path`) and, for a PRM,
    the reference solution with corrupted copies (with rm.samples_per_prompt=0 only those)."""
    from covey.tasks.data import load_task_data

    examples = load_task_data(cfg).train
    if objective == "prm" and "ops" not in (examples[0].meta if examples else {}):
        raise RewardDataError("generating PRM data needs exact step labels: use task.name=multistep")
    rng, out, t0 = random.Random(cfg.train.seed), [], time.perf_counter()
    separator = decode_separator(cfg.reward.step_separator)
    kinds = parse_corruptions(cfg.rm.corruption_kinds)
    sample = _policy_sampler(cfg) if cfg.rm.samples_per_prompt else (lambda batch: [[] for _ in batch])
    per_call = max(1, cfg.rollout.prompts_per_step)
    for start in range(0, len(examples), per_call):
        batch = examples[start:start + per_call]
        for ex, texts in zip(batch, sample(batch)):
            if objective == "bt":
                correct = correctness_reward(None, texts, answer=ex.answer)
                out += pairs_from_group(ex.prompt, texts, correct, limit=2)
            else:
                out += step_examples_from_group(ex, texts, rng, separator, cfg.rm.corruptions_per_prompt, kinds)
        if cfg.rm.samples_per_prompt:
            log(f"covey train-rm: sampled {start + len(batch)} prompts -> {len(out)} examples "
                f"({time.perf_counter() - t0:.0f}s)")
        if len(out) >= cfg.rm.num_examples:
            break
    return out[:cfg.rm.num_examples]


def _policy_sampler(cfg):
    """batch of examples -> per example, rm.samples_per_prompt completions of the policy."""
    from covey.tasks.data import format_prompts
    from covey.models.load import load_policy
    from covey.rollout.local import LOCAL_ENGINES, local_engine

    policy, tokenizer = load_policy(cfg.model.path)
    # The training loop's engine when it is local (fast: each prompt encoded once for its samples);
    # vllm would need its own server copy for a one-off data pass, so the fast engine stands in.
    name = cfg.rollout.engine if cfg.rollout.engine in LOCAL_ENGINES else "fast"
    engine = local_engine(name, policy, tokenizer, max_new_tokens=cfg.rollout.max_new_tokens,
                          temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k)

    def sample(batch):
        rollout = engine.generate(format_prompts(tokenizer, batch, cfg.task.system_prompt), cfg.rm.samples_per_prompt)
        return [[c for c, i in zip(rollout.completions, rollout.example_index) if i == j] for j in range(len(batch))]
    return sample


# --------------------------------------------------------------------------- losses and training


def bt_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """Bradley-Terry: mean of -log sigmoid(r_c - r_r - m) (logsigmoid is stable for large gaps)."""
    return -F.logsigmoid(r_chosen - r_rejected - margin).mean()


def prm_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy over the real steps only (mean)."""
    per_step = F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="none")
    return (per_step * mask).sum() / mask.sum().clamp(min=1)


def freeze_lower_layers(model, train_layers: int) -> None:
    """Train only the top `train_layers` decoder layers, the final norm and the head (0 = everything)."""
    if train_layers <= 0:
        return
    layers = getattr(model.backbone, "layers", None)
    if layers is None:
        raise RewardDataError("rm.train_layers needs a backbone with a `layers` list (Llama-like)")
    model.backbone.requires_grad_(False)
    for layer in list(layers)[-train_layers:]:
        layer.requires_grad_(True)
    if getattr(model.backbone, "norm", None) is not None:
        model.backbone.norm.requires_grad_(True)


class RMTrainer:
    """Optimises one reward model; also measures pair / step accuracy."""

    def __init__(self, model, tokenizer, objective: str, *, lr: float, batch_size: int, max_length: int,
                 margin: float = 0.0, separator: str = "\n", seed: int = 0, precision: str = "none",
                 end_marker: bool = False):
        self.model, self.tokenizer, self.objective = model, tokenizer, objective
        self.end_text = end_marker_text(tokenizer, end_marker) if objective == "prm" else ""
        self.precision = precision  # model.autocast: bf16 autocast of the forward passes where native
        self.batch_size, self.max_length, self.margin = batch_size, max_length, margin
        self.separator = decode_separator(separator)
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.generator = torch.Generator().manual_seed(seed)
        self.hidden_cache: dict[str, torch.Tensor] = {}  # repr((prompt, completion)) -> frozen layers' output
        self.cached_layers = 0

    def _rows(self, batch: list) -> tuple[list, list[str], str | None]:
        """(prompts, completions, separator) of the model's input rows: bt reads chosen then
        rejected at their last token, prm every step's last token."""
        if self.objective == "bt":
            return [p.prompt for p in batch] * 2, [p.chosen for p in batch] + [p.rejected for p in batch], None
        return [e.prompt for e in batch], [e.completion for e in batch], self.separator

    def _values(self, prompts: list, completions: list[str], separator: str | None):
        """(values at the read-outs (n, S), the encoded batch); through the frozen-layer cache if filled."""
        enc = encode(self.tokenizer, prompts, completions, self.max_length, separator, self.end_text)
        with self._autocast():
            if not self.hidden_cache:
                return read_values(self.model, enc).float(), enc
            hidden = torch.nn.utils.rnn.pad_sequence([self.hidden_cache[repr(row)] for row in zip(prompts, completions)],
                                                     batch_first=True)
            values = self.model.values_from_hidden(hidden, enc.attention_mask, self.cached_layers)
        return values.float().gather(1, enc.positions), enc

    def _autocast(self):
        from covey.runtime.precision import autocast_context
        return autocast_context(self.precision, self.model.head.weight.device)

    def cache_frozen_layers(self, examples: list) -> int:
        """Run the frozen lower layers once per input row and keep their output, so every epoch
        runs only the trainable top. Returns the number of cached layers (0: nothing is frozen)."""
        self.hidden_cache, self.cached_layers = {}, self.model.frozen_prefix()
        if not self.cached_layers:
            return 0
        for start in range(0, len(examples), self.batch_size):
            prompts, texts, separator = self._rows(examples[start:start + self.batch_size])
            enc = encode(self.tokenizer, prompts, texts, self.max_length, separator, self.end_text)
            with torch.no_grad(), self._autocast():
                hidden = self.model.hidden_below(enc.input_ids, enc.attention_mask, self.cached_layers)
            for i, row in enumerate(zip(prompts, texts)):
                self.hidden_cache[repr(row)] = hidden[i, :int(enc.attention_mask[i].sum())].clone()
        return self.cached_layers

    def _outputs(self, batch: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """bt: (r_chosen, r_rejected, -); prm: (logits (n, S), labels (n, S), mask (n, S))."""
        values, enc = self._values(*self._rows(batch))
        if self.objective == "bt":
            scores = values[:, 0]
            return scores[:len(batch)], scores[len(batch):], torch.ones(len(batch), dtype=torch.bool)
        labels = torch.zeros(enc.positions.shape)
        for i, ex in enumerate(batch):
            labels[i, :len(ex.labels)] = torch.tensor(ex.labels, dtype=torch.float)
        return values, labels, enc.position_mask

    def loss(self, batch: list) -> torch.Tensor:
        a, b, mask = self._outputs(batch)
        return bt_loss(a, b, self.margin) if self.objective == "bt" else prm_loss(a, b, mask.float())

    def fit(self, examples: list, epochs: int, log=None) -> dict:
        """`epochs` shuffled passes; returns the mean loss of the last epoch. With several epochs
        and frozen lower layers (rm.train_layers), their output is computed once, not every epoch."""
        if epochs > 1:
            self.cache_frozen_layers(examples)
        try:
            return {"rm/loss": self._epochs(examples, epochs, log)}
        finally:
            self.hidden_cache, self.cached_layers = {}, 0  # the cache holds only this call's examples

    def _epochs(self, examples: list, epochs: int, log) -> float:
        self.model.train()
        mean = float("nan")
        for epoch in range(epochs):
            order = torch.randperm(len(examples), generator=self.generator).tolist()
            losses = []
            for start in range(0, len(order), self.batch_size):
                loss = self.loss([examples[i] for i in order[start:start + self.batch_size]])
                loss.backward()
                torch.nn.utils.clip_grad_norm_([p for p in self.model.parameters() if p.requires_grad], 1.0)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                losses.append(float(loss.detach()))
            mean = sum(losses) / max(len(losses), 1)
            if log:
                log(epoch + 1, mean)
        return mean

    @torch.no_grad()
    def evaluate(self, examples: list, step_hits: list | None = None) -> dict:
        """bt: rm/pair_accuracy (ties count half); prm: rm/step_accuracy and rm/step_balanced_accuracy.
        prm with a `step_hits` list: one list per example is appended, True/False per step
        (None for a step cut off by max_length)."""
        self.model.eval()
        hits, pos, neg = [], [], []
        for start in range(0, len(examples), self.batch_size):
            a, b, mask = self._outputs(examples[start:start + self.batch_size])
            if self.objective == "bt":
                hits += ((a > b).float() + 0.5 * (a == b).float()).tolist()
            else:
                correct = (a > 0).float() == b
                if step_hits is not None:
                    step_hits += [[bool(c) if m else None for c, m in zip(row, row_mask)][:len(ex.labels)]
                                  for row, row_mask, ex in zip(correct.tolist(), mask.tolist(),
                                                               examples[start:start + self.batch_size])]
                ok = correct[mask]
                hits += ok.float().tolist()
                pos += ok[b[mask] == 1].float().tolist()
                neg += ok[b[mask] == 0].float().tolist()
        self.model.train()
        if self.objective == "bt":
            return {"rm/pair_accuracy": sum(hits) / max(len(hits), 1), "rm/eval_n": len(hits)}
        rates = [sum(x) / len(x) for x in (pos, neg) if x]
        return {"rm/step_accuracy": sum(hits) / max(len(hits), 1), "rm/eval_n": len(hits),
                "rm/step_balanced_accuracy": sum(rates) / max(len(rates), 1),
                "rm/positive_step_frac": len(pos) / max(len(hits), 1)}

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.generator.set_state(state["generator"])


def step_accuracy_by_category(task_examples: list, examples: list[StepExample], step_hits: list,
                              separator: str = "\n") -> dict:
    """A PRM's step accuracy split by what the step is (multistep task): correct steps, the first
    wrong step by error kind, later wrong steps. Rows whose prompt is not a task prompt are skipped."""
    by_prompt = {ex.prompt: ex for ex in task_examples}
    tally: dict[str, list[bool]] = {}
    for row, hits in zip(examples, step_hits):
        task_example = by_prompt.get(row.prompt)
        if task_example is None:
            continue
        for category, hit in zip(step_categories(task_example, row.completion, separator), hits):
            if hit is not None:
                tally.setdefault(category.replace(":", "_"), []).append(hit)
    out = {}
    for category, values in sorted(tally.items()):
        out[f"rm/step_accuracy/{category}"] = sum(values) / len(values)
        out[f"rm/step_count/{category}"] = len(values)
    return out


# --------------------------------------------------------------------------- covey train-rm


def _load_start_model(spec: str):
    """A saved RM folder continues training; anything else is a policy backbone with a fresh head."""
    from covey.models.critic import ValueModel
    from covey.models.load import load_tokenizer, resolve_model_path
    if (Path(spec) / RM_META_FILE).is_file():
        return ValueModel.from_pretrained(spec), load_tokenizer(spec)
    path = resolve_model_path(spec)
    return ValueModel.from_policy_path(path), load_tokenizer(path)


def _end_marker(base_model: str, objective: str) -> bool:
    """Whether the PRM reads its last step on an end marker: always for a new PRM; a saved one
    being continued keeps what it was trained with (folders from before the marker had none)."""
    if objective != "prm":
        return False
    if not (Path(base_model) / RM_META_FILE).is_file():
        return True
    return read_rm_meta(base_model).get("end_marker", False)


def save_reward_model(out: Path, model, tokenizer, meta: dict, train: list, held: list) -> Path:
    """Write weights, tokenizer, meta and the data atomically (a temporary sibling renamed)."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, tokenizer)
    save_rm_data(tmp / "train_data.jsonl", train)
    save_rm_data(tmp / "eval_data.jsonl", held)
    (tmp / RM_META_FILE).write_text(json.dumps(meta, indent=1) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp, out)
    return out


def _counterfactuals(cfg, train: list) -> list:
    """rm.counterfactuals extra training examples (none for the held-out side)."""
    if not cfg.rm.counterfactuals:
        return []
    rng = random.Random(cfg.train.seed)
    if cfg.rm.objective == "bt":
        return counterfactual_pairs(train, cfg.rm.counterfactuals, rng)
    from covey.tasks.data import load_task_data
    return counterfactual_steps(train, load_task_data(cfg).train, cfg.rm.counterfactuals, rng,
                                decode_separator(cfg.reward.step_separator))


def train_reward_model(cfg, log=print) -> dict:
    """`covey train-rm`: data (file or generated), training, held-out accuracy, saved folder."""
    rm = cfg.rm
    torch.manual_seed(cfg.train.seed)
    if rm.data:
        examples = load_rm_data(rm.data, rm.objective, decode_separator(cfg.reward.step_separator))
    else:
        examples = generate_rm_data(cfg, rm.objective, log)
        if rm.save_data:
            save_rm_data(rm.save_data, examples)
            log(f"covey train-rm: wrote {len(examples)} generated examples to {rm.save_data}")
    train, held = split_by_prompt(examples, rm.eval_fraction, cfg.train.seed)
    extra = _counterfactuals(cfg, train)
    if extra:
        log(f"covey train-rm: {len(extra)} counterfactual examples added to the {len(train)} training examples")
        train = train + extra
    log(f"covey train-rm: {rm.objective} on {len(train)} train / {len(held)} held-out examples")
    model, tokenizer = _load_start_model(rm.base_model)
    freeze_lower_layers(model, rm.train_layers)
    end_marker = _end_marker(rm.base_model, rm.objective)
    trainer = RMTrainer(model, tokenizer, rm.objective, lr=rm.learning_rate, batch_size=rm.batch_size,
                        max_length=rm.max_length, margin=rm.margin, separator=cfg.reward.step_separator,
                        seed=cfg.train.seed, precision=cfg.model.autocast, end_marker=end_marker)
    key = "rm/pair_accuracy" if rm.objective == "bt" else "rm/step_accuracy"
    before = trainer.evaluate(held)
    log(f"covey train-rm: held-out {key.split('/')[1]} before training {before[key]:.1%}")
    t0 = time.perf_counter()
    fit = trainer.fit(train, rm.train_epochs, log=lambda e, loss: log(
        f"covey train-rm: epoch {e}: loss {loss:.4f} ({time.perf_counter() - t0:.0f}s)"))
    step_hits: list = []
    after = trainer.evaluate(held, step_hits)
    if rm.objective == "prm" and cfg.task.name == "multistep":
        from covey.tasks.data import load_task_data
        after.update(step_accuracy_by_category(load_task_data(cfg).train, held, step_hits, trainer.separator))
    meta = {"objective": rm.objective, "separator": trainer.separator, "max_length": rm.max_length,
            "end_marker": end_marker,
            "base_model": rm.base_model, "n_train": len(train), "n_counterfactual": len(extra), "n_eval": len(held),
            "before": before, "after": after, **fit, "train_seconds": time.perf_counter() - t0}
    save_reward_model(Path(rm.output), model, tokenizer, meta, train, held)
    log(f"covey train-rm: held-out {key.split('/')[1]} {before[key]:.1%} -> {after[key]:.1%}; saved to {rm.output}")
    by_category = [f"{k.rsplit('/', 1)[1]} {v:.1%} (n={after[k.replace('step_accuracy', 'step_count')]})"
                   for k, v in after.items() if k.startswith("rm/step_accuracy/")]
    if by_category:
        log("covey train-rm: held-out step accuracy by step: " + ", ".join(by_category))
    return meta


def evaluate_reward_model(cfg, folder: str | Path, data: str | Path | None = None) -> dict:
    """`covey eval-rm`: pair / step accuracy of a saved RM on a data file (default: its own
    held-out data); for a PRM on the multistep task also the accuracy by kind of step."""
    objective = read_rm_meta(folder).get("objective")
    scorer = {"bt": OutcomeRewardModel, "prm": ProcessRewardModel}[objective].load(folder)
    data = Path(data) if data else Path(folder) / "eval_data.jsonl"
    examples = load_rm_data(data, objective, scorer.separator)
    trainer = RMTrainer(scorer.model, scorer.tokenizer, objective, lr=0.0, batch_size=cfg.rm.batch_size,
                        max_length=scorer.max_length, separator=scorer.separator, precision=cfg.model.autocast,
                        end_marker=bool(scorer.end_text))
    step_hits: list = []
    out = {"model": str(folder), "data": str(data), **trainer.evaluate(examples, step_hits)}
    if objective == "prm" and cfg.task.name == "multistep":
        from covey.tasks.data import load_task_data
        task = load_task_data(cfg)
        out.update(step_accuracy_by_category(task.train + task.eval, examples, step_hits, scorer.separator))
    return out


# --------------------------------------------------------------------------- iterative GRPO


class ReplayBuffer:
    """Historical RM training examples; uniform eviction keeps a uniform sample of the past (reservoir)."""

    def __init__(self, capacity: int, seed: int = 0):
        self.capacity, self.items, self.seen = capacity, [], 0
        self.rng = random.Random(seed)

    def add(self, examples: list) -> None:
        for ex in examples:
            self.seen += 1
            if len(self.items) < self.capacity:
                self.items.append(ex)
            else:
                j = self.rng.randrange(self.seen)
                if j < self.capacity:
                    self.items[j] = ex

    def sample(self, k: int) -> list:
        return self.rng.sample(self.items, min(k, len(self.items)))

    def __len__(self) -> int:
        return len(self.items)

    def state_dict(self) -> dict:
        return {"items": [asdict(x) for x in self.items], "seen": self.seen, "rng": self.rng.getstate(),
                "kind": type(self.items[0]).__name__ if self.items else ""}

    def load_state_dict(self, state: dict) -> None:
        cls = StepExample if state.get("kind") == "StepExample" else PreferencePair
        self.items = [cls(**x) for x in state["items"]]
        self.seen = state["seen"]
        self.rng.setstate(state["rng"])


def replay_count(fresh: int, fraction: float) -> int:
    """Historical examples to add to `fresh` ones so that they make up `fraction` of the mix."""
    return round(fresh * fraction / (1.0 - fraction)) if fraction > 0 else 0


def pairwise_agreement(scores: torch.Tensor, labels: torch.Tensor, group_ids: torch.Tensor) -> float | None:
    """Share of same-group pairs with labels_i > labels_j that the scores also rank i above j (ties 1/2)."""
    same = group_ids[:, None] == group_ids[None, :]
    better = same & (labels[:, None] > labels[None, :])
    if not bool(better.any()):
        return None
    diff = scores[:, None] - scores[None, :]
    credit = (diff > 0).float() + 0.5 * (diff == 0).float()
    return float(credit[better].mean())


class RewardModelRefresher:
    """Iterative GRPO for one learned reward model (ref. 000).

    After every policy step: record the batch's samples with their verifier
    labels and measure how well the model agrees with the verifier. Every
    `every` steps (0 = never: a fixed RM, agreement only): train on the fresh
    samples plus replayed history, report accuracy on the fresh samples before
    and after, then move the fresh samples into the replay buffer.
    """

    def __init__(self, name: str, scorer, trainer: RMTrainer, *, every: int, replay_fraction: float,
                 replay: ReplayBuffer, epochs: int = 1):
        self.name, self.scorer, self.trainer = name, scorer, trainer
        self.every, self.replay_fraction, self.replay, self.epochs = every, replay_fraction, replay, epochs
        self.pending: list = []

    def observe(self, rollout, examples, prompts) -> None:
        """Turn the batch into fresh training data: pairs (bt) or exactly labelled steps (prm)."""
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(rollout.group_ids.tolist()):
            groups.setdefault(g, []).append(i)
        for rows in groups.values():
            index = rollout.example_index[rows[0]]
            texts = [rollout.completions[i] for i in rows]
            if self.trainer.objective == "bt":
                correct = rollout.reward_parts["correctness"][rows].tolist()
                self.pending += pairs_from_group(prompts[index], texts, correct, limit=len(rows))
            else:
                self.pending += [StepExample(prompts[index], e.completion, e.labels) for e in
                                 step_examples_from_group(examples[index], texts, separator=self.trainer.separator)]

    def agreement(self, rollout) -> dict:
        parts = rollout.reward_parts
        key = "rm" if self.trainer.objective == "bt" else "prm"
        if key not in parts or "correctness" not in parts:
            return {}
        value = pairwise_agreement(parts[key], parts["correctness"], rollout.group_ids)
        return {} if value is None else {f"{key}/agreement": value}

    def refresh(self) -> dict:
        """Train on fresh + replayed examples; accuracy on the fresh ones before and after."""
        key, fresh, self.pending = self.name, self.pending, []
        if not fresh:
            return {f"{key}/refresh_skipped": 1}
        t0 = time.perf_counter()
        acc = "rm/pair_accuracy" if self.trainer.objective == "bt" else "rm/step_accuracy"
        with self.scorer.lock:
            before = self.trainer.evaluate(fresh)[acc]
            mix = fresh + self.replay.sample(replay_count(len(fresh), self.replay_fraction))
            fit = self.trainer.fit(mix, self.epochs)
            after = self.trainer.evaluate(fresh)[acc]
            self.scorer.model.eval()
        self.replay.add(fresh)
        return {f"{key}/acc_before_refresh": before, f"{key}/acc_after_refresh": after,
                f"{key}/refresh_loss": fit["rm/loss"], f"{key}/refresh_fresh": len(fresh),
                f"{key}/refresh_replayed": len(mix) - len(fresh), f"{key}/replay_size": len(self.replay),
                "time/rm_refresh": time.perf_counter() - t0}

    def after_step(self, step: int, rollout, examples, prompts) -> dict:
        metrics = self.agreement(rollout)
        if self.every:
            self.observe(rollout, examples, prompts)
            if step % self.every == 0:
                metrics.update(self.refresh())
        return metrics

    def state_dict(self) -> dict:
        return {"model": self.scorer.model.state_dict(), "trainer": self.trainer.state_dict(),
                "replay": self.replay.state_dict(), "pending": [asdict(x) for x in self.pending]}

    def load_state_dict(self, state: dict) -> None:
        self.scorer.model.load_state_dict(state["model"])
        self.trainer.load_state_dict(state["trainer"])
        self.replay.load_state_dict(state["replay"])
        cls = PreferencePair if self.trainer.objective == "bt" else StepExample
        self.pending = [cls(**x) for x in state["pending"]]


def make_refreshers(cfg, learned) -> list[RewardModelRefresher]:
    """One refresher per learned model; replay seeded with the data the model was trained on."""
    out = []
    for name, scorer in (("rm", learned.outcome), ("prm", learned.process)):
        if scorer is None:
            continue
        objective = "bt" if name == "rm" else "prm"
        if cfg.reward.iterative_every:
            freeze_lower_layers(scorer.model, cfg.rm.train_layers)
        trainer = RMTrainer(scorer.model, scorer.tokenizer, objective, lr=cfg.rm.learning_rate,
                            batch_size=cfg.rm.batch_size, max_length=scorer.max_length, margin=cfg.rm.margin,
                            separator=scorer.separator, seed=cfg.train.seed, precision=cfg.model.autocast,
                            end_marker=bool(scorer.end_text))
        replay = ReplayBuffer(cfg.rm.replay_capacity, seed=cfg.train.seed)
        seed_file = Path(getattr(scorer, "path", "")) / "train_data.jsonl"
        if cfg.reward.iterative_every and seed_file.is_file():
            replay.add(load_rm_data(seed_file, objective, scorer.separator))
        out.append(RewardModelRefresher(name, scorer, trainer, every=cfg.reward.iterative_every,
                                        replay_fraction=cfg.reward.replay_fraction, replay=replay,
                                        epochs=cfg.rm.train_epochs))
    return out


def process_step_inputs(rollout, tokenizer, prompts, examples, prm, source: str, separator: str) -> tuple[dict, dict]:
    """Step rewards for `grpo_process`: AdvantageInput fields (step_scores/ends/mask) and metrics.

    Steps are cut from each response's decoded text; each step's end is mapped to
    the policy token where it ends. source=prm: P(step correct) from the PRM;
    source=exact: the multi-step verifier's 0/1 labels. When exact labels exist
    the PRM's step accuracy on the batch is reported too (prm/step_accuracy).
    """
    from covey.rewards.learned import step_token_ends
    sep = decode_separator(separator)
    texts, ends = [], []
    for ids, mask in zip(rollout.response_ids, rollout.response_mask):
        text, e = step_token_ends(tokenizer, ids[mask.bool()].tolist(), sep)
        texts.append(text)
        ends.append(e)
    picked = [examples[i] for i in rollout.example_index]
    exact = [label_steps(ex, t, sep)[1] for ex, t in zip(picked, texts)] if "ops" in picked[0].meta else None
    if source == "prm":
        scores = prm.step_probabilities([prompts[i] for i in rollout.example_index], texts)
    else:
        scores = [[float(v) for v in labels] for labels in exact]
    width = max([len(e) for e in ends] + [1])
    step_scores, step_ends = torch.zeros(len(texts), width), torch.zeros(len(texts), width, dtype=torch.long)
    step_mask = torch.zeros(len(texts), width, dtype=torch.bool)
    for i, (s, e) in enumerate(zip(scores, ends)):
        n = len(e)
        step_scores[i, :n] = torch.tensor(s[:n])
        step_ends[i, :n] = torch.tensor(e, dtype=torch.long)
        step_mask[i, :n] = True
    metrics = {"steps/per_sample": float(step_mask.sum(1).float().mean()),
               "steps/score_mean": float(step_scores[step_mask].mean()) if step_mask.any() else 0.0}
    if exact is not None and source == "prm":
        metrics.update(prm_batch_metrics(scores, exact))
    inputs = {"step_scores": step_scores.to(rollout.scores.dtype), "step_ends": step_ends, "step_mask": step_mask}
    return inputs, metrics


def prm_batch_metrics(probabilities: list[list[float]], labels: list[list[int]]) -> dict:
    """The PRM against the exact step labels on a batch (a step is called right when p > 0.5):
    accuracy, precision (share of the steps it calls right that are right) and the false-positive
    rate (share of wrong steps called right). When right steps are rare, precision is what decides
    whether its step rewards teach: a 10% false-positive rate against 10% right steps puts half of
    the reward on wrong steps while accuracy still reads 90%."""
    pairs = [(p > 0.5, bool(y)) for ps, ys in zip(probabilities, labels) for p, y in zip(ps, ys)]
    called_right = [y for called, y in pairs if called]
    wrong = [called for called, y in pairs if not y]
    out = {"prm/step_accuracy": sum(called == y for called, y in pairs) / max(len(pairs), 1)}
    if called_right:
        out["prm/step_precision"] = sum(called_right) / len(called_right)
    if wrong:
        out["prm/step_false_positive_rate"] = sum(wrong) / len(wrong)
    return out


def add_outcome_to_last_step(step_scores: torch.Tensor, step_mask: torch.Tensor, outcome: torch.Tensor,
                             weight: float) -> torch.Tensor:
    """Step rewards with `weight * outcome` added to each response's last step.

    Step rewards alone say nothing about finishing: one right step and a stop scores as
    well as a whole right solution (a policy found that, docs/rewards.md). The outcome
    reward on the last step is what a complete, right answer earns on top. A response
    with no step keeps no reward (it has no step to carry one).
    """
    out = step_scores.clone()
    n_steps = step_mask.sum(1)
    rows = (n_steps > 0).nonzero().squeeze(1)
    out[rows, n_steps[rows] - 1] += weight * outcome[rows].to(out.dtype)
    return out
