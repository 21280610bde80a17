"""`torchrun --nproc_per_node 2` (gloo, CPU) ends where one process ends on the same global batch.

"The same global batch" (covey/training/global_batch.py, docs/scale.md): both runs draw the same B
prompts per step; rollout.seeding=per_prompt samples each group from its own seed, so the
two ranks generate exactly the groups the single process generates; advantages are computed
on the gathered batch; the loss normaliser is global. algo.minibatches=1 keeps every
optimizer step on the whole batch (with more, each rank would shuffle its own share).

Both runs are the real CLI on the tiny random model. The tolerance (1e-5) is far below
how far the weights move (> 1e-3 with optim.lr=1e-3), so a wrong normaliser, a lost
gradient or a rank-local advantage would fail the comparison.
"""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from covey.cli.main import main
from tests.helpers import tiny_overrides

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")

TORCHRUN = shutil.which("torchrun", path=os.path.dirname(sys.executable))


def digit_share(prompts, completions, **kwargs):
    """A reward the random tiny model earns unevenly (share of digit characters), so advantages are non-zero."""
    return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def overrides(model_dir, out_dir, run_name, preset_keys):
    return tiny_overrides(
        model_dir, out_dir, **{"train.run_name": run_name, "rollout.seeding": "per_prompt", "optim.lr": 1e-3,
                               "reward.functions": "tests.training.test_torchrun:digit_share:1.0",
                               "reward.correctness": 0.0, "algo.minibatches": 1, "train.eval_every": 0,
                               # fp32: bf16 rounds differently at 1 and 2 processes (and the
                               # subprocesses would resolve `auto` from the CPU's own flags)
                               "rollout.precision": "float32", "model.autocast": "none", **preset_keys})


def run_torchrun(args: list[str]) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([TORCHRUN, "--standalone", "--nproc_per_node", "2", "-m", "covey.cli", "train", *args],
                          capture_output=True, text=True, timeout=300, env=env, cwd=os.getcwd())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def step_rows(run_dir):
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "policy/loss" in r]


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found next to the Python executable")
@pytest.mark.parametrize("preset", [
    {},  # GRPO: group advantages, KL to an FSDP-sharded reference in the loss; 2 steps under torchrun
    # PPO: sharded critic, KL in the reward, batch-whitened GAE, 2 epochs. Step 1 runs in one process,
    # step 2 under torchrun resuming its checkpoint (full states loaded into the shards).
    {"config": "ppo", "resume": True},
], ids=["grpo", "ppo-resumed"])
def test_two_processes_match_one(preset, tiny_model_dir, tmp_path):
    config = [preset["config"]] if "config" in preset else []
    assert main(["train", *config, *overrides(tiny_model_dir, tmp_path, "single", {})]) == 0  # this process
    if preset.get("resume"):
        assert main(["train", *config, *overrides(tiny_model_dir, tmp_path, "dist", {"train.steps": 1})]) == 0
        run_torchrun(config + overrides(tiny_model_dir, tmp_path, "dist", {"train.resume": "auto"}))
    else:
        run_torchrun(config + overrides(tiny_model_dir, tmp_path, "dist", {}))

    single, dist = step_rows(tmp_path / "single"), step_rows(tmp_path / "dist")
    assert [r["step"] for r in dist] == [1, 2]
    for a, b in zip(single, dist):
        assert b["policy/loss"] == pytest.approx(a["policy/loss"], abs=1e-5)
        assert b["reward/mean"] == pytest.approx(a["reward/mean"], abs=1e-6)  # the same samples
    assert any(abs(r["policy/loss"]) > 1e-6 for r in single)  # there was something to learn

    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    one = load_file(str(tmp_path / "single" / "final" / "model.safetensors"))
    two = load_file(str(tmp_path / "dist" / "final" / "model.safetensors"))
    assert one.keys() == two.keys()
    assert max(float((one[k] - start[k]).abs().max()) for k in one) > 1e-3  # the weights did move
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-5
    if "config" in preset:  # the critic, sharded too, ends equal as well
        c1 = torch.load(tmp_path / "single" / "final" / "critic.pt")
        c2 = torch.load(tmp_path / "dist" / "final" / "critic.pt")
        assert max(float((c1[k] - c2[k]).abs().max()) for k in c1) < 1e-5
