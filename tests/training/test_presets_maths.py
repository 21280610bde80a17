"""Each packaged preset is the algorithm it is named after: the fields of its YAML that define the
algorithm, what the run's plan (covey.training.plan.make_plan, what the trainer reads) derives from
them and from its estimator's registry traits, and its advantages on one group worked by hand.

A preset YAML only sets what differs from the defaults, so `raw` is what the file itself says and
`plan` is what the trainer runs. Every preset samples the defaults' 8 prompts x 8 answers = 64
sequences per step in micro-batches of 8.
"""

import math

import pytest
import torch
import yaml

from covey.algos import ESTIMATORS, AdvantageInput, PolicyInputs, compute_advantages, make_normalizer, policy_loss
from covey.config import load_config, preset_names, preset_path
from covey.training.plan import Sizes, make_plan

ONE_STEP = Sizes(sequences_per_step=64, sequences_per_minibatch=64, micro_batches_per_minibatch=8,
                 optimizer_steps_per_rollout=1)
"""One optimizer step on the whole rollout: 64 sequences in 64 / 8 = 8 micro-batches."""


def preset(name):
    raw = yaml.safe_load(preset_path(name).read_text())["algo"]
    return raw, make_plan(load_config(name))


def test_every_preset_is_checked_here():
    # wordproblems_gpu is a recipe (task and sizes, no algo section): tests/bench/test_gpu_learn.py
    assert set(preset_names()) == set(ADVANTAGES) | {"dpo_iterative", "wordproblems_gpu"}


def test_grpo():
    # GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): A_i = (r_i - mean_g) / std_g on every
    # token of o_i, clipped surrogate against pi_old, KL to pi_ref in the loss with the k3 estimator,
    # beta 0.04, the loss 1/G sum_i 1/|o_i| sum_t; no critic.
    # One optimizer step per rollout and the KL in the loss: pi_old is the policy's own detached
    # log-probs (ratio 1), so no separate old log-prob pass runs.
    raw, plan = preset("grpo")
    assert raw == {"estimator": "grpo", "policy_loss": "ppo_clip", "loss_agg": "seq_mean_token_mean",
                   "beta": 0.04, "kl_estimator": "k3", "kl_in": "loss"}
    assert plan.traits.min_group_size == 2 and plan.advantage.std_normalize and plan.advantage.normalize == "auto"
    assert plan.traits.default_normalize == "group"
    assert (plan.update.kl_in_loss, plan.update.kl_estimator, plan.kl.beta) == (True, "k3", 0.04)
    assert plan.needs_reference and not plan.needs_critic and not plan.needs_old_logprobs
    assert plan.sizes == ONE_STEP


def test_dr_grpo():
    # Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): GRPO without the std division and with a
    # constant normaliser (sum over tokens / (G * max length)) instead of 1/|o_i|: both length and
    # difficulty biases removed. The KL term is kept as GRPO has it (the YAML says why).
    raw, plan = preset("dr_grpo")
    assert raw["estimator"] == "grpo" and raw["std_normalize"] is False and raw["loss_agg"] == "constant"
    assert (plan.kl.placement, plan.kl.estimator, plan.kl.beta) == ("loss", "k3", 0.04)
    assert not plan.advantage.std_normalize and plan.update.loss_agg == "constant"
    assert not plan.needs_critic and not plan.needs_old_logprobs and plan.sizes == ONE_STEP


