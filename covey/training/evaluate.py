"""Held-out evaluation: greedy answers (and optionally pass@k with sampling), judged by the task's
verifier or by the run's own reward.

The metric names say what was measured (docs/metrics.md):

- a verifier (eval.metric=math | exact | normalized | contains | reasoning_gym, covey/tasks/verifiers.py):
  `eval/accuracy`, the share of greedy answers the verifier accepts (scores 1), and `eval/pass@k`;
- the reward (eval.metric=reward): `eval/reward_mean`, the mean total reward of the greedy
  answers, and `eval/reward_pass` (`eval/reward_pass@k`), the share whose reward reaches
  eval.reward_threshold.
"""

from __future__ import annotations

import hashlib
import json
import signal
from dataclasses import dataclass, field
from pathlib import Path

import torch

from covey.rewards.combine import TrainerState
from covey.rewards.scoring import score
from covey.runtime.metrics import write_whole
from covey.runtime.signals import DecodeAborted, TrainingStopped, abortable
from covey.tasks.answers import extract_answer, find_marked_answer
from covey.tasks.base import Example
from covey.tasks.verifiers import scores, verifier_column


@dataclass
class Judge:
    """How a held-out answer is scored: `metric` names a verifier, or is "reward" (the rewarder's
    total, passing at `threshold`); `state` is what reward functions get as trainer_state."""
    metric: str
    rewarder: object = None
    threshold: float = 1.0
    state: TrainerState = field(default_factory=TrainerState)

    @property
    def by_reward(self) -> bool:
        return self.metric == "reward"

    def __call__(self, out, examples: list[Example], prompts: list[str]) -> tuple[list[bool], list[float]]:
        """(passed, value) per generated answer; `out.example_index` indexes `examples` and `prompts`."""
        if not self.by_reward:  # a verifier's score per answer (a row verifier's may lie between 0 and 1): right at 1
            picked, column = [examples[i] for i in out.example_index], verifier_column(self.metric)
            values = scores(self.metric, out.completions, [ex.answer for ex in picked],
                            [ex.meta.get(column) for ex in picked] if column else None)
            return [v >= 1.0 for v in values], values
        score(out, self.rewarder, examples, prompts, self.state)
        values = out.scores.tolist()
        return [v >= self.threshold for v in values], values

    def describe(self) -> str:
        """How results are named in the messages: 'accuracy (normalized)', 'share at reward >= 1'."""
        return f"share at reward >= {self.threshold:g}" if self.by_reward else f"accuracy ({self.metric})"


class EvaluationStopped(TrainingStopped):
    """A stop signal (SIGINT, SIGTERM) ended the evaluation before training between two batches: no step
    was trained, so no checkpoint is written; the CLI exits with 128 + the signal's number."""

    def __init__(self, signum: int, done: int, total: int):
        RuntimeError.__init__(self, f"stopped by {signal.Signals(signum).name} during the evaluation before "
                                    f"training, after {done} of {total} held-out problems: nothing was trained, "
                                    "so no checkpoint was written (the same command starts the run again)")
        self.signum, self.step, self.checkpoint = signum, 0, None


def stoppable(stop, done: int, total: int, generate):
    """`generate()`, left at the engine's next decode step once `stop` (the run's StopFlag) rises: then
    EvaluationStopped, after `done` of `total` held-out problems."""
    try:
        with abortable(stop):
            return generate()
    except DecodeAborted:
        raise EvaluationStopped(stop.signum, done, total) from None


def headline(result: dict) -> float:
    """The one number of an evaluation: accuracy for a verifier, the pass rate for the reward."""
    return result["eval/accuracy"] if "eval/accuracy" in result else result["eval/reward_pass"]


@dataclass(frozen=True)
class HeldOutOptions:
    """How held-out answers are drawn and judged."""
    judge: Judge
    batch_size: int
    """Prompts per generate call."""
    max_new_tokens: int
    pass_k: int = 0
    """Also pass@k with k sampled answers per prompt (0: off)."""


