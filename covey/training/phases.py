"""The plan's options of supervised fine-tuning and of distillation, and which steps are supervised.

    algo.learner=sft                      every step trains on sft.data (covey sft)
    sft.num_steps=N with an RL learner    steps 1..N train on sft.data, then train.steps RL steps: one run
                                          folder, one step count, one resume (the reference, where there is one,
                                          becomes the policy at the switch, unless LoRA keeps it the base model)
    algo.learner=distill                  on-policy distillation from algo.distill.teacher

Built by `make_plan` from the config sections they read; a combination that means nothing is one line naming
its keys. No model or tokenizer is loaded here (covey/training/sft.py and covey/training/distill.py load them).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from covey.config import ConfigError
from covey.config.schema import SftConfig
from covey.config.schema_algo import AlgoConfig, DistillOptions


@dataclass(frozen=True)
class SftOptions:
    """Supervised fine-tuning on sft.data (sft.*)."""
    data: str
    """sft.data: a .jsonl / .json file or a saved HF dataset folder."""
    split: str
    num_steps: int
    """Supervised steps before RL (0 with algo.learner=sft, where every step is)."""
    batch_size: int
    """Conversations per supervised step (one optimizer step)."""
    every_step: bool
    """algo.learner=sft: the whole run is supervised."""


def supervised(sft: SftOptions | None, step: int) -> bool:
    """Whether the step after `step` steps done trains on sft.data (covey/training/sft.py)."""
    return sft is not None and (sft.every_step or step < sft.num_steps)


def sft_options(s: SftConfig, a: AlgoConfig) -> SftOptions | None:
    """The supervised phase of the run, or None when it has none."""
    every = a.learner == "sft"
    if every and not s.data:
        raise ConfigError("algo.learner=sft trains on demonstrations: set sft.data (a .jsonl file or a saved "
                          "dataset folder; docs/distillation.md)")
    if every and s.num_steps:
        raise ConfigError(f"sft.num_steps={s.num_steps} is the supervised warm-up before an RL learner; with "
                          "algo.learner=sft every one of train.steps is supervised: leave sft.num_steps at 0")
    if s.num_steps and not s.data:
        raise ConfigError(f"sft.num_steps={s.num_steps} trains on demonstrations first: set sft.data")
    if not (every or s.num_steps):
        if s.data:
            raise ConfigError(f"sft.data={s.data} is read by algo.learner=sft (covey sft) or by a warm-up before "
                              "RL (sft.num_steps > 0); set one of them")
        return None
    return SftOptions(data=s.data, split=s.split, num_steps=s.num_steps, batch_size=s.batch_size, every_step=every)


def distill_options(a: AlgoConfig) -> DistillOptions | None:
    """algo.distill.* of algo.learner=distill (a copy), or None for another learner."""
    d, default = a.distill, DistillOptions()
    if a.learner != "distill":
        changed = [k for k in vars(default) if getattr(d, k) != getattr(default, k)]
        if changed:
            raise ConfigError(f"algo.distill.{changed[0]} is read by algo.learner=distill, not "
                              f"algo.learner={a.learner}")
        return None
    if not d.teacher:
        raise ConfigError("algo.learner=distill needs a teacher: set algo.distill.teacher to a model folder with the "
                          "policy's tokenizer")
    if not 0.0 <= d.beta <= 1.0:
        raise ConfigError(f"algo.distill.beta must lie in [0, 1], got {d.beta}")
    if d.loss == "reverse_kl" and (d.beta != default.beta or d.top_k):
        raise ConfigError("algo.distill.beta and algo.distill.top_k are read by algo.distill.loss=jsd, not "
                          "reverse_kl")
    if d.loss == "jsd" and d.reward_weight:
        raise ConfigError("algo.distill.reward_weight adds reward advantages to algo.distill.loss=reverse_kl's; "
                          "loss=jsd has no advantages")
    return replace(d)


def phase_lines(sft: SftOptions | None, distill: DistillOptions | None, learner: str, steps: int) -> list[str]:
    """What print_plan says of the phases and the teacher (none without either)."""
    lines = []
    if sft is not None and sft.every_step:
        lines.append(f"sft | loss on the assistant's tokens of {sft.data}, normalised over each step's tokens; "
                     f"{sft.batch_size} conversations per step, {steps} steps")
    elif sft is not None:
        lines.append(f"phases: sft steps 1-{sft.num_steps} on {sft.data} ({sft.batch_size} conversations per "
                     f"step), then {learner} steps {sft.num_steps + 1}-{steps}")
    if distill is not None:
        how = ("each sampled token's advantage log p_teacher - log p_student through the policy loss"
               + (f", plus reward advantages x {distill.reward_weight:g}" if distill.reward_weight else "")
               if distill.loss == "reverse_kl" else
               f"GKD's generalized JSD, beta={distill.beta:g}"
               + (f" over the teacher's top {distill.top_k}" if distill.top_k else " over the vocabulary"))
        lines.append(f"distill | teacher {distill.teacher}: {how}")
    return lines