def test_ppo():
    # PPO (Schulman et al. 2017, arXiv:1707.06347) for RLHF (Ouyang et al. 2022, arXiv:2203.02155):
    # a critic and GAE (Schulman et al. 2016, arXiv:1506.02438) with gamma 1, lambda 0.95; the
    # reward is the score on the last token minus beta * k1 KL on every token; clipped policy and
    # value losses, token-mean aggregation, several epochs x mini-batches per rollout.
    # 2 epochs x 2 mini-batches = 4 optimizer steps per rollout, each on 64 / 2 = 32 sequences
    # (4 micro-batches of 8); after the first step the policy has moved, so pi_old is a separate pass.
    raw, plan = preset("ppo")
    assert raw["estimator"] == "gae" and ESTIMATORS["gae"].needs_values and plan.needs_critic
    assert (raw["kl_in"], raw["kl_estimator"]) == ("reward", "k1") and raw["beta"] > 0
    assert plan.traits.per_token_rewards and not plan.update.kl_in_loss
    assert (raw["policy_loss"], raw["loss_agg"]) == ("ppo_clip", "token_mean")
    gae = raw["gae"]
    assert (raw["gamma"], gae["lam"]) == (1.0, 0.95) and gae["value_clip"] > 0 and gae["value_coef"] > 0
    assert (plan.update.value_clip, plan.update.value_coef) == (gae["value_clip"], gae["value_coef"])
    assert raw["epochs"] > 1 and raw["minibatches"] > 1 and plan.needs_old_logprobs
    assert plan.sizes == Sizes(sequences_per_step=64, sequences_per_minibatch=32, micro_batches_per_minibatch=4,
                               optimizer_steps_per_rollout=4)


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp(name):
    # REINFORCE++ (Hu 2025, arXiv:2501.03262): no critic; k1 KL penalty per token in the reward,
    # return G_t = sum of the token rewards from t (gamma 1), whitened over the whole batch; PPO's
    # clip kept; token-mean loss. The -baseline variant subtracts each group's mean score first,
    # so it needs groups of at least two samples.
    # The KL penalty in the reward is read from the policy's log-probs before the update: a
    # separate old log-prob pass, though there is one optimizer step per rollout.
    raw, plan = preset(name)
    assert raw["estimator"] == name and ESTIMATORS[name].per_token_rewards and not plan.needs_critic
    assert (raw["kl_in"], raw["kl_estimator"]) == ("reward", "k1") and raw["beta"] > 0
    assert plan.needs_old_logprobs and plan.sizes == ONE_STEP and plan.traits.default_normalize == "global_token"
    assert (raw["policy_loss"], raw["loss_agg"], raw["gamma"]) == ("ppo_clip", "token_mean", 1.0)
    assert ESTIMATORS[name].min_group_size == (2 if name == "reinforce_pp_baseline" else 1)


def test_rloo():
    # RLOO (Ahmadian et al. 2024, arXiv:2402.14740): baseline = mean of the other G-1 rewards of
    # the prompt, hence groups of at least two; no critic, no std division.
    raw, plan = preset("rloo")
    assert raw["estimator"] == "rloo" and ESTIMATORS["rloo"].min_group_size == 2 and not plan.needs_critic
    assert (raw["kl_in"], raw["kl_estimator"]) == ("loss", "k3")
    assert not plan.needs_old_logprobs and plan.sizes == ONE_STEP


def test_remax():
    # ReMax (Li et al. 2023, arXiv:2310.10505): baseline = reward of the greedy answer to the same
    # prompt (one extra greedy rollout per prompt); no critic.
    raw, plan = preset("remax")
    assert raw["estimator"] == "remax" and ESTIMATORS["remax"].greedy_baseline and not plan.needs_critic
    assert (raw["kl_in"], raw["kl_estimator"]) == ("loss", "k3")
    assert not plan.needs_old_logprobs and plan.sizes == ONE_STEP


def test_dpo_iterative():
    # DPO (Rafailov et al. 2023, arXiv:2305.18290) on on-policy pairs, iterated (Xiong et al. 2024,
    # arXiv:2312.11456): loss -log sigmoid(algo.dpo.beta * margin) on each group's best-vs-worst pair; the
    # reference model enters through the margin only: no KL term, no advantages, no critic.
    # The reference is kept for the margin; no importance ratio, so no old log-prob pass.
    raw, plan = preset("dpo_iterative")
    assert raw["learner"] == "dpo" and raw["dpo"]["beta"] > 0 and plan.learner == "dpo"
    assert raw["beta"] == 0.0 and raw["kl_in"] == "none" and plan.update.dpo_beta == raw["dpo"]["beta"]
    assert (raw["epochs"], raw["minibatches"]) == (1, 1) and not plan.needs_critic
    assert plan.needs_reference and not plan.needs_old_logprobs and plan.sizes == ONE_STEP


FOUR_STEPS = Sizes(sequences_per_step=64, sequences_per_minibatch=16, micro_batches_per_minibatch=2,
                   optimizer_steps_per_rollout=4)
"""The loss presets' off-policy update: 64 sequences in 4 mini-batches of 16 (2 micro-batches of 8), so
after the first optimizer step pi_old differs from the policy and the loss's clip or weight acts."""


