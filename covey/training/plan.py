"""Config -> Plan, once at the top of a run: what the run computes, in plain options.

The Config stops here. `make_plan` reads it once, checks it against the `covey.algos`
registries (covey/training/plan_checks.py), derives from the estimator's registry entry which
models and inputs the run needs, builds the option objects of sampling, the advantage
estimator, the policy loss, the update, the reference, the sampler correction, step scoring
and the schedule, checks them, and `print_plan` shows the result at start. The steps read
these options, never the Config.
"""

from __future__ import annotations

from dataclasses import dataclass, field, is_dataclass, replace

from covey import algos
from covey.config import (
    Config,
    ConfigError,
    ModelConfig,
    OptimConfig,
    PartialConfig,
    RewardConfig,
    RolloutConfig,
    TrainConfig,
    validate,
)
from covey.config.schema_algo import AdaptiveEntropyOptions, AlgoConfig, DistillOptions, TisOptions
from covey.models.load import ModelOptions
from covey.rewards.build import RewardOptions
from covey.rollout.episodes import EpisodeOptions
from covey.rollout.factory import EngineOptions
from covey.training.phases import SftOptions, distill_options, phase_lines, sft_options
from covey.training.plan_checks import LOSS_KEYS, check_against_registries
from covey.training.plan_setup import OptimizerOptions, RunOptions, ToolOptions, openenv_target, setup_sections


@dataclass(frozen=True)
class Sizes:
    """Sequences and passes of one step (N = prompts_per_step x group_size)."""
    sequences_per_step: int
    sequences_per_minibatch: int
    micro_batches_per_minibatch: int
    optimizer_steps_per_rollout: int


@dataclass(frozen=True)
class UpdateOptions:
    """What the update phase reads (covey.training.update, .dpo, .gradvar)."""
    epochs: int  # passes over the rollout per step (mu)
    minibatches: int
    """Optimizer steps per pass; each builds one global loss normaliser."""
    micro_batch_size: int
    """Sequences per forward/backward; never changes the gradient."""
    max_grad_norm: float
    """Clip the gradient's global norm to this (0 = no clipping)."""
    max_skipped_steps: int  # non-finite updates in a row before the run stops
    temperature: float
    """Sampling temperature: log-probs are taken of logits / temperature."""
    autocast: str
    """Autocast setting of the train-time passes (none | bfloat16 | auto)."""
    loss_agg: str
    """Loss aggregation (covey.algos.AGGREGATIONS)."""
    max_len: int
    """Generation budget: the constant of loss_agg=constant (Dr. GRPO)."""
    policy_loss: str
    """Policy loss name (covey.algos.POLICY_LOSSES)."""
    loss: algos.PolicyLossOptions
    """Clip range, dual clip, ratio level and what the ratio is taken against."""
    kl_estimator: str
    """Per-token KL estimator to the reference (covey.algos.KL_ESTIMATORS)."""
    kl_in_loss: bool
    """The KL to the reference enters the loss (with the controller's beta)."""
    entropy_coef: float
    """Weight of the entropy bonus (0 = reported only)."""
    value_clip: float | None
    """Clip range of the value loss around V_old (None = unclipped)."""
    value_coef: float
    """Weight of the value loss in the critic's objective."""
    dpo_beta: float
    """Strength of the implicit KL of the DPO loss (learner=dpo)."""
    mask_truncated: bool = False
    """DAPO's overlong filtering: truncated responses carry no loss (algo.mask_truncated)."""
    mismatch_cap: float = 2.0
    """The ratio pi_train / mu beyond which sampler/beyond_cap_frac counts a token (algo.tis.cap, or 2)."""
    cov: algos.CovOptions | None = None
    """The covariance control acting on `Rollout.cov_tokens` (Clip-Cov, KL-Cov); None: off."""
    router_aux_coef: float | None = None
    """Weight of the routers' load-balancing loss (model.router_aux_coef; None until set-up resolves it from
    the model's config, covey/training/router_aux.py; 0 = off)."""


