"""Token devices with a loss that averages the advantage over each sequence (gmpo) are refused by the plan in
one line naming both keys: folded into the advantage, a dropped token's weight would be spread over its
sequence. A worked case: advantage A on 2 tokens, the second dropped (weight 0). Folded per token the
weights give (A*1, A*0); gmpo's sequence mean is A/2 on both tokens, so the dropped token keeps A/2 of a
gradient and the kept one loses half of its own. Per-sequence weights (the sequence TIS modes) are exact:
mean(A*w) = w*mean(A)."""

import pytest

from covey.config import ConfigError, load_config
from covey.train.plan import make_plan

GMPO = ["algo.policy_loss=gmpo", "algo.beta=0"]


@pytest.mark.parametrize("keys, message", [
    (["algo.top_entropy_quantile=0.2"], "algo.top_entropy_quantile=0.2: algo.policy_loss=gmpo averages"),
    (["algo.tis.cap=2", "algo.tis.mode=token_truncate"], "algo.tis.mode=token_truncate weights each token: "
                                                          "algo.policy_loss=gmpo averages"),
    (["algo.cov_control=clip_cov"], "algo.cov_control=clip_cov drops the gradient of chosen tokens: "
                                    "algo.policy_loss=gmpo averages"),
])
def test_token_devices_with_a_sequence_averaged_loss_are_refused(keys, message):
    with pytest.raises(ConfigError, match=message):
        make_plan(load_config(None, [*GMPO, *keys]))


def test_sequence_weights_with_a_sequence_averaged_loss_are_planned():
    plan = make_plan(load_config(None, [*GMPO, "algo.tis.cap=2", "algo.tis.mode=sequence_truncate"]))
    assert plan.update.policy_loss == "gmpo"


@pytest.mark.parametrize("loss", ["ppo_clip", "cispo", "sapo"])
def test_token_devices_with_per_token_losses_are_planned(loss):
    make_plan(load_config(None, [f"algo.policy_loss={loss}", "algo.top_entropy_quantile=0.2", "algo.tis.cap=2"]))