@torch.inference_mode()
def evaluate(engine, prompts: list[str], examples: list[Example], settings: HeldOutOptions,
             replies: list[dict] | None = None, stop=None) -> dict:
    """Greedy answers to every held-out prompt, judged; pass@k with settings.pass_k samples per prompt.
    `replies`: one `reply_record` per prompt is appended to it. `stop` (the run's StopFlag, for the
    evaluation before training): once raised, EvaluationStopped before the next batch."""
    judge, batch_size, max_new_tokens, pass_k = settings.judge, settings.batch_size, settings.max_new_tokens, \
        settings.pass_k
    hits: list[bool] = []
    values: list[float] = []
    cut = 0  # answers that hit max_new_tokens
    for start in range(0, len(prompts), batch_size):
        if stop is not None and stop.requested:
            raise EvaluationStopped(stop.signum, start, len(prompts))
        batch = slice(start, start + batch_size)
        out = stoppable(stop, start, len(prompts), lambda: engine.generate(prompts[batch], 1, greedy=True,
                                                                            max_new_tokens=max_new_tokens))
        passed, scored = judge(out, examples[batch], prompts[batch])
        hits += passed
        values += scored
        cut += int(out.truncated.sum())
        if replies is not None:
            replies += [{**reply_record(examples[batch][i], out.completions[j], passed[j], scored[j],
                                        bool(out.truncated[j])),
                         **({"messages": out.messages[j]} if getattr(out, "messages", None) is not None else {})}
                        for j, i in enumerate(out.example_index)]
    n = max(len(hits), 1)
    if judge.by_reward:
        result = {"eval/reward_mean": sum(values) / n, "eval/reward_pass": sum(hits) / n, "eval/n": len(hits)}
    else:
        result = {"eval/accuracy": sum(hits) / n, "eval/n": len(hits)}
    result["eval/truncated_frac"] = cut / n
    if pass_k > 0:
        name = f"eval/reward_pass@{pass_k}" if judge.by_reward else f"eval/pass@{pass_k}"
        result[name] = pass_at_k(engine, prompts, examples, settings, stop)
    return result


def pass_at_k(engine, prompts, examples, settings: HeldOutOptions, stop=None) -> float:
    """Share of prompts with at least one of k = settings.pass_k sampled answers passing the judge (`stop`: as
    `evaluate`'s)."""
    judge, batch_size, max_new_tokens, k = settings.judge, settings.batch_size, settings.max_new_tokens, \
        settings.pass_k
    solved = []
    per_call = max(batch_size // k, 1)
    for start in range(0, len(prompts), per_call):
        if stop is not None and stop.requested:
            raise EvaluationStopped(stop.signum, start, len(prompts))
        batch = slice(start, start + per_call)
        out = stoppable(stop, start, len(prompts), lambda: engine.generate(prompts[batch], k,
                                                                            max_new_tokens=max_new_tokens))
        flags, _ = judge(out, examples[batch], prompts[batch])
        for j in range(len(out.example_index) // k):
            solved.append(any(flags[j * k:(j + 1) * k]))
    return sum(solved) / max(len(solved), 1)


def reply_record(example: Example, reply: str, passed: bool, value: float, truncated: bool) -> dict:
    """One held-out answer as `covey eval --replies` writes it: the problem, the reply, how it was read.
    `marked`: the answer given with an explicit marker (`####`, "Answer:", \\boxed{}); `extracted`: the
    answer the verifier read (the marked one, else the reply's last number)."""
    return {"prompt": example.prompt, "answer": example.answer, "reply": reply, "passed": passed,
            "value": value, "truncated": truncated, "marked": find_marked_answer(reply),
            "extracted": extract_answer(reply)}


def reply_breakdown(records: list[dict]) -> dict:
    """Where held-out answers fail: passed; wrong with a marked answer or with only a last number read
    (a wrong result in the expected form or not); no number at all; and how many were cut off."""
    wrong = [r for r in records if not r["passed"]]
    return {"n": len(records), "passed": len(records) - len(wrong),
            "wrong_marked": sum(r["marked"] is not None for r in wrong),
            "wrong_last_number": sum(r["marked"] is None and r["extracted"] is not None for r in wrong),
            "no_answer": sum(r["extracted"] is None for r in wrong),
            "truncated": sum(r["truncated"] for r in records)}


def settings_key(settings: dict) -> str:
    """A digest of the settings an evaluation depends on (JSON with sorted keys)."""
    return hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]


def cached_evals(path: str | Path) -> dict:
    """The entries of an evaluation cache file; empty when it is missing, unreadable or not a JSON
    object (then every evaluation runs again, and the next write replaces it)."""
    try:
        entries = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return entries if isinstance(entries, dict) else {}


def read_cached_eval(path: str | Path, key: str) -> dict | None:
    """The `eval/` figures stored under `key` in the JSON file `path`; None when there are none."""
    entry = cached_evals(path).get(key)
    return dict(entry["metrics"]) if isinstance(entry, dict) and isinstance(entry.get("metrics"), dict) else None


def write_cached_eval(path: str | Path, key: str, result: dict, settings: dict) -> None:
    """Store `result`'s `eval/` figures under `key` (with the settings, for a reader), keeping the
    file's other entries; the file is written whole or not at all."""
    entries = cached_evals(path)
    entries[key] = {"metrics": {k: v for k, v in result.items() if k.startswith("eval/")}, "settings": settings}
    write_whole(path, json.dumps(entries, indent=1, sort_keys=True, default=str) + "\n")


def eval_settings(sections: dict) -> dict:
    """What the untrained policy's held-out figures depend on, out of the config as the run records it
    (`sections`, covey.config.as_dict): every section but algo, optim and train, and of train the seed
    (it draws the held-out set), the device and pass@k."""
    settings = {name: sections[name] for name in ("model", "task", "rollout", "reward", "rm", "eval")}
    settings["train"] = {k: sections["train"][k] for k in ("seed", "device", "eval_pass_k")}
    return settings
