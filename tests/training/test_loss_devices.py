"""Every policy loss with every token device: what the pair means, worked by hand, or the plan's refusal in one
line naming both keys. A device hands the loss a weight of its kind (covey.algos.TOKEN_DEVICES) and the loss's
`token_weights` trait says what it means (covey.algos.WEIGHT_USES); `test_every_loss_and_device_has_a_case`
fails when a new loss or device lacks one here.

The worked example, on policy (logp = old_logp, every ratio 1), two sequences of two tokens:

    logp = [[-1, -2], [-1, -1]]      A = [[1, 1], [-2, -2]]

Each loss's per-token term v_t at ratio 1 and its gradient u_t = d v_t / d logp_t, before the normaliser:

    ppo_clip  v = max(-A r, -A clip(r)) = -A              u = -A r = -A
    pg        v = -A logp                                 u = -A
    cispo     v = -sg(clip(r)) A logp = -A logp           u = -A
    sapo      v = -(4 / tau) sigmoid(0) A = -2 A / tau     u = -A * 4 s (1 - s) r = -A      (s = 1/2)
              (tau = 1 for A = 1: v = -2; tau = 1.05 for A = -2: v = 4 / 1.05)
    vespo     v = -phi(W) A logp, W = 1: phi = 1          u = -A
    luspo     v = -A s_i, s_i = 1 (GSPO's sequence ratio) u = -A
    gmpo      l_i = -A_i g_i, g_i = 1: (-1, 2), on each of the sequence's tokens

Normalisers: token_mean (4 tokens: D = 4) for ppo_clip, pg, cispo, sapo, vespo; luspo's seq_mean_token_sum
(num_seqs 2: D = 2); gmpo's seq_mean_token_mean (T_i = 2, 2 sequences). A `scale_term` loss with weights w_t
has loss sum_t w_t v_t / D and gradient w_t u_t / D.
"""

import itertools

import pytest
import torch

from covey import algos
from covey.algos import CovOptions, Normalizer, ObjectiveOptions, PolicyInputs
from covey.config import ConfigError, load_config
from covey.config.schema_algo import KLCovOptions
from covey.training.plan import make_plan

F64 = torch.float64
LOGP = [[-1.0, -2.0], [-1.0, -1.0]]
ADV = [[1.0, 1.0], [-2.0, -2.0]]
ONE_MINUS_HALF = [[1.0, 0.0], [0.0, 1.0]]   # the tokens a selection keeps (Clip-Cov: the other two chosen)
AGG = {"luspo": ("seq_mean_token_sum", 2.0), "gmpo": ("seq_mean_token_mean", None)}  # else token_mean, D = 4
TERMS = {  # (v_t, u_t) per loss, from the docstring
    "ppo_clip": ([[-1, -1], [2, 2]], [[-1, -1], [2, 2]]),
    "pg": ([[1, 2], [-2, -2]], [[-1, -1], [2, 2]]),
    "cispo": ([[1, 2], [-2, -2]], [[-1, -1], [2, 2]]),
    "sapo": ([[-2, -2], [4 / 1.05, 4 / 1.05]], [[-1, -1], [2, 2]]),
    "vespo": ([[1, 2], [-2, -2]], [[-1, -1], [2, 2]]),
    "luspo": ([[-1, -1], [2, 2]], [[-1, -1], [2, 2]]),
}
# What each device hands the loss in the worked example, as PolicyInputs fields and objective options.
DEVICE_INPUTS = {
    "tis_token": ({"is_weights": [[0.5, 2.0], [1.5, 0.0]]}, None),     # token_mask dropped the last token
    "tis_sequence": ({"is_weights": [[0.5, 0.5], [2.0, 2.0]]}, None),
    "top_entropy": ({"kept": ONE_MINUS_HALF}, None),
    "clip_cov": ({"cov_tokens": [[0.0, 1.0], [1.0, 0.0]]}, CovOptions(control="clip_cov")),
    "kl_cov": ({"cov_tokens": [[1.0, 0.0], [0.0, 0.0]]}, CovOptions(control="kl_cov", kl_cov=KLCovOptions(coef=0.1))),
}
DEVICE_KEYS = {  # the config that turns each device on
    "tis_token": ["algo.tis.cap=2", "algo.tis.mode=token_mask"],
    "tis_sequence": ["algo.tis.cap=2", "algo.tis.mode=sequence_truncate"],
    "top_entropy": ["algo.top_entropy_quantile=0.2"],
    "clip_cov": ["algo.cov_control=clip_cov"],
    "kl_cov": ["algo.cov_control=kl_cov"],
}
SCALE = {"tis_token": [[0.5, 2.0], [1.5, 0.0]], "tis_sequence": [[0.5, 0.5], [2.0, 2.0]],
         "top_entropy": ONE_MINUS_HALF, "clip_cov": ONE_MINUS_HALF}   # a scale_term loss's w_t


