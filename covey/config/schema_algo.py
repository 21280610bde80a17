"""The `algo` section: the estimator, the policy loss, the KL, the update, and the token devices.

A key that matters for one value of another is nested under its owner, declared once here with its
default and docstring: the options of one loss (`algo.sapo.*`, `algo.gmpo.*`, `algo.vespo.*`), of one
estimator (`algo.gae.*`), of one learner (`algo.dpo.*`, `algo.distill.*`) and of one token device (`algo.tis.*`,
`algo.clip_cov.*`, `algo.kl_cov.*`, `algo.adaptive_entropy.*`), and the adaptive controllers
(`algo.adaptive_kl.*`, `algo.dynamic_sampling.*`). covey.algos reads these same classes, so a loss's
options and their defaults exist once. No torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SapoOptions:
    """algo.policy_loss=sapo: the soft gate 4/tau sigmoid(tau (r - 1)) (Gao et al. 2025, arXiv:2511.20347)."""
    temperature_pos: float = 1.0
    """Temperature tau of the gate for A > 0 (> 0; TRL's sapo_temperature_pos and default)."""
    temperature_neg: float = 1.05
    """Temperature tau of the gate for A <= 0 (> 0; TRL's sapo_temperature_neg and default)."""


@dataclass
class GmpoOptions:
    """algo.policy_loss=gmpo: the geometric mean of clipped token ratios (Zhao et al. 2025, arXiv:2507.20673)."""
    log_clip_low: float = 0.4
    """Token log-ratios below -this are clipped where A < 0, in log space (>= 0; ratios within e^-0.4..e^0.4; TRL GMPOConfig's epsilon)."""
    log_clip_high: float = 0.4
    """Token log-ratios above this are clipped where A > 0, in log space (>= 0; TRL GMPOConfig's epsilon_high)."""


@dataclass
class VespoOptions:
    """algo.policy_loss=vespo: the gamma kernel phi(w) = w^k e^(lambda (1 - w)) of the sequence weight (arXiv:2602.10693)."""
    k_pos: float = 2.0
    """Power k of the kernel for A >= 0 (>= 0; TRL's vespo_k_pos and default)."""
    lambda_pos: float = 3.0
    """Decay lambda of the kernel for A >= 0 (> 0; TRL's vespo_lambda_pos and default)."""
    k_neg: float = 3.0
    """Power k for A < 0 (>= 0; TRL's vespo_k_neg and default)."""
    lambda_neg: float = 2.0
    """Decay lambda for A < 0 (> 0; TRL's vespo_lambda_neg and default)."""


@dataclass
class GaeOptions:
    """algo.estimator=gae: the critic's advantages (Schulman et al. 2016, arXiv:1506.02438) and its value loss."""
    lam: float = 0.95
    """GAE lambda in [0, 1]."""
    value_clip: float = 0.2
    """Critic value clip range around V_old (0 = off)."""
    value_coef: float = 0.5
    """c1: weight of the value loss (the critic has its own optimizer)."""


@dataclass
class DpoOptions:
    """algo.learner=dpo: iterative DPO on each group's best-vs-worst pair (Rafailov et al. 2023, arXiv:2305.18290)."""
    beta: float = 0.1
    """beta of the loss -log sigmoid(beta * margin): the implicit KL strength (> 0)."""


@dataclass
class DistillOptions:
    """algo.learner=distill: on-policy distillation from a teacher with the policy's tokenizer (docs/distillation.md)."""
    teacher: str = ""
    """The teacher: a local model folder whose tokenizer is the policy's (checked before any model loads)."""
    loss: str = "reverse_kl"
    """reverse_kl (each sampled token's advantage is log pi_teacher - log pi_student, through algo.policy_loss; Lu and Thinking Machines Lab 2025) | jsd (GKD's generalized JSD of the two next-token distributions on the student's samples; Agarwal et al. 2023, arXiv:2306.13649)."""
    beta: float = 0.5
    """loss=jsd: GKD's beta in [0, 1] (0 = forward KL(teacher || student), 1 = reverse KL, TRL's convention)."""
    top_k: int = 0
    """loss=jsd: the divergence over the teacher's top-k tokens of each position, both distributions renormalised over them (0 = the whole vocabulary)."""
    reward_weight: float = 0.0
    """loss=reverse_kl: the estimator's reward advantages times this are added to the distillation advantages (0 = distillation alone)."""


@dataclass
class AdaptiveKLOptions:
    """The adaptive KL controller (Ziegler et al. 2019, arXiv:1909.08593): beta moves toward a target KL."""
    target: float = 0.0
    """Target KL per token (0 = off: algo.beta stays fixed)."""
    horizon: int = 10000
    """Horizon of the controller in steps."""


@dataclass
class DynamicSamplingOptions:
    """DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476): groups whose rewards all tie are dropped and more prompts sampled."""
    enabled: bool = False
    """On or off (algo.dynamic_sampling=true is short for this)."""
    max_rounds: int = 3
    """Extra sampling rounds allowed per step."""


@dataclass
class TisOptions:
    """Importance sampling for the sampler-trainer mismatch (Yao et al. 2025): per-token weights from r = pi_train / pi_sampler."""
    cap: float = 0.0
    """Upper bound of r (>= 1; 0 = off, on every engine; TRL's vllm_importance_sampling_cap)."""
    mode: str = "token_truncate"
    """How the cap bounds r (TRL's vllm_importance_sampling_mode): token_truncate (min(r, cap)) | token_mask (tokens with r > cap leave the loss) | sequence_truncate (the sequence's product of ratios, capped, on each token) | sequence_mask (sequences whose product exceeds the cap leave the loss)."""
    min: float = 0.0
    """Lower bound c of r (TRL's vllm_importance_sampling_clip_min): the truncate modes raise ratios below c to c, the mask modes drop tokens (or sequences) below c; 0 = none; 0 <= c < cap."""


@dataclass
class ClipCovOptions:
    """algo.cov_control=clip_cov (Cui et al. 2025, arXiv:2505.22617; verl's defaults)."""
    ratio: float = 0.0002
    """Share of the rollout's tokens whose policy term is dropped."""
    lb: float = 1.0
    """A dropped token's covariance of log-prob and advantage lies above this ..."""
    ub: float = 5.0
    """... and below this."""


@dataclass
class KLCovOptions:
    """algo.cov_control=kl_cov (Cui et al. 2025, arXiv:2505.22617; verl's defaults)."""
    ratio: float = 0.0002
    """Share of the rollout's tokens, those of largest covariance, that carry the penalty."""
    coef: float = 0.1
    """Weight of |log pi_theta - log pi_old| on those tokens (verl's ppo_kl_coef)."""


@dataclass
class AdaptiveEntropyOptions:
    """Adaptive entropy control (He et al. 2025, Skywork-OR1, arXiv:2505.22312): the bonus's coefficient, from algo.entropy_coef, moves each step toward a target entropy and applies only while the entropy is at or below it."""
    enabled: bool = False
    """On or off (algo.adaptive_entropy=true is short for this)."""
    target: float = 0.2
    """The target mean token entropy in nats (Skywork-OR1: 0.2)."""
    coef_delta: float = 0.005
    """The coefficient's change per step (Skywork-OR1: 0.005)."""
    coef_max: float = 1.0
    """The coefficient's upper bound (TRL's entropy_coef_max)."""


@dataclass
class AlgoConfig:
    learner: str = "advantage"
    """Update: advantage (the estimator's advantages through the policy loss) | dpo (iterative DPO on each group's best-vs-worst pair; algo.dpo.*) | sft (supervised fine-tuning on sft.data; covey sft) | distill (on-policy distillation from algo.distill.teacher)."""
    estimator: str = "grpo"
    """Advantage estimator (covey.algos.ESTIMATORS): grpo | grpo_process | rloo | remax | reinforce_pp | reinforce_pp_baseline | gae (algo.gae.*)."""
    policy_loss: str = "ppo_clip"
    """Policy loss (covey.algos.POLICY_LOSSES): ppo_clip | pg | cispo (MiniMax 2025, arXiv:2506.13585: the importance weight clipped and detached) | sapo (Gao et al. 2025, arXiv:2511.20347: a soft gate; algo.sapo.*) | gmpo (Zhao et al. 2025, arXiv:2507.20673: geometric mean of clipped token ratios; algo.gmpo.*) | luspo (arXiv:2602.05261: GSPO weighted by length) | vespo (arXiv:2602.10693: a gamma kernel of the sequence weight; algo.vespo.*)."""
    loss_agg: str = "seq_mean_token_mean"
    """Aggregation: token_mean | seq_mean_token_mean | seq_mean_token_sum | constant."""
    clip_eps_low: float = 0.2
    """Lower clip: ratio >= 1 - eps_low."""
    clip_eps_high: float = 0.2
    """Upper clip: ratio <= 1 + eps_high."""
    dual_clip: float = 0.0
    """Dual-clip constant c > 1 for negative advantages (0 = off)."""
    ratio_level: str = "token"
    """Importance ratio per token | sequence (GSPO)."""
    ratio_against: str = "old"
    """Ratio denominator: old (sampling policy) | ref (the reference model: a form some derivations use; not a trust region)."""
    sapo: SapoOptions = field(default_factory=SapoOptions)
    gmpo: GmpoOptions = field(default_factory=GmpoOptions)
    vespo: VespoOptions = field(default_factory=VespoOptions)
    beta: float = 0.04
    """KL coefficient to the reference model."""
    kl_estimator: str = "k3"
    """KL estimator: k1 | k2 | k3 | abs | k1_st | k3_st."""
    kl_in: str = "loss"
    """Where the KL goes: loss (GRPO) | reward (PPO, REINFORCE++) | none."""
    adaptive_kl: AdaptiveKLOptions = field(default_factory=AdaptiveKLOptions)
    entropy_coef: float = 0.0
    """Entropy bonus weight c2."""
    std_normalize: bool = True
    """Divide group-centred rewards by the group std (off = Dr. GRPO)."""
    ddof: int = 0
    """Degrees of freedom of the group std."""
    adv_eps: float = 1e-6
    """Epsilon added to the std."""
    token_credit: str = "shared"
    """How a sequence's advantage is spread over its tokens: shared (every token) | uniform (A/T) | discounted (gamma^(T-k), normalised)."""
    normalize: str = "auto"
    """Advantage normalisation: auto (the estimator's paper default) | group | batch | global_token | none."""
    gamma: float = 1.0
    """Discount factor (reinforce_pp, gae, token_credit=discounted)."""
    gae: GaeOptions = field(default_factory=GaeOptions)
    epochs: int = 1
    """mu: update epochs over each rollout."""
    minibatches: int = 1
    """Optimizer steps per epoch (mini-batches of the rollout)."""
    micro_batch_size: int = 8
    """Sequences per forward/backward (memory knob; does not change the gradient)."""
    dynamic_sampling: DynamicSamplingOptions = field(default_factory=DynamicSamplingOptions)
    mask_truncated: bool = False
    """DAPO's overlong filtering (Yu et al. 2025, arXiv:2503.14476): responses cut at the token budget (no end token) count in their group's advantages but are left out of the loss, its normaliser and the token metrics."""
    ref_refresh_every: int = 0
    """Replace the reference by the policy every K steps (0 = never)."""
    ref_ema: float = 0.0
    """Mix the policy into the reference every step with this weight (0 = off)."""
    tis: TisOptions = field(default_factory=TisOptions)
    top_entropy_quantile: float = 1.0
    """Policy gradient only on the tokens whose entropy is in this top share of the rollout's tokens (Wang et al. 2025, arXiv:2506.01939, whose choice is 0.2; TRL's top_entropy_quantile); 1 = every token."""
    adaptive_entropy: AdaptiveEntropyOptions = field(default_factory=AdaptiveEntropyOptions)
    cov_control: str = "none"
    """Covariance-based entropy control (Cui et al. 2025, arXiv:2505.22617; verl's clip_cov / kl_cov losses): none | clip_cov (the policy term of a few random tokens of high covariance of log-prob and advantage dropped; algo.clip_cov.*) | kl_cov (a |log ratio| penalty on the tokens of highest covariance; algo.kl_cov.*)."""
    clip_cov: ClipCovOptions = field(default_factory=ClipCovOptions)
    kl_cov: KLCovOptions = field(default_factory=KLCovOptions)
    dpo: DpoOptions = field(default_factory=DpoOptions)
    distill: DistillOptions = field(default_factory=DistillOptions)


# The flat keys the algo section had before its options were nested, and where each lives now. Named on the
# command line or in a YAML file they fail with one line naming the new key; an older run's config.json or
# config.yaml (covey.config.from_dict) is read with them moved.
MOVED_KEYS = {
    **{f"algo.sapo_{k}": f"algo.sapo.{k}" for k in ("temperature_pos", "temperature_neg")},
    **{f"algo.gmpo_{k}": f"algo.gmpo.{k}" for k in ("log_clip_low", "log_clip_high")},
    **{f"algo.vespo_{k}": f"algo.vespo.{k}" for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")},
    "algo.lam": "algo.gae.lam", "algo.value_clip": "algo.gae.value_clip", "algo.value_coef": "algo.gae.value_coef",
    "algo.dpo_beta": "algo.dpo.beta", "algo.kl_target": "algo.adaptive_kl.target",
    "algo.kl_horizon": "algo.adaptive_kl.horizon", "algo.max_resample_rounds": "algo.dynamic_sampling.max_rounds",
    "algo.tis_cap": "algo.tis.cap", "algo.tis_mode": "algo.tis.mode", "algo.tis_min": "algo.tis.min",
    "algo.entropy_target": "algo.adaptive_entropy.target", "algo.entropy_coef_delta": "algo.adaptive_entropy.coef_delta",
    "algo.entropy_coef_max": "algo.adaptive_entropy.coef_max",
    **{f"algo.clip_cov_{k}": f"algo.clip_cov.{k}" for k in ("ratio", "lb", "ub")},
    **{f"algo.kl_cov_{k}": f"algo.kl_cov.{k}" for k in ("ratio", "coef")},
}
