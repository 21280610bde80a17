"""Variance of the policy-gradient estimate on one fixed rollout (optional: train.grad_var_every).

A common claim is that GRPO's group-relative advantages (Shao et al. 2024, arXiv:2402.03300)
give a lower-variance update than PPO's GAE. The advantages themselves cannot show it: every preset
normalises them to unit scale. What matters is the noise of the gradient the optimizer receives, so this measures it:

1. take the step's rollout after its advantages are computed and before the update
   (theta = theta_old, so every importance ratio is 1 and the surrogate's gradient is the
   policy gradient sum_t A_t grad log pi(y_t));
2. split it at random into M = train.grad_var_batches disjoint mini-batches of n = N // M
   sequences (a generator of its own: the training RNG streams are not touched);
3. for each, back-propagate the algorithm's own policy loss (its aggregation, clipping and
   KL-in-loss term; no gradient clipping, no critic) and read g_m over all trainable
   parameters; the optimizer is not stepped and the gradients are cleared afterwards.

Reported (sums over all parameters):
    policy/grad_var        1/(M-1) sum_m ||g_m - g_bar||^2, the trace of the covariance of a
                           size-n mini-batch gradient (unbiased over the M draws)
    policy/grad_mean_sq    ||g_bar||^2, squared norm of the mean of the M gradients
    policy/grad_noise_frac grad_var / mean_m ||g_m||^2, estimates tr(Cov) / E||g||^2 (0..1, at most M/(M-1)):
                           the share of a mini-batch gradient that is noise. Scale-free, so
                           algorithms whose losses have different scales compare fairly.
Cost: two extra forward and backward passes over the rollout and no extra memory: the first
pass takes each g_m alone (its norm, then the gradient is cleared), the second accumulates
sum_m g_m in the gradient buffers themselves. Keeping a copy of g_bar instead would save a pass
but add a parameter-sized buffer to the peak memory the comparison reports.
"""

from __future__ import annotations

import time

import torch

from covey import algos
from covey.batch import Rollout
from covey.training.plan import UpdateOptions
from covey.training.update import micro_policy_loss


def add_minibatch_gradient(policy, rollout: Rollout, batch: torch.Tensor, opts: UpdateOptions,
                           kl_coef: float) -> None:
    """Back-propagate the policy loss of the mini-batch `batch` (rows of the rollout) into .grad."""
    norm = algos.make_normalizer(opts.loss_agg, rollout.response_mask[batch], max_len=opts.max_len)
    for micro in batch.split(opts.micro_batch_size):
        loss, _ = micro_policy_loss(policy, rollout.select(micro), norm, opts, kl_coef)
        loss.backward()


def grad_squared_norm(params) -> float:
    return sum(float(torch.linalg.vector_norm(p.grad).double() ** 2) for p in params if p.grad is not None)


def clear_grads(params) -> None:
    for p in params:
        p.grad = None


def measure_grad_variance(policy, rollout: Rollout, opts: UpdateOptions, kl_coef: float, seed: int,
                          num_batches: int) -> dict:
    """The metrics described in the module docstring (M = `num_batches`); the policy's parameters are left untouched."""
    t0 = time.perf_counter()
    params = [p for p in policy.parameters() if p.requires_grad]
    if any(p.grad is not None for p in params):
        raise RuntimeError("measure_grad_variance needs cleared gradients (call it before the update)")
    m = num_batches
    size = len(rollout) // m
    order = torch.randperm(len(rollout), generator=torch.Generator().manual_seed(seed))
    batches = [order[k * size:(k + 1) * size] for k in range(m)]
    sq_norms = []
    for batch in batches:  # pass 1: |g_m|^2, one mini-batch at a time
        add_minibatch_gradient(policy, rollout, batch, opts, kl_coef)
        sq_norms.append(grad_squared_norm(params))
        clear_grads(params)
    for batch in batches:  # pass 2: sum_m g_m, accumulated in .grad
        add_minibatch_gradient(policy, rollout, batch, opts, kl_coef)
    mean_sq = grad_squared_norm(params) / m ** 2
    clear_grads(params)
    var = max(sum(sq_norms) - m * mean_sq, 0.0) / (m - 1)
    mean_of_sq = sum(sq_norms) / m
    return {"policy/grad_var": var, "policy/grad_mean_sq": mean_sq,
            "policy/grad_noise_frac": var / mean_of_sq if mean_of_sq > 0 else float("nan"),
            "time/grad_var": time.perf_counter() - t0}