@dataclass(frozen=True)
class TokenOptions:
    """What acts on single tokens before the update (covey/training/token_weights.py)."""
    tis: TisOptions = field(default_factory=TisOptions)
    """Importance sampling for the sampler-trainer mismatch: cap (0 = off), mode, lower bound (algo.tis.*)."""
    top_entropy_quantile: float = 1.0
    """Share of the rollout's tokens, by entropy, that keep their policy term (1 = all)."""
    cov: algos.CovOptions = field(default_factory=algos.CovOptions)
    """Clip-Cov / KL-Cov and their settings (control none = off)."""
    adaptive_entropy: AdaptiveEntropyOptions = field(default_factory=AdaptiveEntropyOptions)
    """Skywork-OR1's controller of the entropy coefficient (algo.adaptive_entropy.*; enabled = on)."""

    @property
    def needs_entropy(self) -> bool:
        """The log-prob pass also computes pi_old's entropy of every token."""
        return self.top_entropy_quantile < 1.0 or self.adaptive_entropy.enabled

    @property
    def needs_old_logprobs(self) -> bool:
        return self.needs_entropy or self.cov.control != "none"


@dataclass(frozen=True)
class KLOptions:
    """The KL-to-reference controller and where the penalty goes."""
    beta: float
    """Initial (or fixed) coefficient."""
    target: float
    """Adaptive controller's target KL (0 = fixed beta)."""
    horizon: int
    """Adaptive controller's horizon in steps."""
    estimator: str
    """Per-token estimator (k1, k3, ...)."""
    placement: str
    """loss | reward (per-token penalty in the reward) | none."""


@dataclass(frozen=True)
class SamplingOptions:
    """How a step samples (rollout.*), and DAPO's dynamic sampling (algo.dynamic_sampling)."""
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    seeding: str
    """global | per_prompt (each group seeded by its draw: the same samples however calls split)."""
    eval_batch_size: int
    eval_max_new_tokens: int
    dynamic_sampling: bool
    """Drop groups whose rewards all tie and sample more prompts (Yu et al. 2025, arXiv:2503.14476)."""
    max_resample_rounds: int
    partial: PartialConfig = field(default_factory=PartialConfig)  # rollout.partial.*: covey/training/partial.py


@dataclass(frozen=True)
class ReferenceOptions:
    """How the reference model moves (algo.ref_refresh_every, algo.ref_ema); both 0: it stays the initial policy."""
    refresh_every: int
    ema: float
    reset_at: int = 0
    """After this many steps the reference becomes the policy: the end of a supervised warm-up (0 = never)."""

    @property
    def moves(self) -> bool:
        """The reference changes during the run (so checkpoints hold it)."""
        return bool(self.refresh_every or self.ema or self.reset_at)


@dataclass(frozen=True)
class StepScoring:
    """Process supervision's step rewards (the estimator's `step_scores` trait)."""
    enabled: bool
    source: str
    """prm | exact | turns (one step per model turn of a tool-calling episode)."""
    separator: str
    outcome_weight: float
    """Weight of the outcome reward added to the last step (0 = none)."""


@dataclass(frozen=True)
class Schedule:
    """When the run stops, evaluates, saves, logs samples and measures gradient variance (train.*)."""
    steps: int
    max_minutes: float
    """Training-time budget in minutes, resumes included (0 = none)."""
    seed: int
    eval_every: int
    eval_pass_k: int
    save_every: int
    keep_checkpoints: int
    samples_every: int
    progress: bool
    grad_var_every: int
    grad_var_batches: int
    resume_force: bool
    """Resume even if keys that change results differ from the checkpoint's."""


