#!/usr/bin/env bash
# The GPU capacity check: the fused-kernel and QLoRA gpu tests, then python -m bench.gpu_capacity (which model
# sizes a GRPO step fits under 24 / 80 GiB caps, full-parameter, LoRA and QLoRA, covey against TRL 1.16's
# GRPOTrainer) in one run of at most 8 minutes on one GPU without network access.
#
# Needs: one CUDA GPU with torch, transformers, peft, accelerate, triton and pyarrow installed (Python 3.12),
# no network, about 8 minutes, 40 GB of free disk (the 7B and 14B model folders), and the repository with two
# prepared folders beside it.
#
# 1. Prepare, once, on a machine with network, from the repository root:
#
#      bash scripts/gpu_capacity.sh --prepare
#
#    which downloads the wheels the GPU machine lacks into .whl/ (about 47 MiB: bitsandbytes is 41 of it)
#    and packs SmolLM2's tokenizer (from covey's model cache, $COVEY_CACHE or ~/.cache/covey) into
#    .gpu_assets/. The wheels, one per line of WHEELS below:
#
#      trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchao==0.18.0 liger-kernel==0.8.5
#      bitsandbytes==0.50.2
#
# 2. Copy the checkout with .whl/ and .gpu_assets/ to the GPU machine and run, from the repository root:
#
#      bash scripts/gpu_capacity.sh LOG_DIR
#
#    The wheels install into a temporary folder (nothing in the machine's Python changes). SKIP_TESTS=1 leaves
#    out the tests, TOTAL_S (default 450) bounds the seconds from the start to the last cell, and BENCH_FLAGS
#    adds flags to python -m bench.gpu_capacity (--trainers covey, --no-14b, --dry-run, ...).
#    It writes to LOG_DIR: summary.txt (tests, the cells' table, the acceptance lines), capacity.md,
#    capacity.jsonl (one line a cell), pytest.log and logs.tgz (every child's log).
#
# The preamble (machine, wheels, tokenizer, tests) is scripts/gpu_common.sh's; scripts/gpu_all.sh runs this script
# with SKIP_TESTS=1 as one piece of every GPU check.
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
WHEELS="
trl==1.16.0
datasets==5.2.0
dill==0.4.1
multiprocess==0.70.19
torchao==0.18.0
liger-kernel==0.8.5
bitsandbytes==0.50.2
"
if [ "${1:-}" = "--prepare" ]; then
  set -e
  # shellcheck disable=SC2086
  "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $WHEELS
  gpu_pack_tokenizer
  du -sh .whl .gpu_assets
  exit 0
fi
gpu_begin gpu_capacity "${1:?usage: bash scripts/gpu_capacity.sh LOG_DIR | --prepare}"
gpu_machine
# The prepared wheels (only those named in WHEELS: .whl/ may hold others); covey itself from this checkout.
# shellcheck disable=SC2086
gpu_wheels .whl "$LOG/install.log" $WHEELS
"$PY" -c "import trl, torchao, liger_kernel, bitsandbytes; print('trl', trl.__version__, '| torchao',
torchao.__version__, '| bitsandbytes', bitsandbytes.__version__)" | tee -a "$LOG/machine.txt" \
  || { echo "gpu_capacity: a carried package does not import: some cells will fail"; status=1; }
gpu_tokenizer

if [ -z "${SKIP_TESTS:-}" ]; then
  gpu_pytest 120 "$LOG/pytest.log" tests/models/test_kernels_gpu.py || status=1
else
  echo "skipped (SKIP_TESTS)" > "$LOG/pytest.log"
fi

left=$(( ${TOTAL_S:-450} - ($(date +%s) - start) ))
echo "== python -m bench.gpu_capacity (budget ${left}s)"
# shellcheck disable=SC2086
timeout $(( left + 40 )) "$PY" -m bench.gpu_capacity --out "$WORK/capacity" --work "$WORK/models" \
  ${TOKENIZER_DIR:+--tokenizer "$TOKENIZER_DIR"} \
  --budget-s "$left" ${BENCH_FLAGS:-} 2>&1 | tee "$WORK/capacity-stdout.txt" | grep -v '^bench: '
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
case " ${BENCH_FLAGS:-} " in
  *" --dry-run "*) ;;  # the cells listed, nothing run: no table
  *) cp "$WORK/capacity.md" "$WORK/capacity.jsonl" "$LOG/" 2>/dev/null || status=1 ;;
esac

{ echo "machine: $(tr '\n' ' ' < "$LOG/machine.txt")"
  echo "pytest: $(tail -1 "$LOG/pytest.log")"
  echo "seconds: $(( $(date +%s) - start ))"
  cat "$LOG/capacity.md" 2>/dev/null || echo "capacity: no result (capacity-stdout.txt in logs.tgz)"
} > "$LOG/summary.txt"
mkdir -p "$WORK/capacity-logs"
mv "$WORK/capacity-stdout.txt" "$LOG/machine.txt" "$WORK/capacity-logs/" 2>/dev/null
[ -f "$LOG/install.log" ] && mv "$LOG/install.log" "$WORK/capacity-logs/"
tar czf "$LOG/logs.tgz" -C "$WORK" capacity-logs
rm -rf "$WORK/models"
cat "$LOG/summary.txt"
echo "gpu_capacity: $([ $status -eq 0 ] && echo passed || echo FAILED); files in $LOG"
exit $status
