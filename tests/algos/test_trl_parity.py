"""covey's policy objective equals TRL 1.16's GRPOTrainer loss (and its experimental GMPOTrainer's) on
identical inputs, in float64: the loss and its gradient with respect to the policy's log-probs, KL term
included. TRL's own `_compute_loss` runs on an instance made without __init__, holding the attributes it
reads, with a stand-in for the forward pass that returns the given log-probs.

The sampler-trainer correction (covey's importance_weights: algo.tis.cap, .mode, .min) equals TRL's
vLLM importance sampling (vllm_importance_sampling_mode, clip_max, clip_min): TRL computes it inline in
`_generate_and_score_completions`, so its lines there run on their own, on the same inputs; VESPO with it
(the weights inside the kernel's sequence weight) equals TRL's vespo. A selection of tokens (covey's
PolicyInputs.kept) equals TRL's top_entropy_quantile on the same tokens, GMPO's included.

Where covey departs from TRL on purpose, a test shows the case (cispo's bounds; a selection with a sequence ratio).
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from covey.algos import (
    TIS_MODES,
    Normalizer,
    ObjectiveOptions,
    PolicyInputs,
    PolicyLossOptions,
    importance_weights,
    policy_objective,
)
from covey.config.schema_algo import GmpoOptions, SapoOptions, VespoOptions

trl = pytest.importorskip("trl", reason="the comparison runs TRL's own loss code (pip install trl==1.16.0)")
if trl.__version__ != "1.16.0":
    pytest.skip(f"written against TRL 1.16.0's loss code, found {trl.__version__}", allow_module_level=True)

F64 = torch.float64
N, L, MAX_LEN, BETA = 4, 5, 6, 0.04
ARGS = {"delta": None, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0,
        "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0, "use_bias_correction_kl": False,
        "steps_per_generation": 1}


class OneProcess:
    """The accelerator calls TRL's loss makes, for one process."""
    num_processes = 1
    sync_gradients = True

    def reduce(self, x, reduction="sum"):
        return x

    def gather(self, x):
        return x

    gather_for_metrics = gather