@dataclass(frozen=True)
class Plan:
    """What one run computes; made once by `make_plan`."""
    label: str
    """What the run trains, for its folder name: the DPO learner, or the advantage estimator."""
    learner: str
    """advantage | dpo (best-vs-worst pairs)."""
    estimator: str
    """Name of the advantage estimator (a key of covey.algos.ESTIMATORS)."""
    traits: algos.Estimator
    """Its registry entry: needs_values, greedy_baseline, step_scores, min_group_size, per_token_rewards."""
    sizes: Sizes
    needs_reference: bool
    """A frozen reference model exists (KL penalty, ratio against it, or DPO)."""
    needs_critic: bool
    """A critic is trained (the estimator needs values)."""
    needs_old_logprobs: bool
    """A separate pi_old pass runs before the update (else the ratio is against logp.detach())."""
    advantage: algos.AdvantageOptions
    update: UpdateOptions
    kl: KLOptions
    sampling: SamplingOptions
    reference: ReferenceOptions
    step_scoring: StepScoring
    schedule: Schedule
    gpu_memory_gib: float
    """On one GPU, the GiB the run may take; its batches are fitted to it (0 = the card's memory less 10%)."""
    episodes: EpisodeOptions | None = None
    """Multi-turn episodes with tools (rollout.tools); None: single-turn answers."""
    tokens: TokenOptions = TokenOptions()
    """Importance-sampling mode, high-entropy tokens, covariance control, adaptive entropy."""
    # The set-up's sections (covey/training/plan_setup.py), read by open_run and everything it builds.
    model: ModelOptions = field(kw_only=True)
    """The policy and the models beside it (model.*)."""
    engine: EngineOptions = field(kw_only=True)
    """The sampling engine (rollout.engine, precision, decode, vllm_*)."""
    optimizer: OptimizerOptions = field(kw_only=True)
    """The optimizers (optim.*)."""
    rewards: RewardOptions = field(kw_only=True)
    """What scores the samples (reward.*)."""
    run: RunOptions = field(kw_only=True)
    """The process, the run folder, resume and the held-out judge (train.*, task.*, eval.*)."""
    tools: ToolOptions = field(kw_only=True)
    """The tools and the environment of episodes (rollout.tools, rollout.environment)."""
    sft: SftOptions | None = field(kw_only=True, default=None)
    """Supervised fine-tuning: every step (algo.learner=sft) or a warm-up before RL (sft.num_steps); None: none."""
    distill: DistillOptions | None = field(kw_only=True, default=None)
    """The teacher and the loss of algo.learner=distill; None for another learner."""


def make_plan(cfg: Config, with_tools: bool = False) -> Plan:
    """The run's plan; a combination that cannot work fails here with one line naming its key.

    The config's own checks run first (the ones load_config runs: a Config built or changed in
    code gets them too); then the option objects check themselves.
    """
    validate(cfg)
    a, r = cfg.algo, cfg.rollout
    episodes = bool(r.tools or r.environment or with_tools or openenv_target(cfg.task))
    check_against_registries(cfg, episodes=episodes)
    traits = algos.ESTIMATORS[a.estimator]
    sizes = step_sizes(r, a)
    learns_advantages = a.learner == "advantage"
    tokens = token_options(a)
    plan = Plan(
        **setup_sections(cfg),  # model, engine, optimizer, rewards, run, tools (covey/training/plan_setup.py)
        label=a.learner if a.learner in ("dpo", "sft", "distill") else a.estimator, learner=a.learner,
        estimator=a.estimator, traits=traits, sizes=sizes, sft=sft_options(cfg.sft, a), distill=distill_options(a),
        needs_reference=a.learner != "sft" and ((a.beta > 0 and a.kl_in != "none") or a.ratio_against == "ref"
                                                or a.learner == "dpo"),
        needs_critic=learns_advantages and traits.needs_values,
        needs_old_logprobs=(a.learner, a.distill.loss) == ("distill", "reverse_kl") or learns_advantages and (
            sizes.optimizer_steps_per_rollout > 1 or a.kl_in == "reward" or a.tis.cap > 0 or tokens.needs_old_logprobs),
        advantage=algos.AdvantageOptions(gamma=a.gamma, lam=a.gae.lam, eps=a.adv_eps, std_normalize=a.std_normalize,
                                         ddof=a.ddof, token_credit=a.token_credit, normalize=a.normalize),
        update=update_options(a, cfg.optim, r, cfg.model, episodes),
        kl=KLOptions(beta=a.beta, target=a.adaptive_kl.target, horizon=a.adaptive_kl.horizon, estimator=a.kl_estimator,
                     placement=a.kl_in),
        sampling=sampling_options(r, a), schedule=schedule(cfg.train, cfg.sft.num_steps),
        reference=ReferenceOptions(a.ref_refresh_every, a.ref_ema, 0 if cfg.model.lora_rank else cfg.sft.num_steps),
        gpu_memory_gib=cfg.train.gpu_memory_gib,
        step_scoring=StepScoring(enabled=traits.step_scores, source=cfg.reward.step_source,
                                 separator=cfg.reward.step_separator,
                                 outcome_weight=cfg.reward.process_outcome_weight),
        episodes=episode_options(r, cfg.reward, episodes), tokens=tokens)
    for check in (plan.advantage.validate, plan.update.loss.validate, lambda: traits.options(plan.advantage),
                  tokens.cov.validate):
        try:
            check()  # the estimator's entry: normalize and token_credit against its traits
        except ValueError as err:
            raise ConfigError(f"algo: {err}") from None
    return plan


