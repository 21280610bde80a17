"""Iterative GRPO: the learned reward models keep training on the policy's latest samples, with replay.

Shao et al. 2024 (DeepSeekMath, arXiv:2402.03300), iterative RL with GRPO: the reward
model is trained further on the policy's new samples, with a replay of historical data
(10% of the mix there, `reward.replay_fraction` here). `RewardModelRefresher` collects each
step's samples with their verifier labels and every K policy steps continues training the
RM / PRM on them mixed with a `ReplayBuffer`.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict
from pathlib import Path

import torch

from covey.config import RMConfig
from covey.rm.data import PreferencePair, StepExample, load_rm_data, pairs_from_group, step_examples_from_group
from covey.rm.trainer import RMTrainer, freeze_lower_layers


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
    """Iterative GRPO for one learned reward model (Shao et al. 2024, arXiv:2402.03300).

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


def make_refreshers(learned, rm: RMConfig, *, every: int, replay_fraction: float, seed: int,
                    autocast: str) -> list[RewardModelRefresher]:
    """One refresher per learned model; replay seeded with the data the model was trained on.

    `every` is reward.iterative_every (0: agreement only, no training), `replay_fraction`
    reward.replay_fraction, `seed` train.seed, `autocast` model.autocast."""
    out = []
    for name, scorer in (("rm", learned.outcome), ("prm", learned.process)):
        if scorer is None:
            continue
        objective = "bt" if name == "rm" else "prm"
        if every:
            freeze_lower_layers(scorer.model, rm.train_layers)
        trainer = RMTrainer(scorer.model, scorer.tokenizer, objective, lr=rm.learning_rate,
                            batch_size=rm.batch_size, max_length=scorer.max_length, margin=rm.margin,
                            separator=scorer.separator, seed=seed, precision=autocast,
                            end_marker=bool(scorer.end_text))
        replay = ReplayBuffer(rm.replay_capacity, seed=seed)
        seed_file = Path(getattr(scorer, "path", "")) / "train_data.jsonl"
        if every and seed_file.is_file():
            replay.add(load_rm_data(seed_file, objective, scorer.separator))
        out.append(RewardModelRefresher(name, scorer, trainer, every=every, replay_fraction=replay_fraction,
                                        replay=replay, epochs=rm.train_epochs))
    return out