def grpo_without_kl(plan):
    # GRPO's group advantages (std division, group normalisation), no reference model, no critic
    assert plan.traits.default_normalize == "group" and plan.advantage.std_normalize
    assert plan.kl.placement == "none" and plan.kl.beta == 0.0 and not plan.needs_reference
    assert not plan.needs_critic and plan.needs_old_logprobs and plan.sizes == FOUR_STEPS


def test_dapo():
    # DAPO (Yu et al. 2025, arXiv:2503.14476): clip-higher (1 - 0.2 <= r <= 1 + 0.28), the token-level
    # loss (every token of the step weighs 1 / total tokens), dynamic sampling, overlong filtering and
    # the soft overlong punishment, no KL.
    raw, plan = preset("dapo")
    assert (raw["clip_eps_low"], raw["clip_eps_high"]) == (0.2, 0.28) and plan.update.loss.clip_eps_high == 0.28
    assert plan.update.loss_agg == "token_mean" and plan.update.policy_loss == "ppo_clip"
    assert plan.sampling.dynamic_sampling and plan.update.mask_truncated
    # the buffer is the paper's share of the budget: 4096 / 20480 = 0.2; 8 / 32 = 0.25 of the default 32
    cfg = load_config("dapo")
    assert cfg.reward.overlong_buffer == 8 and cfg.rollout.max_new_tokens == 32
    grpo_without_kl(plan)


def test_gspo():
    # GSPO (Zheng et al. 2025, arXiv:2507.18071): the sequence ratio s_i = exp(mean_t log r_{i,t}),
    # clipped to [1 - 3e-4, 1 + 4e-4], one term per sequence, averaged over the group.
    raw, plan = preset("gspo")
    assert plan.update.loss.ratio_level == "sequence" and plan.update.policy_loss == "ppo_clip"
    assert (plan.update.loss.clip_eps_low, plan.update.loss.clip_eps_high) == (3e-4, 4e-4)
    assert plan.update.loss_agg == "seq_mean_token_mean"
    grpo_without_kl(plan)
    # Two sequences of two tokens, A = +1 and -1, token log-ratios (0.001, 0.0002) and (-0.001, 0.0):
    #   s_1 = exp(0.0006) = 1.00060018 > 1 + 4e-4: for A > 0 the clipped term 1.0004 * 1 is the min,
    #       loss term -1.0004, no gradient;
    #   s_2 = exp(-0.0005) = 0.99950012 < 1 - 3e-4: for A < 0, min(-s_2, -0.9997) = -0.9997 (clipped),
    #       loss term +0.9997, no gradient.
    # Each sequence's term sits on its two tokens; token mean then sequence mean:
    #   loss = (-1.0004 + 0.9997) / 2 = -0.00035, and both sequences count as clipped.
    logp = torch.zeros(2, 2, dtype=torch.float64, requires_grad=True)
    old = torch.tensor([[-0.001, -0.0002], [0.001, 0.0]], dtype=torch.float64)
    mask = torch.ones(2, 2)
    adv = torch.tensor([[1.0, 1.0], [-1.0, -1.0]], dtype=torch.float64)
    norm = make_normalizer(plan.update.loss_agg, mask)
    loss, metrics = policy_loss(plan.update.policy_loss, PolicyInputs(logp, old, adv, mask), norm, plan.update.loss)
    assert float(loss.detach()) == pytest.approx(-0.00035, abs=1e-12) and metrics["policy/clipfrac"] == 1.0
    loss.backward()
    assert torch.equal(logp.grad, torch.zeros(2, 2, dtype=torch.float64))


