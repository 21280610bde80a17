"""The checks of a Config that read the `covey.algos` registries, run by `make_plan`.

covey.config checks what a config can check alone (closed sets of plain options, ranges, files);
what an algorithm name means is known only to its registry entry, so the names of estimators,
policy losses, aggregations and KL estimators, and what an estimator needs from the rollout
(groups of at least two samples, per-token rewards, step scores), are checked here, from the
entries' traits, never from a name. Every error is one line naming the key.
"""

from __future__ import annotations

from dataclasses import fields, is_dataclass

from covey import algos
from covey.algos.options import NORMALIZE_MODES, RATIO_AGAINST, RATIO_LEVELS, TOKEN_CREDITS
from covey.config import Config, ConfigError, RewardConfig, RolloutConfig, check_choices
from covey.config.schema import AlgoConfig

REGISTRY_CHOICES = {
    "algo.estimator": tuple(algos.ESTIMATORS),
    "algo.policy_loss": tuple(algos.POLICY_LOSSES),
    "algo.loss_agg": tuple(algos.AGGREGATIONS),
    "algo.kl_estimator": tuple(algos.KL_ESTIMATORS),
    "algo.ratio_level": RATIO_LEVELS,
    "algo.ratio_against": RATIO_AGAINST,
    "algo.token_credit": TOKEN_CREDITS,
    "algo.normalize": NORMALIZE_MODES,
    "algo.tis.mode": algos.TIS_MODES,
    "algo.cov_control": tuple(algos.COV_CONTROLS),
}
"""Keys whose values are the names of covey.algos registry entries or options."""

LOSS_KEYS = tuple(f.name for f in fields(algos.PolicyLossOptions))
"""The policy losses' options: each is the algo key of the same name."""


def check_against_registries(cfg: Config, episodes: bool = False) -> None:
    """Registry names first (so a typo is named as such), then what the estimator needs; `episodes`: the
    run samples tool-calling episodes."""
    check_choices(cfg, REGISTRY_CHOICES)
    check_estimator_needs(cfg.algo, cfg.rollout)
    check_policy_loss(cfg.algo)
    check_step_scores(cfg.algo, cfg.reward, cfg.task.name, episodes)
    check_partial(cfg.rollout, cfg.algo, bool(episodes or cfg.task.source))


def check_estimator_needs(a: AlgoConfig, r: RolloutConfig) -> None:
    """Group sizes, dynamic sampling and a KL penalty in the reward, from the estimator's traits (its
    normalisation and token credit are checked by the entry itself, in make_plan)."""
    estimator = algos.ESTIMATORS[a.estimator]
    uses_estimator = a.learner == "advantage" or (a.learner == "distill" and a.distill.reward_weight > 0)
    if uses_estimator and r.group_size < estimator.min_group_size:  # distillation alone needs no group
        raise ConfigError(f"algo.estimator={a.estimator} compares samples of a prompt: rollout.group_size "
                          f"must be >= {estimator.min_group_size}")
    if a.dynamic_sampling.enabled and estimator.min_group_size < 2:
        raise ConfigError(f"algo.dynamic_sampling needs a group-based estimator, not {a.estimator}")
    if a.kl_in == "reward" and not estimator.per_token_rewards:
        per_token = ", ".join(name for name, e in algos.ESTIMATORS.items() if e.per_token_rewards)
        raise ConfigError(f"algo.kl_in=reward needs a per-token-reward estimator ({per_token}), not {a.estimator}")


def check_policy_loss(a: AlgoConfig) -> None:
    """From the policy loss's traits: a loss option set for a loss that does not read it, an aggregation
    other than the one the loss is defined with, per-token advantages for a loss that reads one per sequence,
    a token device whose weight means nothing for the loss (check_token_devices)."""
    default = AlgoConfig()
    if a.learner != "advantage":
        return
    entry = algos.POLICY_LOSSES[a.policy_loss]
    reads = ", ".join(f"algo.{k}" + (".*" if is_dataclass(getattr(default, k)) else "") for k in entry.options)
    for key in LOSS_KEYS:
        value = getattr(a, key)
        if key in entry.options or value == getattr(default, key) or (key == "ratio_level" and
                                                                       value == entry.ratio_level):
            continue
        raise ConfigError(f"{changed_key(key, value, getattr(default, key))} is not read by algo.policy_loss="
                          f"{a.policy_loss} (it reads: {reads or 'no loss option'})")
    if entry.aggregation and a.loss_agg not in (entry.aggregation, default.loss_agg):
        raise ConfigError(f"algo.loss_agg={a.loss_agg}: algo.policy_loss={a.policy_loss} is defined with "
                          f"algo.loss_agg={entry.aggregation}")
    if entry.sequence_advantage and not algos.ESTIMATORS[a.estimator].sequence_level:
        raise ConfigError(f"algo.policy_loss={a.policy_loss} reads one advantage per sequence: algo.estimator="
                          f"{a.estimator} gives per-token advantages (use grpo, rloo or remax)")
    check_token_devices(a)


