"""Training a reward model: the Bradley-Terry / process RM trainer, `covey train-rm`, `covey eval-rm`.

Losses (`covey.algos.rm_losses`): Bradley-Terry on preference pairs (Bradley & Terry 1952;
Ouyang et al. 2022, arXiv:2203.02155), binary cross-entropy on each step's label for a
process RM (Lightman et al. 2023, arXiv:2305.20050). The model is a `ValueModel`; its
scores are read where `covey.rewards.learned.encode` says, so training and scoring agree.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from covey.algos.rm_losses import bt_loss, prm_loss
from covey.config import ModelConfig, RMConfig, RolloutConfig, TaskConfig
from covey.models.critic import ValueModel
from covey.models.load import load_tokenizer, resolve_model_path
from covey.rewards.learned import (
    RM_META_FILE,
    OutcomeRewardModel,
    ProcessRewardModel,
    decode_separator,
    encode,
    end_marker_text,
    read_rm_meta,
    read_values,
)
from covey.rm.data import (
    RewardDataError,
    StepExample,
    counterfactual_examples,
    generate_rm_data,
    load_rm_data,
    save_rm_data,
    split_by_prompt,
)
from covey.runtime.precision import autocast_context
from covey.tasks.data import load_task_data
from covey.tasks.multistep import step_categories


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
        enc = encode(self.tokenizer, prompts, completions, self.max_length, separator, self.end_text).to(self.device)
        with self._autocast():
            if not self.hidden_cache:
                return read_values(self.model, enc).float(), enc
            cached = [self.hidden_cache[repr(row)] for row in zip(prompts, completions)]
            hidden = torch.nn.utils.rnn.pad_sequence(cached, batch_first=True)
            values = self.model.values_from_hidden(hidden, enc.attention_mask, self.cached_layers)
        return values.float().gather(1, enc.positions), enc

    @property
    def device(self) -> torch.device:
        return self.model.head.weight.device

    def _autocast(self):
        return autocast_context(self.precision, self.device)

    def cache_frozen_layers(self, examples: list) -> int:
        """Run the frozen lower layers once per input row and keep their output, so every epoch
        runs only the trainable top. Returns the number of cached layers (0: nothing is frozen)."""
        self.hidden_cache, self.cached_layers = {}, self.model.frozen_prefix()
        if not self.cached_layers:
            return 0
        for start in range(0, len(examples), self.batch_size):
            prompts, texts, separator = self._rows(examples[start:start + self.batch_size])
            enc = encode(self.tokenizer, prompts, texts, self.max_length, separator, self.end_text).to(self.device)
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
            return scores[:len(batch)], scores[len(batch):], torch.ones(len(batch), dtype=torch.bool,
                                                                      device=self.device)
        labels = torch.zeros(enc.positions.shape, device=self.device)
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
    if (Path(spec) / RM_META_FILE).is_file():
        return ValueModel.from_pretrained(spec), load_tokenizer(spec)
    path = resolve_model_path(spec)
    return ValueModel.from_policy_path(path), load_tokenizer(path)


def uses_end_marker(base_model: str, objective: str) -> bool:
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


def _split_examples(rm: RMConfig, task: TaskConfig, rollout: RolloutConfig, *, policy_path: str,
                    step_separator: str, seed: int, log) -> tuple[list, list, list]:
    """(train, held-out, counterfactuals added to train): rm.data or generated examples, split by prompt."""
    if rm.data:
        examples = load_rm_data(rm.data, rm.objective, decode_separator(step_separator))
    else:
        examples = generate_rm_data(rm, task, rollout, policy_path=policy_path, step_separator=step_separator,
                                    seed=seed, log=log)
        if rm.save_data:
            save_rm_data(rm.save_data, examples)
            log(f"covey train-rm: wrote {len(examples)} generated examples to {rm.save_data}")
    train, held = split_by_prompt(examples, rm.eval_fraction, seed)
    extra = counterfactual_examples(rm, train, task, step_separator=step_separator, seed=seed)
    if extra:
        log(f"covey train-rm: {len(extra)} counterfactual examples added to the {len(train)} training examples")
    return train + extra, held, extra


@dataclass(frozen=True)
class RMRun:
    """Where and how a reward model trains, from the config's other sections."""
    step_separator: str
    """reward.step_separator: what ends a reasoning step (PRM data)."""
    seed: int
    """train.seed."""
    device: str = "cpu"
    """Where the reward model trains."""