def inputs(seed=0, spread=0.8):
    """Log-probs of 4 sequences of lengths 5, 4, 3, 2 (and a hole), old/ref log-probs off by up to `spread`
    nats (so every clip branch is hit), one advantage per sequence of either sign."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(N, L, generator=g, dtype=F64) * 2 - 0.1
    old = logp + (torch.rand(N, L, generator=g, dtype=F64) * 2 - 1) * spread
    ref = logp + (torch.rand(N, L, generator=g, dtype=F64) * 2 - 1) * spread
    mask = (torch.arange(L)[None, :] < torch.tensor([5, 4, 3, 2])[:, None]).to(F64)
    mask[0, 2] = 0.0
    adv = torch.tensor([1.3, -0.7, 0.4, -1.1], dtype=F64)
    return logp, old, ref, mask, adv


def trl_loss(loss_type, logp, old, ref, mask, adv, level="token", eps=(0.2, 0.28), beta=BETA, gmpo=False,
             is_ratio=None, kept=None, **args):
    """TRL's loss and d loss / d logp; with `is_ratio`, its vLLM importance sampling ratio applied; with `kept`,
    its high-entropy selection (top_entropy_quantile < 1) choosing exactly these tokens."""
    if gmpo:
        from trl.experimental.gmpo import GMPOTrainer as Trainer
    else:
        from trl import GRPOTrainer as Trainer
    t = Trainer.__new__(Trainer)
    leaf = logp.clone().requires_grad_(True)
    t._get_per_token_logps_and_entropies = lambda *a, **k: (leaf, torch.zeros_like(leaf), None)
    t.__dict__.update(
        loss_type=loss_type, importance_sampling_level=level, epsilon_low=eps[0], epsilon_high=eps[1], beta=beta,
        top_entropy_quantile=1.0 if kept is None else 0.5, off_policy_mask_threshold=None,
        use_vllm=is_ratio is not None, vllm_importance_sampling_correction=is_ratio is not None,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1, max_completion_length=MAX_LEN, accelerator=OneProcess(),
        _entropy_bonus_enabled=False, aux_loss_enabled=False, _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(**{**ARGS, **args}))
    if kept is not None:  # the rule that picks the tokens is checked in test_token_select.py; here, what a loss does
        t.get_high_entropy_mask = lambda entropies, completion_mask, threshold: kept.to(completion_mask.dtype)
    batch = {"prompt_ids": torch.zeros(N, 1, dtype=torch.long), "prompt_mask": torch.ones(N, 1, dtype=torch.long),
             "completion_ids": torch.zeros(N, L, dtype=torch.long), "completion_mask": mask,
             "advantages": adv, "old_per_token_logps": old, "ref_per_token_logps": ref,
             "num_items_in_batch": mask.sum()}
    if is_ratio is not None:
        batch["importance_sampling_ratio"] = is_ratio
    loss = t._compute_loss(None, batch)
    return loss.item(), torch.autograd.grad(loss, leaf)[0]


def covey_loss(name, agg, logp, old, ref, mask, adv, beta=BETA, weights=None, kept=None, sample_logp=None, **opts):
    """covey's loss and d loss / d logp; with `weights` (N, L), the sampler correction's importance weights; with
    `kept`, the tokens a selection keeps; with `sample_logp`, the sampler's log-probs."""
    leaf = logp.clone().requires_grad_(True)
    n = Normalizer.from_totals(agg, float(mask.sum()), N, MAX_LEN)
    inp = PolicyInputs(leaf, old, adv[:, None].expand(N, L), mask, ref_logp=ref, kept=kept, is_weights=weights,
                       sample_logp=sample_logp)
    loss, _ = policy_objective(inp, n, ObjectiveOptions(name, PolicyLossOptions(**opts), kl_coef=beta, kl_kind="k3"))
    return loss.item(), torch.autograd.grad(loss, leaf)[0]


def same(a, b):
    assert a[0] == pytest.approx(b[0], abs=1e-6)
    assert torch.allclose(a[1], b[1], atol=1e-6, rtol=0)


