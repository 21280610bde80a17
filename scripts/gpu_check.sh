#!/usr/bin/env bash
# The GPU check: covey on a CUDA machine without network access, in at most 5 minutes.
#
#   bash scripts/gpu_check.sh LOG_DIR [WHEEL_DIR]
#
# Runs covey from this checkout without installing it or fetching anything (torch, transformers, accelerate, peft
# and pytest must be installed; anything else can be supplied as wheels in WHEEL_DIR, default ../wheels, installed
# into a temporary folder by scripts/gpu_common.sh), runs the tests marked `gpu`, then two short training runs on
# the tiny model (GRPO and PPO, train.device=cuda), and prints a summary: the tests, and each run's reward, seconds
# per step and peak GPU memory per phase. Everything it writes (logs, run folders, summary.txt) goes to LOG_DIR.
# Exit status 0 only if every part passed. scripts/gpu_all.sh runs every GPU check in one go.
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
gpu_begin gpu_check "${1:?usage: bash scripts/gpu_check.sh LOG_DIR [WHEEL_DIR]}"
gpu_machine
gpu_wheels "$(gpu_path "${2:-../wheels}")" "$LOG/install.log"

gpu_pytest 240 "$LOG/pytest.log" || status=1

echo "== two short runs on the tiny model"
"$PY" -c "from covey.models.tiny import build_tiny_model; build_tiny_model('$LOG/tiny')" > /dev/null || status=1
for preset in grpo ppo; do
  timeout 120 "$PY" -m covey.cli train "$preset" model.path="$LOG/tiny" train.device=cuda train.steps=4 \
    rollout.prompts_per_step=8 rollout.group_size=8 rollout.max_new_tokens=64 task.eval_size=32 \
    reward.functions=tests.helpers:varied_reward optim.lr=1e-3 train.progress=false \
    train.output_dir="$LOG/runs" train.run_name="$preset" > "$LOG/$preset.log" 2>&1 \
    || { echo "gpu_check: $preset failed (tail of $LOG/$preset.log):"; tail -5 "$LOG/$preset.log"; status=1; }
done

"$PY" - "$LOG" <<'PY' | tee "$LOG/summary.txt"
import json, statistics, sys
from pathlib import Path
log = Path(sys.argv[1])
print("machine:", " | ".join((log / "machine.txt").read_text().split("\n")).strip(" |"))
tail = (log / "pytest.log").read_text().strip().splitlines()
print("pytest -m gpu:", tail[-1] if tail else "no output")
for preset in ("grpo", "ppo"):
    metrics = log / "runs" / preset / "metrics.jsonl"
    if not metrics.is_file():
        print(f"{preset}: no metrics"); continue
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    later = [r["time/step"] for r in steps[1:]] or [r["time/step"] for r in steps]
    peaks = {k.rsplit("/", 1)[1]: max(r.get(k, 0) for r in steps) for k in steps[-1] if k.startswith("memory/gpu_peak_mb/")}
    print(f"{preset}: {len(steps)} steps, reward {steps[0]['reward/mean']:.3f} -> {steps[-1]['reward/mean']:.3f}, "
          f"median s/step (steps 2..) {statistics.median(later):.2f}, peak GPU MiB "
          + ", ".join(f"{k} {v:.0f}" for k, v in peaks.items()))
PY
echo "gpu_check: $([ $status -eq 0 ] && echo passed || echo FAILED); logs in $LOG"
exit $status