def scaled(loss: str, device: str):
    """sum_t w_t v_t / D and w_t u_t / D (the module docstring)."""
    value, grad = (torch.tensor(t, dtype=F64) for t in TERMS[loss])
    w, d = torch.tensor(SCALE[device], dtype=F64), AGG.get(loss, (None, 4.0))[1]
    return float((w * value).sum() / d), w * grad / d


# gmpo (select_tokens), seq_mean_token_mean: loss = mean_i l_i, d l / d logp_t = l_i-gradient / (T or |S_i|) / 2
#   tis_sequence, w = (0.5, 2): l = (-0.5 * 1, -2 * -2) = (-0.5, 4), loss 1.75;
#       gradient -w_i A_i / T_i / 2: seq 1 -0.5 / 2 / 2 = -0.125, seq 2 4 / 2 / 2 = 1.0
#   top_entropy, clip_cov, kept (0,0) and (1,1): S_1 = {0}, S_2 = {1}, g_i = exp(0 / 1) = 1: l = (-1, 2), loss 0.5;
#       the kept token carries the whole mean: -A_i / |S_i| / 2 = -0.5 and 1.0; a dropped token 0
#       (without the selection every token had -A_i / 2 / 2 = -0.25 and 0.5)
# vespo (sampler_in_weight), tis_token: the weights act inside W, not on the term:
#   W_1 = 0.5 * 2 = 1 -> phi_1 = 1 (not the term's weights 0.5 and 2): terms (1, 2), gradient -A / 4 = -0.25 each;
#   W_2 = 1.5 * 0 -> log W clamped to log 1e-8: phi_2 = 1e-24 e^(2 (1 - 1e-8)) = 7.4e-24, nothing
#   loss (1 + 2) / 4 = 0.75
BY_HAND = {
    ("gmpo", "tis_sequence"): (1.75, [[-0.125, -0.125], [1.0, 1.0]]),
    ("gmpo", "top_entropy"): (0.5, [[-0.5, 0.0], [0.0, 1.0]]),
    ("gmpo", "clip_cov"): (0.5, [[-0.5, 0.0], [0.0, 1.0]]),
    ("vespo", "tis_token"): (0.75, [[-0.25, -0.25], [0.0, 0.0]]),
    **{(loss, device): scaled(loss, device) for loss in TERMS for device in SCALE
       if (loss, device) not in {("vespo", "tis_token"), ("vespo", "tis_sequence")}},
}
REFUSED = {
    ("gmpo", "tis_token"): "algo.tis.mode=token_mask: algo.policy_loss=gmpo has one term per sequence",
    ("vespo", "tis_sequence"): "algo.tis.mode=sequence_truncate: algo.policy_loss=vespo reshapes the whole "
                               "sequence's weight",
}
PENALTY = {loss: "kl_cov" for loss in algos.POLICY_LOSSES}   # every loss: the drift penalty beside its term


def objective(loss: str, device: str | None, old=None):
    """(loss, d loss / d logp) of the worked example with `device`'s inputs (None: no device)."""
    fields, cov = DEVICE_INPUTS[device] if device else ({}, None)
    logp = torch.tensor(LOGP, dtype=F64, requires_grad=True)
    mode = AGG.get(loss, ("token_mean",))[0]
    tensors = {k: torch.tensor(v, dtype=F64) if k == "is_weights" else torch.tensor(v).bool()
               for k, v in fields.items()}
    inp = PolicyInputs(logp, torch.tensor(LOGP, dtype=F64) if old is None else old, torch.tensor(ADV, dtype=F64),
                       torch.ones(2, 2, dtype=torch.bool), **tensors)
    value, _ = algos.policy_objective(inp, Normalizer.from_totals(mode, 4, 2, 2), ObjectiveOptions(loss, cov=cov))
    return value.item(), torch.autograd.grad(value, logp)[0]