CLIP = {"clip_eps_low": 0.2, "clip_eps_high": 0.28}
CASES = {  # TRL loss_type (and its options) -> covey's policy_loss, loss_agg and options
    "grpo": ({}, ("ppo_clip", "seq_mean_token_mean", CLIP)),
    "bnpo": ({}, ("ppo_clip", "token_mean", CLIP)),
    "dr_grpo": ({}, ("ppo_clip", "constant", CLIP)),
    "dapo": ({}, ("ppo_clip", "token_mean", CLIP)),
    "grpo, sequence level (GSPO)": ({"loss_type": "grpo", "level": "sequence"},
                                    ("ppo_clip", "seq_mean_token_mean", {**CLIP, "ratio_level": "sequence"})),
    "grpo, delta = 3 (two-sided clip)": ({"loss_type": "grpo", "delta": 3.0},
                                         ("ppo_clip", "seq_mean_token_mean", {**CLIP, "dual_clip": 3.0})),
    "sapo": ({}, ("sapo", "seq_mean_token_mean", {})),
    "sapo, temperatures 2 / 0.5": ({"loss_type": "sapo", "sapo_temperature_pos": 2.0, "sapo_temperature_neg": 0.5},
                                   ("sapo", "seq_mean_token_mean",
                                    {"sapo": SapoOptions(temperature_pos=2.0, temperature_neg=0.5)})),
    "luspo": ({"level": "sequence"}, ("luspo", "seq_mean_token_sum", CLIP)),
    "vespo": ({}, ("vespo", "token_mean", {})),
    "vespo, k 1.5 / 4, lambda 2.5 / 1": ({"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_lambda_pos": 2.5,
                                          "vespo_k_neg": 4.0, "vespo_lambda_neg": 1.0},
                                         ("vespo", "token_mean", {"vespo": VespoOptions(k_pos=1.5, lambda_pos=2.5,
                                                                                        k_neg=4.0, lambda_neg=1.0)})),
    # cispo: TRL caps the weight at epsilon_high itself (ScaleRL's eps_max, 5.0 recommended) with no floor;
    # covey clips to [1 - clip_eps_low, 1 + clip_eps_high], so eps_max = 1.3 is clip_eps_high = 0.3 with
    # the floor off (clip_eps_low = 1: the weight's floor 0)
    "cispo": ({"eps": (0.2, 1.3)}, ("cispo", "token_mean", {"clip_eps_low": 1.0, "clip_eps_high": 0.3})),
    "gmpo (trl.experimental.gmpo)": ({"loss_type": "gmpo", "gmpo": True, "eps": (0.4, 0.3)},
                                     ("gmpo", "seq_mean_token_mean",
                                      {"gmpo": GmpoOptions(log_clip_low=0.4, log_clip_high=0.3)})),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("seed", [0, 1])
def test_equals_trl(case, seed):
    trl_args, (name, agg, opts) = CASES[case]
    trl_args = {"loss_type": case, **trl_args}
    spread = 1.2 if name == "vespo" else 0.8  # vespo's kernel needs sequence weights far from 1 to bend
    x = inputs(seed, spread)
    same(covey_loss(name, agg, *x, **opts), trl_loss(trl_args.pop("loss_type"), *x, **trl_args))


def test_the_cases_reach_every_branch():
    # between them the two seeds put ratios beyond both clip bounds (PPO's 0.8 / 1.28, GMPO's e^-0.4 / e^0.3)
    # with both signs of advantage: every clipped and unclipped branch runs in the comparison above
    hits = torch.zeros(6, dtype=torch.bool)
    for seed in (0, 1):
        logp, old, ref, mask, adv = inputs(seed)
        r = (logp - old).exp()[mask.bool()]
        a = adv[:, None].expand(N, L)[mask.bool()]
        hits |= torch.stack([((r > 1.28) & (a > 0)).any(), ((r < 0.8) & (a < 0)).any(), ((r > 1.28) & (a < 0)).any(),
                             ((r < 0.8) & (a > 0)).any(), ((r > 1.35) & (a > 0)).any(), ((r < 0.67) & (a < 0)).any()])
    assert hits.all()


# Kept tokens of the rows of `inputs` (lengths 5, 4, 3, 2; row 0's third token a hole): row 2 keeps none, so GMPO's
# mean over its kept tokens is empty there (1, no gradient, in both).
KEPT = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.bool)


SEQUENCE_RATIO = sorted(case for case, (args, _) in CASES.items() if args.get("level") == "sequence")


@pytest.mark.parametrize("case", sorted(set(CASES) - set(SEQUENCE_RATIO)))
def test_a_selection_equals_trl(case):
    """TRL's top_entropy_quantile on the same chosen tokens: each per-token loss times the mask, GMPO's geometric
    mean over the kept tokens; covey's PolicyInputs.kept, read as each loss's token_weights trait says."""
    trl_args, (name, agg, opts) = CASES[case]
    trl_args = {"loss_type": case, **trl_args}
    x = inputs(1, 1.2 if name == "vespo" else 0.8)
    same(covey_loss(name, agg, *x, kept=KEPT, **opts), trl_loss(trl_args.pop("loss_type"), *x, kept=KEPT, **trl_args))