def changed_key(key: str, value, default) -> str:
    """'algo.sapo.temperature_pos=2.0': the first key of an option group (or the plain key) set off its default."""
    if not is_dataclass(value):
        return f"algo.{key}={value}"
    name = next(f.name for f in fields(value) if getattr(value, f.name) != getattr(default, f.name))
    return f"algo.{key}.{name}={getattr(value, name)}"


def token_devices(a) -> list[tuple[str, str]]:
    """The token devices the config turns on (covey.algos.TOKEN_DEVICES), each with the key=value naming it."""
    on = []
    if a.tis.cap > 0:
        on.append((algos.TIS_DEVICES[a.tis.mode], f"algo.tis.mode={a.tis.mode}"))
    if a.top_entropy_quantile < 1.0:
        on.append(("top_entropy", f"algo.top_entropy_quantile={a.top_entropy_quantile:g}"))
    if a.cov_control != "none":
        on.append((a.cov_control, f"algo.cov_control={a.cov_control}"))
    return on


def check_token_devices(a) -> None:
    """Each token device hands the policy loss a weight of its kind (a weight per token or per sequence, a
    selection, a penalty); the loss's `token_weights` trait says what that weight means for it
    (covey.algos.WEIGHT_USES). A pair whose weight means nothing for the loss is refused in one line naming
    both keys, with the reason."""
    for device, key in token_devices(a):
        use = algos.token_device_use(a.policy_loss, device)
        if use.refused:
            raise ConfigError(f"{key}: algo.policy_loss={a.policy_loss} {use.meaning}")


def check_step_scores(a: AlgoConfig, r: RewardConfig, task_name: str, episodes: bool = False) -> None:
    """Process supervision: where the step rewards come from, and the outcome added to the last step. In
    tool-calling episodes a step is a model turn (reward.step_source=turns, the only source there)."""
    name = a.estimator
    if r.step_source == "turns" and not episodes:
        raise ConfigError("reward.step_source=turns scores the model turns of tool-calling episodes: set "
                          "rollout.tools or rollout.environment")
    if algos.ESTIMATORS[name].step_scores and episodes:
        if r.step_source != "turns":
            raise ConfigError(f"reward.step_source={r.step_source} scores the reasoning steps of one answer: "
                              f"algo.estimator={name} with tools needs reward.step_source=turns")
        if r.process_outcome_weight <= 0:
            raise ConfigError("reward.process_outcome_weight must be > 0 with reward.step_source=turns: the "
                              "outcome on the last turn is what rewards a right answer")
    elif algos.ESTIMATORS[name].step_scores:
        if r.step_source == "prm" and not r.prm_path:
            raise ConfigError(f"algo.estimator={name} scores steps with a PRM: set reward.prm_path "
                              "(or reward.step_source=exact on task.name=multistep)")
        if r.step_source == "exact" and task_name != "multistep":
            raise ConfigError("reward.step_source=exact needs task.name=multistep (the only task with step labels)")
    elif r.process_outcome_weight:
        raise ConfigError(f"reward.process_outcome_weight adds the outcome to the last step of a step-scored "
                          f"estimator (process supervision); algo.estimator={name} uses the outcome reward already")


def check_partial(r: RolloutConfig, a: AlgoConfig, episodes: bool) -> None:
    """rollout.partial.*: carried rows need the fast engine's slot loop, single answers (`episodes`: tools, an
    environment or a task.source), a learner from advantages without a greedy baseline, and the sampler
    correction that weights tokens sampled under older weights."""
    p = r.partial
    if p.extra < 0 or p.max_age < 1:
        raise ConfigError(f"rollout.partial.extra must be >= 0 and rollout.partial.max_age >= 1, got {p.extra} "
                          f"and {p.max_age}")
    if not p.extra:
        return
    refusals = [
        (r.engine != "fast" or r.decode in ("static", "graphs", "compile"),
         f"the fast engine's plain steps (rollout.engine={r.engine}, rollout.decode={r.decode})"),
        (episodes, "single answers (no tools, environment or task.source)"),
        (a.dynamic_sampling.enabled, "no algo.dynamic_sampling"),
        (a.learner != "advantage" or algos.ESTIMATORS[a.estimator].greedy_baseline,
         f"a learner from advantages without a greedy baseline (algo.learner={a.learner}, "
         f"algo.estimator={a.estimator})"),
        (not a.tis.cap, "algo.tis.cap > 0: a carried row's earlier tokens were sampled under older weights"),
    ]
    for refused, needs in refusals:
        if refused:
            raise ConfigError(f"rollout.partial.extra={p.extra} needs {needs}")