def test_every_loss_and_device_has_a_case():
    pairs = set(itertools.product(algos.POLICY_LOSSES, algos.TOKEN_DEVICES))
    cases = set(BY_HAND) | set(REFUSED) | {(loss, device) for loss, device in PENALTY.items()}
    assert cases == pairs, f"missing: {sorted(pairs - cases)}; unknown: {sorted(cases - pairs)}"
    assert not set(BY_HAND) & set(REFUSED)
    assert set(DEVICE_KEYS) == set(DEVICE_INPUTS) == set(algos.TOKEN_DEVICES)
    for trait in {entry.token_weights for entry in algos.POLICY_LOSSES.values()}:   # every trait, every kind
        assert set(algos.WEIGHT_USES[trait]) == set(algos.TOKEN_DEVICES.values())


@pytest.mark.parametrize("loss, device", sorted(BY_HAND))
def test_the_pair_by_hand(loss, device):
    expected_loss, expected_grad = BY_HAND[loss, device]
    value, grad = objective(loss, device)
    assert value == pytest.approx(expected_loss, abs=1e-12)
    assert torch.allclose(grad, torch.as_tensor(expected_grad, dtype=F64), atol=1e-12, rtol=0)
    assert not algos.token_device_use(loss, device).refused
    make_plan(load_config(None, [f"algo.policy_loss={loss}", *DEVICE_KEYS[device]]))   # the plan takes it


@pytest.mark.parametrize("loss", sorted(PENALTY))
def test_kl_cov_adds_its_penalty_to_every_loss(loss):
    # token (0, 0) one step off policy, d = logp - old = 0.1; KL-Cov chose it: the objective gains
    # 0.1 * |d| = 0.01 and the gradient 0.1 * sign(d) = 0.1 on that token, each times the token's share of the
    # normaliser: 1/4 (token_mean: 4 tokens; seq_mean_token_mean: 1 / (T_1 2 x 2 sequences)), 1/2 for luspo's
    # seq_mean_token_sum (2 sequences). Nothing else moves.
    old = torch.tensor(LOGP, dtype=F64)
    old[0, 0] -= 0.1
    plain, with_penalty = objective(loss, None, old), objective(loss, "kl_cov", old)
    share = 0.5 if loss == "luspo" else 0.25
    assert with_penalty[0] - plain[0] == pytest.approx(0.01 * share, abs=1e-12)
    difference = torch.zeros(2, 2, dtype=F64)
    difference[0, 0] = 0.1 * share
    assert torch.allclose(with_penalty[1] - plain[1], difference, atol=1e-12, rtol=0)
    make_plan(load_config(None, [f"algo.policy_loss={loss}", *DEVICE_KEYS["kl_cov"]]))


@pytest.mark.parametrize("loss, device", sorted(REFUSED))
def test_the_plan_refuses_the_pair_in_one_line(loss, device):
    assert algos.token_device_use(loss, device).refused
    with pytest.raises(ConfigError, match=f"^{REFUSED[loss, device]}") as caught:
        make_plan(load_config(None, [f"algo.policy_loss={loss}", *DEVICE_KEYS[device]]))
    assert "\n" not in str(caught.value)


def test_the_terms_without_a_device():
    # no device: each loss's worked example is sum_t v_t / D with gradient u_t / D (the TERMS above); gmpo's
    # mean of l = (-1, 2) is 0.5, its gradient -A_i / T_i / 2 = -0.25 and 0.5
    for loss, (v, u) in TERMS.items():
        value, grad = objective(loss, None)
        d = AGG.get(loss, (None, 4.0))[1]
        assert value == pytest.approx(sum(map(sum, v)) / d, abs=1e-12)
        assert torch.allclose(grad, torch.tensor(u, dtype=F64) / d, atol=1e-12, rtol=0)
    value, grad = objective("gmpo", None)
    assert value == pytest.approx(0.5) and torch.allclose(grad, torch.tensor([[-0.25, -0.25], [0.5, 0.5]], dtype=F64))