@pytest.mark.parametrize("case", SEQUENCE_RATIO)
def test_a_selection_with_a_sequence_ratio_departs_from_trl(case):
    """covey departs here: with the sequence ratio s_i (GSPO, LUSPO) TRL multiplies the sequence's term by the mask
    on each token, but the term's gradient flows through s_i = exp(mean_t d_t) into every token, so a dropped
    token keeps (kept share) x its gradient. covey's GSPO-token form (each token's term differentiates its own
    log-prob, with the value of s_i) gives a dropped token none, as for every other loss. The loss values are
    equal, and so is each sequence's summed gradient: k_i kept tokens x g_i in covey, T_i tokens x (k_i/T_i) g_i
    in TRL (no KL term here: it is not selected, and would give a dropped token a gradient in both)."""
    trl_args, (name, agg, opts) = CASES[case]
    trl_args = {"loss_type": case, "beta": 0.0, **trl_args}
    x = inputs(1)
    ours = covey_loss(name, agg, *x, beta=0.0, kept=KEPT, **opts)
    theirs = trl_loss(trl_args.pop("loss_type"), *x, kept=KEPT, **trl_args)
    assert ours[0] == pytest.approx(theirs[0], abs=1e-6)
    assert torch.allclose(ours[1].sum(-1), theirs[1].sum(-1), atol=1e-6, rtol=0)
    dropped = x[3].bool() & ~KEPT
    assert bool((ours[1][dropped] == 0).all()) and bool((theirs[1][dropped].abs() > 1e-4).any())


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask"])
@pytest.mark.parametrize("seed", [0, 1])
def test_vespo_sampler_weight_equals_trl(mode, seed):
    """VESPO's kernel on W = (pi_theta / pi_old) prod_t w_t, the bounded token ratios pi_old / mu inside it and no
    weight outside: TRL's vespo with its vLLM importance sampling ratio (token modes) on the same inputs."""
    logp, old, ref, mask, adv = inputs(seed, 1.2)
    sampler = sampler_logp(old, mask, seed)
    theirs = trl_is_ratio(mode, old, sampler, mask, None, TIS_BOUNDS[1])
    ours, _ = importance_weights(old, sampler, mask, TIS_BOUNDS[1], mode)
    same(covey_loss("vespo", "token_mean", logp, old, ref, mask, adv, weights=ours, sample_logp=sampler),
         trl_loss("vespo", logp, old, ref, mask, adv, is_ratio=theirs))


def test_vespo_against_the_sampler_equals_trl_with_the_raw_ratio():
    """Without algo.tis covey's VESPO takes W = pi_theta / mu from the sampler's log-probs: TRL's vespo fed the
    unbounded ratio pi_old / mu gives the same loss and gradient."""
    logp, old, ref, mask, adv = inputs(0, 1.2)
    sampler = sampler_logp(old, mask, 0)
    raw = torch.exp((old - sampler) * mask)
    same(covey_loss("vespo", "token_mean", logp, old, ref, mask, adv, sample_logp=sampler),
         trl_loss("vespo", logp, old, ref, mask, adv, is_ratio=raw))


def test_trl_cispo_default_caps_the_weight_at_0_2():
    """covey departs here: TRL's cispo reads epsilon_high as the cap itself, and with epsilon_high unset it
    falls back to epsilon = 0.2, so on policy (ratio 1) every weight is min(1, 0.2) = 0.2 and the gradient
    is a fifth of the policy gradient. covey's cispo (MiniMax-M1's clip(r, 1 - eps_low, 1 + eps_high)) with
    its defaults gives the weight 1 on policy: pg's gradient."""
    logp, _, ref, mask, adv = inputs(0)
    old = logp.clone()
    trl_default = trl_loss("cispo", logp, old, ref, mask, adv, eps=(0.2, 0.2), beta=0.0)
    covey_pg = covey_loss("pg", "token_mean", logp, old, ref, mask, adv, beta=0.0)
    covey_cispo = covey_loss("cispo", "token_mean", logp, old, ref, mask, adv, beta=0.0)
    assert torch.allclose(trl_default[1], 0.2 * covey_pg[1], atol=1e-12)
    assert torch.allclose(covey_cispo[1], covey_pg[1], atol=1e-12)


