"""The PPO critic's update (covey.training.update.update_critic) fits fixed returns."""

import pytest
import torch

from covey.config import Config
from covey.models.critic import ValueModel
from covey.models.load import load_policy
from covey.passes.logprobs import batched_values
from covey.training.plan import make_plan
from covey.training.update import UpdateState, update_critic
from tests.helpers import grouped_rollout


@pytest.mark.parametrize("micro_batch_size", [1, 4])  # the reported loss must not depend on it
def test_critic_loss_decreases_when_fitting_fixed_returns(tiny_model_dir, micro_batch_size):
    torch.manual_seed(0)
    _, tokenizer = load_policy(tiny_model_dir)
    critic = ValueModel.from_policy_path(tiny_model_dir).train()
    rollout = grouped_rollout(tokenizer, groups=2, group_size=2)
    # A sequence reward of +1 (prompt 0) or -1 (prompt 1) with gamma = lambda = 1 and no KL:
    # the return is that reward at every valid token. The two prompts differ, so a critic can fit both.
    reward = torch.tensor([1.0, 1.0, -1.0, -1.0])
    rollout.returns = reward[:, None] * rollout.response_mask
    cfg = Config()
    cfg.algo.micro_batch_size, cfg.rollout.max_new_tokens = micro_batch_size, rollout.response_ids.shape[1]
    optimizer = torch.optim.Adam(critic.parameters(), lr=1e-3)
    history = []
    for _ in range(40):
        # As in training: V_old is read once per rollout, before the update clips against it.
        rollout.values = batched_values(critic, rollout, cfg.algo.micro_batch_size)
        history.append(update_critic(critic, optimizer, rollout, make_plan(cfg).update, UpdateState(),
                                     torch.Generator().manual_seed(0)))
    # Step 1 by hand: the head starts at zero, so V = V_old = 0 and every token's loss is
    # 0.5 * max((0 - (+-1))^2, (clip(0, -0.2, 0.2) - (+-1))^2) = 0.5; any mean of 0.5 is 0.5.
    # Explained variance 1 - Var(R - 0) / Var(R) = 0; nothing clipped (the two terms are equal).
    assert history[0]["critic/loss"] == pytest.approx(0.5, abs=1e-7)
    assert history[0]["critic/explained_var"] == pytest.approx(0.0, abs=1e-7)
    assert history[0]["critic/clipfrac"] == 0.0
    losses = [h["critic/loss"] for h in history]
    assert losses[-1] < 0.05 * losses[0], losses
    assert history[-1]["critic/explained_var"] > 0.9
    values = batched_values(critic, rollout, 4)
    mask = rollout.response_mask.bool()
    assert torch.all((values - rollout.returns).abs()[mask] < 0.3)
