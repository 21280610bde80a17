"""Micro-batch ordering (covey.update.by_prompt) groups a mini-batch by prompt without changing the update."""

import copy

import torch

from covey import update
from covey.config import Config
from covey.models import load_policy
from covey.update import UpdateState, by_prompt, update_policy
from tests.test_speed_forward import grouped_rollout


def test_by_prompt_puts_groups_together_stably():
    groups = torch.tensor([2, 0, 1, 0, 2, 1, 0])
    batch = torch.tensor([6, 1, 4, 3, 0])
    assert by_prompt(batch, groups).tolist() == [6, 1, 3, 4, 0]  # groups 0, 0, 0, 2, 2 in batch order


def one_update(model, rollout, cfg, order_fn, monkeypatch):
    """Parameters after one SGD(lr=1) step of update_policy with micro-batches in `order_fn`'s order."""
    model = copy.deepcopy(model)
    with monkeypatch.context() as patch:  # undoes only this patch (not conftest's)
        patch.setattr(update, "by_prompt", order_fn)
        update_policy(model, torch.optim.SGD(model.parameters(), lr=1.0), None, rollout, cfg, 0.0, UpdateState(),
                      torch.Generator().manual_seed(0))
    return dict(model.named_parameters())


def test_grouped_micro_batches_give_the_same_step_as_interleaved_ones(tiny_model_dir, monkeypatch):
    model, tokenizer = load_policy(tiny_model_dir)
    rollout = grouped_rollout(tokenizer, groups=3, group_size=2)
    shape = rollout.response_ids.shape
    rollout.advantages = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    cfg = Config()
    cfg.algo.micro_batch_size, cfg.optim.max_grad_norm, cfg.rollout.max_new_tokens = 2, 0.0, 7
    grouped = one_update(model, rollout, cfg, by_prompt, monkeypatch)
    interleaved = one_update(model, rollout, cfg, lambda batch, groups: batch[torch.tensor([0, 2, 4, 1, 3, 5])],
                             monkeypatch)
    for name, param in grouped.items():
        torch.testing.assert_close(param, interleaved[name], atol=1e-6, rtol=1e-5, msg=name)
    assert any(not torch.equal(p, q) for p, q in zip(grouped.values(), model.parameters()))  # it did move
