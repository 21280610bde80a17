"""Config -> Plan, once at the top of a run: what the run computes, in plain options.

The Config stops here. `make_plan` reads it once, derives from the estimator's registry
entry (`covey.algos.ESTIMATORS`) which models and inputs the run needs, builds the option
objects of the advantage estimator, the policy loss and the update, checks them, and
`print_plan` shows the result at start. Everything below the loop (update, dpo, gradvar)
takes these options, never the Config.
"""

from __future__ import annotations

from dataclasses import dataclass

from covey import algos
from covey.config import Config, ConfigError, validate


@dataclass(frozen=True)
class Sizes:
    """Sequences and passes of one step (N = prompts_per_step x group_size)."""
    sequences_per_step: int
    sequences_per_minibatch: int
    micro_batches_per_minibatch: int
    optimizer_steps_per_rollout: int


@dataclass(frozen=True)
class UpdateOptions:
    """What the update phase reads (covey.train.update, .dpo, .gradvar)."""
    epochs: int
    """Passes over the rollout per step (mu)."""
    minibatches: int
    """Optimizer steps per pass; each builds one global loss normaliser."""
    micro_batch_size: int
    """Sequences per forward/backward; never changes the gradient."""
    max_grad_norm: float
    """Clip the gradient's global norm to this (0 = no clipping)."""
    max_skipped_steps: int
    """Non-finite updates in a row before the run stops."""
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


def make_plan(cfg: Config) -> Plan:
    """The run's plan; a combination that cannot work fails here with one line naming its key.

    The config's own checks run first (the ones load_config runs: a Config built or changed in
    code gets them too); then the option objects check themselves.
    """
    validate(cfg)
    a = cfg.algo
    traits = algos.ESTIMATORS[a.estimator]
    sizes = step_sizes(cfg)
    learns_advantages = a.learner == "advantage"
    plan = Plan(
        label="dpo" if a.learner == "dpo" else a.estimator, learner=a.learner, estimator=a.estimator,
        traits=traits, sizes=sizes,
        needs_reference=(a.beta > 0 and a.kl_in != "none") or a.ratio_against == "ref" or a.learner == "dpo",
        needs_critic=learns_advantages and traits.needs_values,
        needs_old_logprobs=learns_advantages and (sizes.optimizer_steps_per_rollout > 1 or a.kl_in == "reward"
                                                  or a.tis_cap > 0),
        advantage=algos.AdvantageOptions(gamma=a.gamma, lam=a.lam, eps=a.adv_eps, std_normalize=a.std_normalize,
                                         ddof=a.ddof, token_credit=a.token_credit, normalize=a.normalize),
        update=update_options(cfg),
        kl=KLOptions(beta=a.beta, target=a.kl_target, horizon=a.kl_horizon, estimator=a.kl_estimator,
                     placement=a.kl_in))
    for options in (plan.advantage, plan.update.loss):
        try:
            options.validate()
        except ValueError as err:
            raise ConfigError(f"algo: {err}") from None
    return plan


def step_sizes(cfg: Config) -> Sizes:
    n_seq = cfg.rollout.prompts_per_step * cfg.rollout.group_size
    per_mb = n_seq // cfg.algo.minibatches
    return Sizes(sequences_per_step=n_seq, sequences_per_minibatch=per_mb,
                 micro_batches_per_minibatch=-(-per_mb // cfg.algo.micro_batch_size),
                 optimizer_steps_per_rollout=cfg.algo.epochs * cfg.algo.minibatches)


def update_options(cfg: Config) -> UpdateOptions:
    a, o = cfg.algo, cfg.optim
    loss = algos.PolicyLossOptions(clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
                                   dual_clip=a.dual_clip or None, ratio_level=a.ratio_level,
                                   ratio_against=a.ratio_against)
    return UpdateOptions(
        epochs=a.epochs, minibatches=a.minibatches, micro_batch_size=a.micro_batch_size,
        max_grad_norm=o.max_grad_norm, max_skipped_steps=o.max_skipped_steps,
        temperature=cfg.rollout.temperature, autocast=cfg.model.autocast, loss_agg=a.loss_agg,
        max_len=cfg.rollout.max_new_tokens, policy_loss=a.policy_loss, loss=loss, kl_estimator=a.kl_estimator,
        kl_in_loss=a.kl_in == "loss", entropy_coef=a.entropy_coef, value_clip=a.value_clip or None,
        value_coef=a.value_coef, dpo_beta=a.dpo_beta)


def print_plan(plan: Plan) -> None:
    """What the run computes, at start: the algorithm, the models it holds and the sizes of a step."""
    u = plan.update
    if plan.learner == "dpo":
        print(f"covey: dpo | dpo_beta={u.dpo_beta} pairs best vs worst of each group")
    else:
        print(f"covey: {plan.label} | estimator={plan.estimator} loss={u.policy_loss} agg={u.loss_agg} "
              f"beta={plan.kl.beta} kl_in={plan.kl.placement}")
    models = ["policy"] + ["reference"] * plan.needs_reference + ["critic"] * plan.needs_critic
    print(f"covey: models {' + '.join(models)}; old log-prob pass: {'yes' if plan.needs_old_logprobs else 'no'}")
    print("covey: sizes " + " ".join(f"{k}={v}" for k, v in vars(plan.sizes).items()))
