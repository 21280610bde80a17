"""The auxiliary load-balancing loss of a mixture-of-experts router, and its share of an optimizer step.

Switch Transformer's loss (Fedus et al. 2021, arXiv:2101.03961, eqs. 4-6) for top-k routing over E
experts, as transformers' `load_balancing_loss_func` computes it (every layer's rows pooled):

    aux = E * sum_e f_e * P_e
    f_e = (1/R) sum_r 1[e in top-k(p_r)]      share of the rows' top-k picks that go to expert e (sum_e f_e = k)
    P_e = (1/R) sum_r p_{r,e}                 mean router probability of e, p_r = softmax(router logits of row r)

over the R rows (a token at a layer). f is a count (no gradient); the gradient reaches the router
through P. Even routing gives aux = k (f_e = k/E, P_e = 1/E); routing collapsed onto k experts gives up
to E (f_e = 1 and P_e -> 1/k on those k).

aux is a mean over a forward's tokens, so it is computed per micro-batch and weighted by the
micro-batch's share of the step's routed tokens (`step_share`): the step's term is then the
token-weighted mean of its micro-batches' losses, whatever the micro-batch size (see `step_share`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def load_balancing_loss(router_logits: Sequence[Tensor], top_k: int) -> Tensor:
    """aux = E * sum_e f_e P_e over the rows of every (rows, E) tensor in `router_logits` (one per layer,
    pooled); 0 without rows. Computed in float32 at least (bf16 logits are cast)."""
    rows = torch.cat([logits.reshape(-1, logits.shape[-1]) for logits in router_logits])
    rows = rows.to(torch.promote_types(rows.dtype, torch.float32))
    if rows.shape[0] == 0:
        return rows.sum()
    experts = rows.shape[-1]
    probs = torch.softmax(rows, dim=-1)
    picked = probs.topk(top_k, dim=-1).indices.reshape(-1)
    counts = torch.zeros(experts, dtype=rows.dtype, device=rows.device).index_add_(0, picked,
                                                                            torch.ones_like(picked, dtype=rows.dtype))
    f, p = counts / rows.shape[0], probs.mean(dim=0)
    return experts * (f * p).sum()


def step_share(tokens: int, step_tokens: int, num_processes: int = 1) -> float:
    """The weight of a micro-batch's aux loss in the step's objective: num_processes * tokens / step_tokens.

    `tokens`: the routed tokens of the micro-batch, `step_tokens`: of the optimizer step on every process.
    Summed over the step's micro-batches (sum_m T_m / T = 1) the aux terms are their token-weighted mean,
    so splitting the step into more micro-batches does not add more aux loss, and a micro-batch with few
    tokens weighs little (what the global Normalizer does for the RL loss). The factor num_processes undoes
    FSDP's average over processes, as in `Normalizer`. The micro-batch's f still counts its own tokens only:
    with micro-batches that route alike the term is exactly that of one batch; otherwise it balances
    each micro-batch (as transformers and Megatron-LM do per forward) rather than the whole step (the
    global-batch form of Qiu et al. 2025, arXiv:2501.11873, needs every micro-batch's counts before the
    first backward).
    """
    return num_processes * tokens / step_tokens if step_tokens > 0 else 0.0