# --- the sampler-trainer correction ---------------------------------------------------------------------------
TIS_BOUNDS = (0.6, 1.5)  # (clip_min, clip_max): between them the two seeds' ratios fall below, between and above


def sampler_logp(old, mask, seed):
    """The sampler's log-probs: pi_old's off by up to 0.8 nats per token, garbage where masked."""
    g = torch.Generator().manual_seed(100 + seed)
    return (old + (torch.rand(N, L, generator=g, dtype=F64) * 2 - 1) * 0.8).masked_fill(mask == 0, -30.0)


def trl_is_ratio(mode, old, sampler, mask, clip_min, clip_max):
    """TRL's importance sampling ratio: the lines of `_generate_and_score_completions` from its comment
    "Compute the importance sampling ratio when using vLLM" to the reference model's pass, run on their own
    in its module's namespace; (N, L) in the token modes, (N, 1) in the sequence modes."""
    import inspect
    import textwrap

    from trl.trainer import grpo_trainer
    source = inspect.getsource(grpo_trainer.GRPOTrainer._generate_and_score_completions)
    start = source.rindex("\n", 0, source.index("# Compute the importance sampling ratio when using vLLM")) + 1
    end = source.rindex("\n", 0, source.index("# Compute the per-token log probabilities for the reference")) + 1
    trainer = SimpleNamespace(use_vllm=True, vllm_importance_sampling_correction=True,
                              vllm_importance_sampling_mode=mode, vllm_importance_sampling_clip_min=clip_min,
                              vllm_importance_sampling_clip_max=clip_max)
    scope = {**vars(grpo_trainer), "self": trainer, "completion_mask": mask, "tool_mask": None,
             "old_per_token_logps": old, "sampling_per_token_logps": sampler}
    exec(compile(textwrap.dedent(source[start:end]), "trl GRPOTrainer", "exec"), scope)
    return scope["vllm_importance_sampling_ratio"]


@pytest.mark.parametrize("mode", TIS_MODES)
@pytest.mark.parametrize("clip_min", [None, TIS_BOUNDS[0]])
@pytest.mark.parametrize("seed", [0, 1])
def test_sampler_correction_equals_trl(mode, clip_min, seed):
    """The weights on the valid tokens, then TRL's grpo loss with its ratio against covey's ppo_clip with
    the advantages times covey's weights (KL term included: neither weights it). clip_min None is algo.tis.min 0."""
    logp, old, ref, mask, adv = inputs(seed)
    sampler = sampler_logp(old, mask, seed)
    theirs = trl_is_ratio(mode, old, sampler, mask, clip_min, TIS_BOUNDS[1])
    ours, _ = importance_weights(old, sampler, mask, TIS_BOUNDS[1], mode, floor=clip_min or 0.0)
    assert torch.allclose(ours, theirs.expand(N, L) * mask, atol=1e-6, rtol=0)
    same(covey_loss("ppo_clip", "seq_mean_token_mean", logp, old, ref, mask, adv, weights=ours, **CLIP),
         trl_loss("grpo", logp, old, ref, mask, adv, is_ratio=theirs))


def test_the_sampler_cases_reach_both_bounds():
    # token ratios and sequence products each fall below clip_min, between the bounds and above clip_max
    # in one seed or the other: every branch of truncation and masking runs in the comparison above
    low, high = TIS_BOUNDS
    for level in ("token", "sequence"):
        ratios = []
        for seed in (0, 1):
            _, old, _, mask, _ = inputs(seed)
            log_r = (old - sampler_logp(old, mask, seed)) * mask
            ratios.append(log_r.exp()[mask.bool()] if level == "token" else log_r.sum(-1).exp())
        r = torch.cat(ratios)
        assert bool((r < low).any() and ((r >= low) & (r <= high)).any() and (r > high).any()), level
