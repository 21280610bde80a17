"""covey.algos: the pure tensor maths of RL post-training (imports only torch).

Tensors and plain scalars in, ``(tensor(s), metrics_dict)`` out; metrics are plain floats.
Formulas, option names, defaults and sources: docs/algorithms.md (its "API" section lists
everything exported here).

Modules:
- options: the inputs and options of the advantage estimators and policy losses (PolicyInputs: what a
  policy loss reads, the token devices' weights among it);
- advantages: group-baseline estimators (GRPO outcome and process, RLOO, ReMax) and the estimator
  registry; returns: token-level estimators (REINFORCE++, GAE);
- _prep: input checks and option resolution shared by the estimators; _stats: masked and grouped
  statistics shared by the estimators and losses;
- losses: policy / value / entropy / KL loss terms; soft_losses: SAPO, GMPO, VESPO; loss_registry:
  every policy loss by name with its traits (what it does with each token device's weights included);
  objective: policy loss + KL + entropy, masked first (the micro-batch objective the trainer runs);
  aggregation: the global normaliser;
- kl: per-token KL estimators and controllers; logits: chunked log-probs, entropy, full KL;
  linear_logits: the same from hidden states and the output layer, no full logits;
- dpo: the DPO loss on best-vs-worst pairs; rm_losses: reward-model losses (Bradley-Terry pairs,
  labelled steps); distill: the supervised token loss, on-policy distillation's reverse-KL advantages and
  GKD's generalized JSD;
- tis: importance weights of the four TIS modes, sampler vs trainer; token_select: high-entropy
  tokens, Clip-Cov / KL-Cov selections; entropy_control: fixed or adaptive entropy coefficient;
  router: the load-balancing loss of a mixture of experts' routers, its step share.
"""

from covey.algos._stats import GroupStats, group_stats, masked_mean, masked_std, whiten
from covey.algos.advantages import (
    ESTIMATORS,
    Estimator,
    compute_advantages,
    grpo,
    grpo_process,
    remax,
    rloo,
    spread_over_tokens,
    steps_to_tokens,
)
from covey.algos.aggregation import AGGREGATIONS, Normalizer, aggregate, make_normalizer, mask_truncated, step_totals
from covey.algos.distill import generalized_jsd, jsd_loss, reverse_kl_advantages, token_nll, top_k_logits
from covey.algos.dpo import best_worst_pairs, dpo_loss, sequence_logprob
from covey.algos.entropy_control import AdaptiveEntropyController, FixedEntropyController
from covey.algos.kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_penalty
from covey.algos.linear_logits import linear_logprobs_and_entropy
from covey.algos.logits import entropy_from_logits, full_kl, logprobs_and_entropy, selective_log_softmax
from covey.algos.loss_registry import (
    POLICY_LOSSES,
    TOKEN_DEVICES,
    WEIGHT_USES,
    PolicyLoss,
    WeightUse,
    policy_loss,
    token_device_use,
)
from covey.algos.losses import (
    LOG_RATIO_CLAMP,
    cispo_loss,
    entropy_loss,
    explained_variance,
    kl_loss,
    pg_loss,
    ppo_clip_loss,
    value_loss,
)
from covey.algos.objective import ObjectiveOptions, policy_objective
from covey.algos.options import AdvantageInput, AdvantageOptions, PolicyInputs, PolicyLossOptions
from covey.algos.returns import (
    discounted_returns,
    gae,
    gae_advantages,
    reinforce_pp,
    reinforce_pp_baseline,
    token_rewards,
)
from covey.algos.router import load_balancing_loss, step_share
from covey.algos.soft_losses import gmpo_loss, sapo_loss, vespo_loss
from covey.algos.tis import TIS_DEVICES, TIS_MODES, importance_weights, sampler_mismatch, truncated_is_weights
from covey.algos.token_select import (
    COV_CONTROLS,
    CovOptions,
    high_entropy_mask,
    select_cov_tokens,
    token_covariance,
)

__all__ = [
    "AGGREGATIONS", "COV_CONTROLS", "CovOptions", "ESTIMATORS", "TIS_DEVICES", "TIS_MODES", "TOKEN_DEVICES",
    "WEIGHT_USES", "ObjectiveOptions", "PolicyInputs", "WeightUse", "token_device_use", "AdaptiveEntropyController",
    "FixedEntropyController", "high_entropy_mask", "importance_weights", "select_cov_tokens", "token_covariance",
    "KL_ESTIMATORS", "LOG_RATIO_CLAMP", "POLICY_LOSSES",
    "AdaptiveKLController", "AdvantageInput", "AdvantageOptions", "Estimator", "FixedKLController", "GroupStats",
    "Normalizer", "PolicyLoss", "PolicyLossOptions", "gmpo_loss", "sapo_loss", "vespo_loss",
    "aggregate", "best_worst_pairs", "cispo_loss", "compute_advantages", "discounted_returns", "dpo_loss",
    "entropy_from_logits", "entropy_loss", "explained_variance", "full_kl", "logprobs_and_entropy",
    "gae", "gae_advantages", "group_stats", "grpo", "grpo_process", "kl_loss", "kl_penalty",
    "linear_logprobs_and_entropy", "load_balancing_loss", "make_normalizer",
    "mask_truncated", "masked_mean", "masked_std", "pg_loss", "policy_loss", "policy_objective", "ppo_clip_loss",
    "reinforce_pp",
    "reinforce_pp_baseline", "remax", "rloo", "selective_log_softmax", "sequence_logprob", "spread_over_tokens",
    "step_share", "step_totals",
    "steps_to_tokens", "token_rewards", "generalized_jsd", "jsd_loss", "reverse_kl_advantages", "token_nll",
    "top_k_logits", "sampler_mismatch", "truncated_is_weights", "value_loss", "whiten",
]
