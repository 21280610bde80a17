"""Each packaged preset is the algorithm it is named after: the fields of its YAML that define the
algorithm, what its estimator's registry traits make the run do, and its advantages on one group
worked by hand.

A preset YAML only sets what differs from the defaults, so `raw` is what the file itself says and
`cfg` is the resolved config.
"""

import pytest
import torch
import yaml

from covey.algos import ESTIMATORS, AdvantageInput, AdvantageOptions, compute_advantages
from covey.config import derived_sizes, load_config, preset_names, preset_path, uses_critic


def preset(name):
    raw = yaml.safe_load(preset_path(name).read_text())["algo"]
    return raw, load_config(name)


def test_every_preset_is_checked_here():
    assert set(preset_names()) == set(ADVANTAGES) | {"dpo_iterative"}


def test_grpo():
    # GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300): A_i = (r_i - mean_g) / std_g on every
    # token of o_i, clipped surrogate against pi_old, KL to pi_ref in the loss with the k3 estimator,
    # beta 0.04, the loss 1/G sum_i 1/|o_i| sum_t; no critic.
    raw, cfg = preset("grpo")
    assert raw == {"estimator": "grpo", "policy_loss": "ppo_clip", "loss_agg": "seq_mean_token_mean",
                   "beta": 0.04, "kl_estimator": "k3", "kl_in": "loss"}
    assert ESTIMATORS["grpo"].min_group_size == 2 and cfg.algo.std_normalize and cfg.algo.normalize == "auto"
    assert not uses_critic(cfg)


def test_dr_grpo():
    # Dr. GRPO (Liu et al. 2025, arXiv:2503.20783): GRPO without the std division and with a
    # constant normaliser (sum over tokens / (G * max length)) instead of 1/|o_i|: both length and
    # difficulty biases removed. The KL term is kept as GRPO has it (the YAML says why).
    raw, cfg = preset("dr_grpo")
    assert raw["estimator"] == "grpo" and raw["std_normalize"] is False and raw["loss_agg"] == "constant"
    assert (cfg.algo.kl_in, cfg.algo.kl_estimator, cfg.algo.beta) == ("loss", "k3", 0.04)
    assert not uses_critic(cfg)


def test_ppo():
    # PPO (Schulman et al. 2017, arXiv:1707.06347) for RLHF (Ouyang et al. 2022, arXiv:2203.02155):
    # a critic and GAE (Schulman et al. 2016, arXiv:1506.02438) with gamma 1, lambda 0.95; the
    # reward is the score on the last token minus beta * k1 KL on every token; clipped policy and
    # value losses, token-mean aggregation, several epochs x mini-batches per rollout.
    raw, cfg = preset("ppo")
    assert raw["estimator"] == "gae" and ESTIMATORS["gae"].needs_values and uses_critic(cfg)
    assert (raw["kl_in"], raw["kl_estimator"]) == ("reward", "k1") and raw["beta"] > 0
    assert ESTIMATORS["gae"].per_token_rewards
    assert (raw["policy_loss"], raw["loss_agg"]) == ("ppo_clip", "token_mean")
    assert (raw["gamma"], raw["lam"]) == (1.0, 0.95) and raw["value_clip"] > 0 and raw["value_coef"] > 0
    assert raw["epochs"] > 1 and raw["minibatches"] > 1 and derived_sizes(cfg)["reuses_old_logprobs"]


