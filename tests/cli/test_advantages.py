"""`covey advantages`: table, --json, sub-command wiring, one-line errors with exit code 2, and a
reader that closes the output early."""

import argparse
import json
import subprocess
import sys

import pytest

from covey.cli import advantages
from covey.cli.main import main


def covey_advantages(argv):
    return main(["advantages", *argv])


# GRPO, discounted token credit, global-token normalisation
DISCOUNTED_GLOBAL = ["--rewards", "0.8,0.6", "--lengths", "3,4", "--token-credit", "discounted", "--gamma",
                     "0.99", "--normalize", "global_token", "--eps", "0"]


def run_json(capsys, *argv):
    assert covey_advantages([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_discounted_global_token_example_json(capsys):
    # values derived by hand in tests/algos/test_advantages.py::test_global_token_worked_example
    out = run_json(capsys, *DISCOUNTED_GLOBAL)
    seqs = out["sequences"]
    assert [s["length"] for s in seqs] == [3, 4] and [s["reward"] for s in seqs] == [0.8, 0.6]
    assert seqs[0]["advantages"] == pytest.approx([1.1430621, 1.1546082, 1.1662709], abs=1e-6)
    assert seqs[1]["advantages"] == pytest.approx([-0.8529742, -0.8615901, -0.8702930, -0.8790839], abs=1e-6)
    assert out["options"]["token_credit"] == "discounted" and out["options"]["gamma"] == 0.99
    assert out["metrics"]["advantages/std"] == pytest.approx(1.0)


def test_table_output(capsys):
    assert covey_advantages(DISCOUNTED_GLOBAL) == 0
    text = capsys.readouterr().out
    assert "t=4" in text and "1.1431" in text and "-0.8791" in text
    row = next(line for line in text.splitlines() if line.strip().startswith("1 ") and "1.1431" in line)
    assert row.split()[3:] == ["1.1431", "1.1546", "1.1663"]   # seq, group, reward, then one cell per token


def test_groups_no_std_and_ddof(capsys):
    # groups [0, 0, 1, 1] rewards [1, 0, 3, 5]: Dr. GRPO -> [0.5, -0.5, -1, 1]
    out = run_json(capsys, "--rewards", "1,0,3,5", "--lengths", "1,2,1,1", "--groups", "0,0,1,1", "--no-std")
    assert [s["advantages"] for s in out["sequences"]] == [[0.5], [-0.5, -0.5], [-1.0], [1.0]]
    # ddof 1: group 1 std = sqrt(2), (5 - 4)/sqrt(2) = 0.70711
    out = run_json(capsys, "--rewards", "1,0,3,5", "--lengths", "1,2,1,1", "--groups", "0,0,1,1", "--ddof", "1",
                   "--eps", "0")
    assert out["sequences"][3]["advantages"] == pytest.approx([2 ** -0.5])


def test_gae_values_and_process_steps(capsys):
    # GAE by hand in tests/algos/test_returns.py::test_gae_by_hand
    out = run_json(capsys, "--estimator", "gae", "--rewards", "1", "--lengths", "3", "--values", "0.1,0.2,0.3",
                   "--gamma", "0.9", "--lam", "0.5")
    assert out["sequences"][0]["advantages"] == pytest.approx([0.25325, 0.385, 0.7])
    # steps {1 @ t2, 0 @ t4} and {0.5 @ t3}: mean 0.5, std 0.408248 -> normalised 1.2247, -1.2247, 0
    out = run_json(capsys, "--estimator", "grpo_process", "--rewards", "0,0", "--lengths", "4,3",
                   "--step-rewards", "1,0;0.5", "--step-ends", "2,4;3", "--eps", "0")
    assert out["sequences"][0]["advantages"] == pytest.approx([0, 0, -1.2247449, -1.2247449], abs=1e-6)
    assert out["sequences"][1]["advantages"] == pytest.approx([0, 0, 0])
    out = run_json(capsys, "--estimator", "remax", "--rewards", "1,0.2", "--lengths", "1,1", "--baselines", "0.5,0.5")
    assert [s["advantages"] for s in out["sequences"]] == [[0.5], [pytest.approx(-0.3)]]


@pytest.mark.parametrize("argv,message", [
    (["--rewards", "0.8,0.6", "--lengths", "3"], "2 rewards but 1 lengths"),
    (["--rewards", "0.8,0.6", "--lengths", "3,4", "--gamma", "1.5"], "--gamma must be in [0, 1]"),
    (["--rewards", "0.8,0.6", "--lengths", "3,4", "--gamma", "-0.1"], "--gamma must be in [0, 1]"),
    (["--rewards", "0.8", "--lengths", "3", "--estimator", "ppo"], "unknown estimator 'ppo'; valid: grpo"),
    (["--rewards", "0.8,x", "--lengths", "3,4"], "--rewards"),
    (["--rewards", "0.8,0.6", "--lengths", "3,4", "--groups", "0"], "group ids"),
    (["--rewards", "0.8", "--lengths", "-1"], "--lengths must be >= 0"),
    (["--rewards", "0.8", "--lengths", "3", "--normalize", "tokens"], "unknown normalize"),
    (["--rewards", "0.8", "--lengths", "3", "--estimator", "gae", "--token-credit", "uniform"], "token_credit"),
    (["--rewards", "0.8", "--lengths", "3", "--estimator", "grpo_process"], "--step-rewards"),
    (["--rewards", "0.8", "--lengths", "3", "--values", "1,2"], "one value per token"),
    (["--lengths", "3"], "required: --rewards"),
    (["--rewards", "1", "--lengths", "3", "--bogus"], "unrecognized arguments"),
])
def test_bad_arguments_exit_2_with_one_line(capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        covey_advantages(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("covey advantages: error: ")
    assert message in err


def test_add_parser_wires_into_a_parent_cli(capsys):
    parser = argparse.ArgumentParser(prog="covey")
    sub = parser.add_subparsers(dest="command")
    advantages.add_parser(sub)
    args = parser.parse_args(["advantages", "--rewards", "1,0", "--lengths", "1,1", "--json"])
    assert args.func(args) == 0
    assert json.loads(capsys.readouterr().out)["sequences"][0]["advantages"] == pytest.approx([1.0], abs=1e-5)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["advantages", "--lengths", "1"])
    assert e.value.code == 2 and capsys.readouterr().err.count("\n") == 1


def test_module_entry_point_exit_code():
    proc = subprocess.run([sys.executable, "-m", "covey.cli", "advantages", "--rewards", "1", "--lengths", "1,2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip() == "covey advantages: error: 1 rewards but 2 lengths"


def test_reader_closing_early_ends_quietly():
    """`covey advantages --json | head -3`: the reader takes three lines and closes the pipe. The
    output (about 2 MB) is far beyond a pipe's buffer, so covey is still writing when it closes."""
    n = 2000
    argv = [sys.executable, "-m", "covey.cli", "advantages", "--rewards", ",".join(["1", "0"] * (n // 2)),
            "--lengths", ",".join(["20"] * n), "--groups", ",".join(str(i // 2) for i in range(n)), "--json"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    head = [proc.stdout.readline() for _ in range(3)]
    proc.stdout.close()
    err = proc.stderr.read()
    proc.wait(timeout=120)
    assert head[0] == "{\n"
    assert proc.returncode in (0, 141) and "Traceback" not in err and "BrokenPipeError" not in err, err