def test_cispo():
    # CISPO (MiniMax 2025, arXiv:2506.13585): l = -sg(clip(r, 1 - 1, 1 + 0.28)) A log pi, token-level
    # loss, no KL. One token, A = 1, log-ratio log 1.5 (r = 1.5): the weight is min(1.5, 1.28) = 1.28,
    # the loss -1.28 * logp = 1.28 * log 1.5 at logp = -log 1.5 (old logp -2 log 1.5), and the
    # gradient d loss / d logp = -1.28 (PPO's clip would give 0 here).
    raw, plan = preset("cispo")
    assert plan.update.policy_loss == "cispo" and plan.update.loss_agg == "token_mean"
    assert (plan.update.loss.clip_eps_low, plan.update.loss.clip_eps_high) == (1.0, 0.28)
    grpo_without_kl(plan)
    half = math.log(1.5)
    logp = torch.tensor([[-half]], dtype=torch.float64, requires_grad=True)
    old, mask, adv = torch.tensor([[-2 * half]], dtype=torch.float64), torch.ones(1, 1), torch.ones(1, 1)
    loss, _ = policy_loss("cispo", PolicyInputs(logp, old, adv.double(), mask), make_normalizer("token_mean", mask),
                          plan.update.loss)
    loss.backward()
    assert float(loss.detach()) == pytest.approx(1.28 * half, abs=1e-12) and float(logp.grad) == pytest.approx(-1.28)


def test_sapo():
    # SAPO (Gao et al. 2025, arXiv:2511.20347): the soft gate 4/tau sigmoid(tau (r - 1)) with
    # tau_pos 1.0 (A > 0) and tau_neg 1.05 (A < 0), the sequence-mean of the token mean, no KL.
    raw, plan = preset("sapo")
    assert plan.update.policy_loss == "sapo" and plan.update.loss_agg == "seq_mean_token_mean"
    assert (plan.update.loss.sapo.temperature_pos, plan.update.loss.sapo.temperature_neg) == (1.0, 1.05)
    grpo_without_kl(plan)


def test_gmpo():
    # GMPO (Zhao et al. 2025, arXiv:2507.20673): the geometric mean of each sequence's token ratios,
    # token log-ratios clipped at +-0.4; the loss is defined with the sequence mean of the token mean
    # (the registry's aggregation, whatever algo.loss_agg says), no KL.
    raw, plan = preset("gmpo")
    assert plan.update.policy_loss == "gmpo" and plan.update.loss_agg == "seq_mean_token_mean"
    assert (plan.update.loss.gmpo.log_clip_low, plan.update.loss.gmpo.log_clip_high) == (0.4, 0.4)
    grpo_without_kl(plan)


# One prompt, two one-token answers with rewards 1 and 0 (ReMax's greedy answer scores 0.5,
# PPO's critic predicts 0). Worked by hand with eps = 1e-6:
#   grpo:    mean 0.5, population std 0.5 -> (+-0.5) / (0.5 + 1e-6) = +-0.999998
#   dr_grpo: no std division -> +-0.5
#   rloo:    1 - 0 = 1, 0 - 1 = -1 (leave-one-out baseline; no normalisation)
#   remax:   1 - 0.5 = 0.5, 0 - 0.5 = -0.5
#   reinforce_pp: returns (1, 0), whitened over the batch's two tokens: mean 0.5, std 0.5 -> +-0.999998
#   reinforce_pp_baseline: group mean subtracted (+-0.5), then whitened: std 0.5 -> +-0.999998
#   ppo: GAE with V = 0 on a one-token answer: A = r - V = (1, 0), whitened -> +-0.999998
#   dapo, gspo, cispo, sapo, gmpo: GRPO's advantages -> +-0.999998
ADVANTAGES = {"grpo": 0.999998, "dapo": 0.999998, "gspo": 0.999998, "cispo": 0.999998, "sapo": 0.999998,
              "gmpo": 0.999998, "dr_grpo": 0.5, "rloo": 1.0, "remax": 0.5, "reinforce_pp": 0.999998,
              "reinforce_pp_baseline": 0.999998, "ppo": 0.999998}


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_advantages_of_one_group_by_hand(name):
    plan = make_plan(load_config(name))
    traits = plan.traits
    inp = AdvantageInput(scores=torch.tensor([1.0, 0.0], dtype=torch.float64),
                         response_mask=torch.ones(2, 1, dtype=torch.bool), group_ids=torch.tensor([0, 0]),
                         values=torch.zeros(2, 1, dtype=torch.float64) if traits.needs_values else None,
                         baseline_scores=torch.tensor([0.5, 0.5], dtype=torch.float64)
                         if traits.greedy_baseline else None)
    adv, _, _ = compute_advantages(plan.estimator, inp, plan.advantage)  # the options the trainer passes
    assert adv[:, 0].tolist() == pytest.approx([ADVANTAGES[name], -ADVANTAGES[name]], abs=1e-6)
