"""Tool episodes under `torchrun --nproc_per_node 2` (gloo, CPU) end where one process ends on the same global batch.

As in tests/training/test_torchrun.py (rollout.seeding=per_prompt, algo.minibatches=1, fp32), with whole
episodes: word problems with the calculator, two turns of up to 96 tokens. The random tiny model never
writes a tool call, so tests/training/scripted_calls.py (imported by the run through rollout.tools) makes the
first turn of about half the episodes a calculator call, chosen by the prompt and the model's own first
token, never by the rank; the reply is appended and the model samples a second turn. Both runs are
processes of their own (the patch is global). Episodes differ in length between the ranks, the held-out
episodes are split across them, and the episode metrics are pooled: the end weights agree at 1e-5, and
the episode and tool metrics of every step and of both evaluations are those of one process.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from covey.config import load_config, validate_world
from covey.rollout.agents import EpisodeEngine
from tests.helpers import tiny_overrides
from tests.training.test_torchrun import TORCHRUN, run_torchrun

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed unavailable")


def pooled_engine(batches: list[dict], calls: int, errors: int) -> EpisodeEngine:
    """An EpisodeEngine holding the metrics of batches it sampled (what `generate` records) and tool counts."""
    engine = EpisodeEngine(None, None, None,
                           tool_metrics=lambda: {"tools/calls": calls, "tools/errors": errors})
    engine.pending = [{"episode/turns_mean": b["turns"] / b["episodes"],
                       "episode/tool_calls_mean": b["calls"] / b["episodes"],
                       "episode/env_token_frac": b["env"] / b["tokens"],
                       "episode/cut_off_frac": b["cut"] / b["episodes"],
                       "episodes": b["episodes"], "tokens": b["tokens"]} for b in batches]
    return engine


def test_episode_metrics_pool_over_batches_and_ranks():
    # Rank A sampled two batches: 2 episodes, 10 tokens (2 of them the tools'), 3 turns, 1 call, 1 cut off;
    # 2 episodes, 30 tokens, none the tools', 2 turns, no call. Rank B one: 4 episodes, 60 tokens (12 the
    # tools'), 8 turns, 4 calls, none cut off.
    a = [{"episodes": 2, "tokens": 10, "env": 2, "turns": 3, "calls": 1, "cut": 1},
         {"episodes": 2, "tokens": 30, "env": 0, "turns": 2, "calls": 0, "cut": 0}]
    b = [{"episodes": 4, "tokens": 60, "env": 12, "turns": 8, "calls": 4, "cut": 0}]
    alone = pooled_engine(a, calls=1, errors=0).take_metrics()
    # A alone: turns (3 + 2) / 4 = 1.25, calls 1 / 4, cut off 1 / 4; the tools' share over the tokens,
    # 2 / 40 = 0.05 (not the mean of the batches' shares, (0.2 + 0) / 2 = 0.1)
    assert alone == pytest.approx({"episode/turns_mean": 1.25, "episode/tool_calls_mean": 0.25,
                                   "episode/env_token_frac": 0.05, "episode/cut_off_frac": 0.25,
                                   "tools/calls": 1, "tools/errors": 0})
    sent = {}
    pooled_engine(b, calls=4, errors=1).take_metrics(total=lambda v: sent.setdefault("b", v))
    both = pooled_engine(a, calls=1, errors=0).take_metrics(total=lambda v: v + sent["b"])  # an all-reduce
    # A and B: turns (5 + 8) / 8 = 1.625, calls (1 + 4) / 8 = 0.625, tools' tokens (2 + 12) / 100 = 0.14,
    # cut off 1 / 8 = 0.125; tool calls 1 + 4 = 5, errors 0 + 1 = 1
    assert both == pytest.approx({"episode/turns_mean": 1.625, "episode/tool_calls_mean": 0.625,
                                  "episode/env_token_frac": 0.14, "episode/cut_off_frac": 0.125,
                                  "tools/calls": 5, "tools/errors": 1})
    assert pooled_engine([], calls=0, errors=0).take_metrics() == {"tools/calls": 0, "tools/errors": 0}


def test_tools_and_environments_pass_the_world_check():
    for key in ("rollout.tools=calculator", "rollout.environment=examples.number_guess.guess_env:GuessEnv"):
        validate_world(load_config(None, [key, "rollout.prompts_per_step=4"]), 2)


def overrides(model_dir, out_dir, run_name):
    return tiny_overrides(
        model_dir, out_dir, **{"train.run_name": run_name, "task.name": "wordproblems",
                               "rollout.tools": "tests.training.scripted_calls:calculator", "rollout.max_turns": 2,
                               "rollout.max_new_tokens": 96, "rollout.eval_max_new_tokens": 96,
                               "rollout.seeding": "per_prompt", "optim.lr": 1e-3, "reward.correctness": 0.0,
                               "reward.functions": "tests.training.scripted_calls:digit_share:1.0",
                               "algo.minibatches": 1, "train.eval_every": 0,
                               "rollout.precision": "float32", "model.autocast": "none"})


def episode_rows(run_dir) -> list[dict]:
    """Per logged row (evaluation before, steps 1 and 2, evaluation after): its episode and tool metrics."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k.startswith(("episode/", "tools/", "eval/episode/", "eval/tools/"))}
            for r in rows]


@pytest.mark.skipif(TORCHRUN is None, reason="torchrun not found next to the Python executable")
def test_tool_episodes_on_two_processes_match_one(tiny_model_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-m", "covey.cli", "train", *overrides(tiny_model_dir, tmp_path, "one")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=os.getcwd())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    run_torchrun(overrides(tiny_model_dir, tmp_path, "two"))

    one, two = episode_rows(tmp_path / "one"), episode_rows(tmp_path / "two")
    assert len(one) == len(two) == 4
    for a, b in zip(one, two):
        assert a.keys() == b.keys() and a == pytest.approx(b, abs=1e-9)
    steps = one[1:3]
    assert all(r["tools/calls"] > 0 and r["tools/errors"] == 0 for r in steps)  # tool episodes in every step
    assert all(0 < r["episode/tool_calls_mean"] < 1 for r in steps)  # and episodes without a call beside them
    assert one[0]["eval/tools/calls"] > 0  # held-out episodes call it too

    start = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    single = load_file(str(tmp_path / "one" / "final" / "model.safetensors"))
    dist = load_file(str(tmp_path / "two" / "final" / "model.safetensors"))
    assert max(float((single[k] - start[k]).abs().max()) for k in single) > 1e-3  # the weights did move
    assert max(float((single[k] - dist[k]).abs().max()) for k in single) < 1e-5
