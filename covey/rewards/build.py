"""From the reward config to a Rewarder: rule terms with weights plus user callables."""

from __future__ import annotations

import functools
from typing import Callable, Iterable

from covey.rewards.combine import Rewarder, RewardTerm, load_callable
from covey.rewards.learned import load_learned_rewards
from covey.rewards.remote import RemoteReward
from covey.rewards.rules import correctness_reward, format_reward, language_consistency, overlong_penalty


def parse_function(item: str) -> tuple[str, float]:
    """'pkg.mod:fn:0.5' -> ('pkg.mod:fn', 0.5); without a weight, 1.0."""
    parts = item.split(":")
    if len(parts) == 3:
        try:
            return f"{parts[0]}:{parts[1]}", float(parts[2])
        except ValueError:
            raise ValueError(f"reward.functions: weight of '{item}' is not a number") from None
    if len(parts) == 2:
        return item, 1.0
    raise ValueError(f"reward.functions: '{item}' must be module:function[:weight]")


def user_terms(funcs: Iterable[Callable | str]) -> list[RewardTerm]:
    """Reward terms of Python callables (weight 1) and "module:function[:weight]" or "file.py:function[:weight]"
    strings, each named by its function's name (metrics reward/<name>, as TRL names them)."""
    terms = []
    for fn in funcs:
        if isinstance(fn, str):
            spec, weight = parse_function(fn.strip())
            terms.append(RewardTerm(spec.rsplit(":", 1)[1], load_callable(spec), weight, source=spec))
        elif callable(fn):
            terms.append(RewardTerm(getattr(fn, "__name__", type(fn).__name__), fn, 1.0))
        else:
            raise ValueError(f"reward function {fn!r} is neither a callable nor a 'module:function[:weight]' string")
    return terms


def build_rewarder(cfg, learned=None, extra: Iterable[Callable | str] = (), verifier: str = "math") -> Rewarder:
    """Rule terms, user callables (reward.functions, then `extra`), learned RM / PRM (`learned`, loaded
    from cfg if None) and a remote service. `verifier` (covey/tasks/verifiers.py, resolved from
    eval.metric) is what the correctness term checks with.

    With a learned or remote source the verifier still runs at weight 0, so the
    logged accuracy and the RM/verifier agreement are measured, never rewarded.
    """
    r = cfg.reward
    learned = learned if learned is not None else load_learned_rewards(cfg.reward)
    monitor = bool(learned.outcome or learned.process or r.remote_url)
    terms = []
    if r.correctness or monitor:
        fn = functools.partial(correctness_reward, verifier=verifier, answer_column=cfg.task.answer_key)
        terms.append(RewardTerm("correctness", fn, r.correctness))
    if r.format:
        terms.append(RewardTerm("format", format_reward, r.format))
    if r.overlong_buffer:
        fn = functools.partial(overlong_penalty, max_len=cfg.rollout.max_new_tokens, buffer=r.overlong_buffer)
        terms.append(RewardTerm("overlong", fn, r.overlong_weight))
    if r.language:
        fn = functools.partial(language_consistency, language=r.language_target)
        terms.append(RewardTerm("language", fn, r.language))
    terms += user_terms([*filter(None, (s.strip() for s in r.functions.split(","))), *extra])
    if learned.outcome is not None:
        terms.append(RewardTerm("rm", learned.outcome, r.model_weight, formatted_prompts=True))
    if learned.process is not None and r.prm_weight:
        terms.append(RewardTerm("prm", learned.process, r.prm_weight, formatted_prompts=True))
    if r.remote_url:
        terms.append(RewardTerm("remote", RemoteReward.from_config(cfg), r.remote_weight))
    return Rewarder(terms, on_error=r.on_error, timeout_s=r.timeout_s)
