"""The routers' load-balancing loss (covey.algos.router) on numbers worked by hand."""

import math

import pytest
import torch

from covey.algos.router import load_balancing_loss, step_share


def logits_of(*probs):
    """Router logits whose softmax is `probs` (log p; softmax of log p is p when sum p = 1)."""
    return torch.tensor(probs, dtype=torch.float64).log()


def test_even_routing_gives_k():
    # E = 2, k = 1. Token 1: p = (1/4, 3/4) -> expert 1; token 2: p = (3/4, 1/4) -> expert 0.
    # f = (1/2, 1/2), P = (1/2, 1/2): aux = 2 * (1/4 + 1/4) = 1 = k.
    aux = load_balancing_loss([logits_of([0.25, 0.75], [0.75, 0.25])], top_k=1)
    assert aux.item() == pytest.approx(1.0)


def test_unbalanced_routing():
    # Both tokens p = (3/4, 1/4) -> expert 0: f = (1, 0), P = (3/4, 1/4); aux = 2 * (1 * 3/4) = 1.5.
    aux = load_balancing_loss([logits_of([0.75, 0.25], [0.75, 0.25])], top_k=1)
    assert aux.item() == pytest.approx(1.5)


def test_top_two_over_two_layers_pooled():
    # E = 3, k = 2. Layer 1: p = (.5, .3, .2) -> experts {0, 1}; layer 2: p = (.2, .3, .5) -> {1, 2}.
    # Rows pooled (R = 2): f = ((1,1,0) + (0,1,1)) / 2 = (.5, 1, .5), P = (.35, .3, .35);
    # aux = 3 * (.5 * .35 + 1 * .3 + .5 * .35) = 3 * .65 = 1.95.
    aux = load_balancing_loss([logits_of([0.5, 0.3, 0.2]), logits_of([0.2, 0.3, 0.5])], top_k=2)
    assert aux.item() == pytest.approx(1.95)
    # One layer alone: f = (1, 1, 0), P = (.5, .3, .2): 3 * (.5 + .3) = 2.4.
    assert load_balancing_loss([logits_of([0.5, 0.3, 0.2])], top_k=2).item() == pytest.approx(2.4)


def test_gradient_reaches_the_router_through_p_only():
    # One token, E = 2, k = 1, p = (3/4, 1/4): f = (1, 0) is a count (no gradient), aux = 2 p_0.
    # d aux / d z_j = 2 p_0 (delta_0j - p_j): (2 * 3/4 * 1/4, -2 * 3/4 * 1/4) = (0.375, -0.375).
    z = logits_of([0.75, 0.25]).requires_grad_()
    load_balancing_loss([z], top_k=1).backward()
    torch.testing.assert_close(z.grad, torch.tensor([[0.375, -0.375]], dtype=torch.float64))


def test_no_rows_is_zero():
    assert load_balancing_loss([torch.zeros(0, 4)], top_k=2).item() == 0.0


def test_step_share_makes_the_step_term_a_token_weighted_mean():
    # Micro-batches of 3 and 1 routed tokens with aux 2.0 and 4.0: the step term is
    # 3/4 * 2 + 1/4 * 4 = 2.5, the same as one batch whose micro-batches route alike would give
    # for equal values (2 micro-batches of aux 2 -> 2, not 4: more micro-batches add no loss).
    assert 2.0 * step_share(3, 4) + 4.0 * step_share(1, 4) == pytest.approx(2.5)
    assert 2.0 * step_share(2, 4) + 2.0 * step_share(2, 4) == pytest.approx(2.0)
    # Two processes of 2 tokens each (4 in the step): each process's term is 2 * 2/4 = 1 times its aux;
    # FSDP averages the two gradients, which gives back the step's mean.
    assert step_share(2, 4, num_processes=2) == 1.0
    assert step_share(3, 0) == 0.0
    assert math.isclose(sum(step_share(t, 10) for t in (1, 2, 3, 4)), 1.0)