@pytest.mark.parametrize("name", ["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp(name):
    # REINFORCE++ (Hu 2025, arXiv:2501.03262): no critic; k1 KL penalty per token in the reward,
    # return G_t = sum of the token rewards from t (gamma 1), whitened over the whole batch; PPO's
    # clip kept; token-mean loss. The -baseline variant subtracts each group's mean score first,
    # so it needs groups of at least two samples.
    raw, cfg = preset(name)
    assert raw["estimator"] == name and ESTIMATORS[name].per_token_rewards and not uses_critic(cfg)
    assert (raw["kl_in"], raw["kl_estimator"]) == ("reward", "k1") and raw["beta"] > 0
    assert (raw["policy_loss"], raw["loss_agg"], raw["gamma"]) == ("ppo_clip", "token_mean", 1.0)
    assert ESTIMATORS[name].min_group_size == (2 if name == "reinforce_pp_baseline" else 1)


def test_rloo():
    # RLOO (Ahmadian et al. 2024, arXiv:2402.14740): baseline = mean of the other G-1 rewards of
    # the prompt, hence groups of at least two; no critic, no std division.
    raw, cfg = preset("rloo")
    assert raw["estimator"] == "rloo" and ESTIMATORS["rloo"].min_group_size == 2 and not uses_critic(cfg)
    assert (raw["kl_in"], raw["kl_estimator"]) == ("loss", "k3")


def test_remax():
    # ReMax (Li et al. 2023, arXiv:2310.10505): baseline = reward of the greedy answer to the same
    # prompt (one extra greedy rollout per prompt); no critic.
    raw, cfg = preset("remax")
    assert raw["estimator"] == "remax" and ESTIMATORS["remax"].greedy_baseline and not uses_critic(cfg)
    assert (raw["kl_in"], raw["kl_estimator"]) == ("loss", "k3")


def test_dpo_iterative():
    # DPO (Rafailov et al. 2023, arXiv:2305.18290) on on-policy pairs, iterated (Xiong et al. 2024,
    # arXiv:2312.11456): loss -log sigmoid(dpo_beta * margin) on each group's best-vs-worst pair; the
    # reference model enters through the margin only: no KL term, no advantages, no critic.
    raw, cfg = preset("dpo_iterative")
    assert raw["learner"] == "dpo" and raw["dpo_beta"] > 0
    assert raw["beta"] == 0.0 and raw["kl_in"] == "none"
    assert (raw["epochs"], raw["minibatches"]) == (1, 1) and not uses_critic(cfg)


# One prompt, two one-token answers with rewards 1 and 0 (ReMax's greedy answer scores 0.5,
# PPO's critic predicts 0). Worked by hand with eps = 1e-6:
#   grpo:    mean 0.5, population std 0.5 -> (+-0.5) / (0.5 + 1e-6) = +-0.999998
#   dr_grpo: no std division -> +-0.5
#   rloo:    1 - 0 = 1, 0 - 1 = -1 (leave-one-out baseline; no normalisation)
#   remax:   1 - 0.5 = 0.5, 0 - 0.5 = -0.5
#   reinforce_pp: returns (1, 0), whitened over the batch's two tokens: mean 0.5, std 0.5 -> +-0.999998
#   reinforce_pp_baseline: group mean subtracted (+-0.5), then whitened: std 0.5 -> +-0.999998
#   ppo: GAE with V = 0 on a one-token answer: A = r - V = (1, 0), whitened -> +-0.999998
ADVANTAGES = {"grpo": 0.999998, "dr_grpo": 0.5, "rloo": 1.0, "remax": 0.5, "reinforce_pp": 0.999998,
              "reinforce_pp_baseline": 0.999998, "ppo": 0.999998}


@pytest.mark.parametrize("name", sorted(ADVANTAGES))
def test_advantages_of_one_group_by_hand(name):
    a = load_config(name).algo
    traits = ESTIMATORS[a.estimator]
    inp = AdvantageInput(scores=torch.tensor([1.0, 0.0], dtype=torch.float64),
                         response_mask=torch.ones(2, 1, dtype=torch.bool), group_ids=torch.tensor([0, 0]),
                         values=torch.zeros(2, 1, dtype=torch.float64) if traits.needs_values else None,
                         baseline_scores=torch.tensor([0.5, 0.5], dtype=torch.float64)
                         if traits.greedy_baseline else None)
    opts = AdvantageOptions(gamma=a.gamma, lam=a.lam, eps=a.adv_eps, std_normalize=a.std_normalize, ddof=a.ddof,
                            token_credit=a.token_credit, normalize=a.normalize)
    adv, _, _ = compute_advantages(a.estimator, inp, opts)
    assert adv[:, 0].tolist() == pytest.approx([ADVANTAGES[name], -ADVANTAGES[name]], abs=1e-6)
