"""Steps that cannot teach the policy anything, said out loud.

A step learns nothing when no trained token carries a non-zero advantage: every token left the loss
(DAPO's overlong filtering with every reply cut at the budget), every group's rewards tied (all 0 when
no reply is right, or when every reward function failed or scored nothing), or, in a tool run, no
episode called a tool so a reward that needs one cannot differ. The run then goes on with a gradient
of the KL term alone, and a user watching a progress bar sees `reward=0.00`. `SignalWatch` reads each
step's metrics, prints one line at the first step without signal (through tqdm, so it shows under the
progress bar) naming the likely cause and the key to change, and counts such steps for the run's
summary line.
"""

from __future__ import annotations

from covey.batch import Rollout


def signal_metrics(rollout: Rollout) -> dict:
    """`signal/trained_tokens` (tokens left in the loss), `signal/advantage_abs_max` (the largest |A| among
    them) and `signal/samples` of a rollout whose advantages are set and whose response_mask is what the
    loss trains."""
    mask = rollout.response_mask.bool()
    advantages = rollout.advantages
    largest = float(advantages[mask].abs().max()) if advantages is not None and bool(mask.any()) else 0.0
    return {"signal/trained_tokens": int(mask.sum()), "signal/advantage_abs_max": largest,
            "signal/samples": len(rollout)}


def no_signal_cause(metrics: dict, keys: dict) -> str | None:
    """Why the step of `metrics` had no learning signal (None when it had one). `keys`: the settings a cause
    names (max_new_tokens, mask_truncated, episodes)."""
    if "signal/trained_tokens" not in metrics:
        return None
    if metrics["signal/trained_tokens"] == 0:
        if keys.get("mask_truncated") and metrics.get("response/truncated_frac", 0) >= 1:
            return (f"every reply hit rollout.max_new_tokens={keys['max_new_tokens']} and algo.mask_truncated "
                    "took all of them out of the loss: raise rollout.max_new_tokens or set algo.mask_truncated=false")
        return "no token was left in the loss"
    if metrics["signal/advantage_abs_max"] > 0:
        return None
    if metrics.get("reward/errors", 0):
        return (f"every group's rewards are equal and {metrics['reward/errors']} reward calls failed "
                "(reward_errors.log in the run folder): fix the reward function")
    if metrics.get("reward/unscored", 0) >= metrics.get("signal/samples", 1):
        return "every reward function returned None for every sample: nothing scored them"
    if keys.get("episodes") and metrics.get("tools/calls", 1) == 0:
        return ("no episode called a tool, and every group's rewards are equal: show the model a worked call "
                "(rollout.tool_demo) or reward calling one (reward.tool_use)")
    mean = metrics.get("reward/mean")
    tie = f" (all {mean:.3g})" if isinstance(mean, float) and metrics.get("reward/std", 1) == 0 else ""
    return (f"every group's rewards are equal{tie}: no advantage; an easier task, more samples per prompt "
            "(rollout.group_size) or a denser reward (reward.functions, reward.format) gives one")


class SignalWatch:
    """Counts the steps without learning signal and says the first one's cause once."""

    def __init__(self, keys: dict):
        self.keys, self.steps, self.said = keys, 0, False

    @classmethod
    def of(cls, plan) -> "SignalWatch":
        """The settings a cause names, from the run's Plan."""
        return cls({"max_new_tokens": plan.sampling.max_new_tokens, "mask_truncated": plan.update.mask_truncated,
                    "episodes": plan.episodes is not None})

    def observe(self, step: int, metrics: dict) -> str | None:
        """The line to print at this step (the first step without signal), else None."""
        cause = no_signal_cause(metrics, self.keys)
        if cause is None:
            return None
        self.steps += 1
        if self.said:
            return None
        self.said = True
        return f"covey: step {step} has no learning signal: {cause}"

    def before_training(self, before: dict) -> str | None:
        """A warning when DAPO's overlong filtering would take most replies out of the loss: the untrained
        policy's held-out answers mostly hit their budget."""
        cut = before.get("eval/truncated_frac", 0.0)
        if not self.keys.get("mask_truncated") or cut <= 0.5:
            return None
        return (f"covey: warning: {cut:.0%} of the untrained policy's held-out answers hit their token budget, and "
                f"algo.mask_truncated takes every truncated reply out of the loss: with rollout.max_new_tokens="
                f"{self.keys['max_new_tokens']} most steps may train on few tokens or none; raise it, or set "
                "algo.mask_truncated=false")

    def summary(self, steps: int) -> str:
        """'' when every step had signal, else the count for the run's last line."""
        return f"; {self.steps} of {steps} steps without learning signal" if self.steps else ""