def token_options(a: AlgoConfig) -> TokenOptions:
    cov = algos.CovOptions(control=a.cov_control, clip_cov=replace(a.clip_cov), kl_cov=replace(a.kl_cov))
    return TokenOptions(tis=replace(a.tis), top_entropy_quantile=a.top_entropy_quantile, cov=cov,
                        adaptive_entropy=replace(a.adaptive_entropy))


def copy_group(value):
    """A copy of a config option group (the plan never shares the Config's objects); a plain value as it is."""
    return replace(value) if is_dataclass(value) else value


def step_sizes(r: RolloutConfig, a: AlgoConfig) -> Sizes:
    n_seq = r.prompts_per_step * r.group_size
    per_mb = n_seq // a.minibatches
    return Sizes(sequences_per_step=n_seq, sequences_per_minibatch=per_mb,
                 micro_batches_per_minibatch=-(-per_mb // a.micro_batch_size),
                 optimizer_steps_per_rollout=a.epochs * a.minibatches)


def sampling_options(r: RolloutConfig, a: AlgoConfig) -> SamplingOptions:
    return SamplingOptions(prompts_per_step=r.prompts_per_step, group_size=r.group_size,
                           max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                           seeding=r.seeding, eval_batch_size=r.eval_batch_size,
                           eval_max_new_tokens=r.eval_max_new_tokens, dynamic_sampling=a.dynamic_sampling.enabled,
                           max_resample_rounds=a.dynamic_sampling.max_rounds, partial=copy_group(r.partial))


def episode_options(r: RolloutConfig, reward: RewardConfig, episodes: bool) -> EpisodeOptions | None:
    """Turns and budgets of a multi-turn episode when tools or an environment are given (`episodes`:
    rollout.tools, rollout.environment, or Python's tools= / environment_factory=)."""
    if not episodes:
        for key, value in (("reward.tool_use", reward.tool_use), ("rollout.tool_demo", r.tool_demo)):
            if value:
                raise ConfigError(f"{key}={value} needs tools: set rollout.tools or rollout.environment "
                                  "(docs/agents.md)")
        return None
    turn = r.max_turn_tokens or r.max_new_tokens
    return EpisodeOptions(max_turns=r.max_turns, max_turn_tokens=turn,
                          max_episode_tokens=r.max_episode_tokens or 2 * r.max_turns * turn)


def schedule(t: TrainConfig, supervised_first: int = 0) -> Schedule:
    return Schedule(steps=t.steps + supervised_first, max_minutes=t.max_minutes, seed=t.seed, eval_every=t.eval_every,
                    eval_pass_k=t.eval_pass_k, save_every=t.save_every, keep_checkpoints=t.keep_checkpoints,
                    samples_every=t.samples_every, progress=t.progress, grad_var_every=t.grad_var_every,
                    grad_var_batches=t.grad_var_batches, resume_force=t.resume_force)


def update_options(a: AlgoConfig, o: OptimConfig, r: RolloutConfig, model: ModelConfig,
                   episodes: bool = False) -> UpdateOptions:
    # every loss option from the algo key of its name (algo.dual_clip's 0 is None), each loss's group a copy of
    # the config's; a loss defined with its own aggregation (its registry entry's) runs with it
    loss = algos.PolicyLossOptions(**{**{key: copy_group(getattr(a, key)) for key in LOSS_KEYS},
                                      "dual_clip": a.dual_clip or None})
    loss_agg = algos.POLICY_LOSSES[a.policy_loss].aggregation or a.loss_agg
    return UpdateOptions(
        epochs=a.epochs, minibatches=a.minibatches, micro_batch_size=a.micro_batch_size,
        max_grad_norm=o.max_grad_norm, max_skipped_steps=o.max_skipped_steps,
        temperature=r.temperature, autocast=model.autocast, loss_agg=loss_agg,
        max_len=max_model_tokens(r, episodes), policy_loss=a.policy_loss, loss=loss, kl_estimator=a.kl_estimator,
        kl_in_loss=a.kl_in == "loss", entropy_coef=a.entropy_coef, value_clip=a.gae.value_clip or None,
        value_coef=a.gae.value_coef, dpo_beta=a.dpo.beta, mismatch_cap=a.tis.cap or 2.0,
        mask_truncated=a.mask_truncated,
        cov=token_options(a).cov if a.cov_control != "none" else None, router_aux_coef=model.router_aux_coef)


def max_model_tokens(r: RolloutConfig, episodes: bool) -> int:
    """The most tokens the model samples for one answer (the constant of loss_agg=constant): one
    response, or every turn of an episode."""
    return r.max_turns * (r.max_turn_tokens or r.max_new_tokens) if episodes else r.max_new_tokens


def token_summary(t: TokenOptions) -> str:
    """The token selections and the entropy controller, for print_plan ('' when none is on)."""
    parts = [f"policy gradient on the top {t.top_entropy_quantile:g} of tokens by entropy"
             if t.top_entropy_quantile < 1 else "",
             f"covariance control {t.cov.control}" if t.cov.control != "none" else "",
             f"adaptive entropy toward {t.adaptive_entropy.target:g}" if t.adaptive_entropy.enabled else ""]
    return "; ".join(p for p in parts if p)


def print_plan(plan: Plan) -> None:
    """What the run computes, at start: the algorithm, the models it holds and the sizes of a step."""
    u = plan.update
    for line in phase_lines(plan.sft, plan.distill, plan.label, plan.schedule.steps):
        print(f"covey: {line}")
    if plan.learner == "dpo":
        print(f"covey: dpo | dpo_beta={u.dpo_beta} pairs best vs worst of each group")
    elif plan.learner != "sft":
        print(f"covey: {plan.label} | estimator={plan.estimator} loss={u.policy_loss} agg={u.loss_agg} "
              f"beta={plan.kl.beta} kl_in={plan.kl.placement}")
    models = ["policy"] + ["reference"] * plan.needs_reference + ["critic"] * plan.needs_critic
    print(f"covey: models {' + '.join(models)}; old log-prob pass: {'yes' if plan.needs_old_logprobs else 'no'}")
    print("covey: sizes " + " ".join(f"{k}={v}" for k, v in vars(plan.sizes).items()))
    s, ref, sc = plan.sampling, plan.reference, plan.schedule
    print(f"covey: sampling {s.prompts_per_step} prompts x {s.group_size} samples, {s.max_new_tokens} new tokens, "
          f"temperature={s.temperature:g} top_p={s.top_p:g} top_k={s.top_k} seeding={s.seeding}"
          + (f"; dynamic sampling, up to {s.max_resample_rounds} refill rounds" if s.dynamic_sampling else "")
          + (f"; partial rollouts: {s.partial.extra} groups beside the step's, rows carried up to "
             f"{s.partial.max_age} steps" if s.partial.extra else ""))
    extras = [f"reference refreshed every {ref.refresh_every} steps" if ref.refresh_every else "",
              f"reference EMA {ref.ema:g}" if ref.ema else "",
              (f"importance sampling {plan.tokens.tis.mode} cap {plan.tokens.tis.cap:g}"
               + (f" min {plan.tokens.tis.min:g}" if plan.tokens.tis.min else "")) if plan.tokens.tis.cap else "",
              token_summary(plan.tokens),
              (f"step scores from {plan.step_scoring.source}" + (f" + outcome x {plan.step_scoring.outcome_weight:g}"
               if plan.step_scoring.outcome_weight else "")) if plan.step_scoring.enabled else ""]
    if plan.episodes is not None:
        e = plan.episodes
        extras.append(f"episodes of up to {e.max_turns} turns x {e.max_turn_tokens} tokens, "
                      f"{e.max_episode_tokens} in all")
    if any(extras):
        print("covey: " + "; ".join(e for e in extras if e))
    print(f"covey: schedule steps={sc.steps} max_minutes={sc.max_minutes:g} eval_every={sc.eval_every} "
          f"save_every={sc.save_every} seed={sc.seed}")