def train_reward_model(rm: RMConfig, task: TaskConfig, rollout: RolloutConfig, model: ModelConfig,
                       run: RMRun, log=print) -> dict:
    """`covey train-rm`: data (file or generated), training, held-out accuracy, saved folder.

    `model` is the policy (model.path samples generated data; model.autocast runs the passes)."""
    step_separator, seed, device = run.step_separator, run.seed, run.device
    torch.manual_seed(seed)
    train, held, extra = _split_examples(rm, task, rollout, policy_path=model.path, step_separator=step_separator,
                                         seed=seed, log=log)
    log(f"covey train-rm: {rm.objective} on {len(train)} train / {len(held)} held-out examples, on {device}")
    value_model, tokenizer = _load_start_model(rm.base_model)
    value_model.to(device)
    freeze_lower_layers(value_model, rm.train_layers)
    end_marker = uses_end_marker(rm.base_model, rm.objective)
    trainer = RMTrainer(value_model, tokenizer, rm.objective, lr=rm.learning_rate, batch_size=rm.batch_size,
                        max_length=rm.max_length, margin=rm.margin, separator=step_separator,
                        seed=seed, precision=model.autocast, end_marker=end_marker)
    key = "rm/pair_accuracy" if rm.objective == "bt" else "rm/step_accuracy"
    before = trainer.evaluate(held)
    log(f"covey train-rm: held-out {key.split('/')[1]} before training {before[key]:.1%}")
    t0 = time.perf_counter()
    fit = trainer.fit(train, rm.train_epochs, log=lambda e, loss: log(
        f"covey train-rm: epoch {e}: loss {loss:.4f} ({time.perf_counter() - t0:.0f}s)"))
    step_hits: list = []
    after = trainer.evaluate(held, step_hits)
    if rm.objective == "prm" and task.name == "multistep":
        after.update(step_accuracy_by_category(load_task_data(task, seed).train, held, step_hits, trainer.separator))
    meta = {"objective": rm.objective, "separator": trainer.separator, "max_length": rm.max_length,
            "end_marker": end_marker,
            "base_model": rm.base_model, "n_train": len(train), "n_counterfactual": len(extra), "n_eval": len(held),
            "before": before, "after": after, **fit, "train_seconds": time.perf_counter() - t0}
    save_reward_model(Path(rm.output), value_model, tokenizer, meta, train, held)
    log(f"covey train-rm: held-out {key.split('/')[1]} {before[key]:.1%} -> {after[key]:.1%}; saved to {rm.output}")
    by_category = [f"{k.rsplit('/', 1)[1]} {v:.1%} (n={after[k.replace('step_accuracy', 'step_count')]})"
                   for k, v in after.items() if k.startswith("rm/step_accuracy/")]
    if by_category:
        log("covey train-rm: held-out step accuracy by step: " + ", ".join(by_category))
    return meta


def evaluate_reward_model(folder: str | Path, data: str | Path | None = None, *, task: TaskConfig, seed: int,
                          batch_size: int, autocast: str, device: str = "cpu") -> dict:
    """`covey eval-rm`: pair / step accuracy of a saved RM on a data file (default: its own
    held-out data); for a PRM on the multistep task also the accuracy by kind of step.
    `seed` (train.seed) draws the task's prompts, `batch_size` is rm.batch_size, `autocast` model.autocast."""
    objective = read_rm_meta(folder).get("objective")
    scorer = {"bt": OutcomeRewardModel, "prm": ProcessRewardModel}[objective].load(folder)
    scorer.model.to(device)
    data = Path(data) if data else Path(folder) / "eval_data.jsonl"
    examples = load_rm_data(data, objective, scorer.separator)
    trainer = RMTrainer(scorer.model, scorer.tokenizer, objective, lr=0.0, batch_size=batch_size,
                        max_length=scorer.max_length, separator=scorer.separator, precision=autocast,
                        end_marker=bool(scorer.end_text))
    step_hits: list = []
    out = {"model": str(folder), "data": str(data), **trainer.evaluate(examples, step_hits)}
    if objective == "prm" and task.name == "multistep":
        prompts = load_task_data(task, seed)
        out.update(step_accuracy_by_category(prompts.train + prompts.eval, examples, step_hits, scorer.separator))
    return out
