#!/usr/bin/env bash
# The GPU speed check: covey's static-cache / CUDA-graph decoding tests and the covey-vs-TRL benchmark
# (python -m bench.gpu) in one run of at most 8 minutes on one GPU without network access.
#
# Needs: one CUDA GPU with torch and transformers installed (Python 3.12), no network, about
# 8 minutes (allow 10), and the repository with two prepared folders beside it.
#
# 1. Prepare, once, on a machine with network, from the repository root:
#
#      bash scripts/gpu_speed.sh --prepare
#
#    which downloads the Python 3.12 wheels the GPU machine lacks into .whl/ and packs SmolLM2's
#    tokenizer (from covey's model cache, $COVEY_CACHE or ~/.cache/covey) into .gpu_assets/:
#
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#        --platform manylinux1_x86_64 -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#        pyarrow==26.0.1
#      mkdir -p .gpu_assets && tar czf .gpu_assets/smollm2-tokenizer.tgz \
#        -C ~/.cache/covey/models/SmolLM2-135M-Instruct tokenizer.json tokenizer_config.json chat_template.jinja
#
#    ($PYTHON replaces python3: any Python with pip. .whl/ and .gpu_assets/ are in .gitignore;
#    together about 55 MiB. pyarrow is 53 MiB of it and is installed on the GPU machine only where
#    its own is missing or older than datasets needs; drop it if that is known.)
#
# 2. Copy the checkout with .whl/ and .gpu_assets/ to the GPU machine and run, from the repository root:
#
#      bash scripts/gpu_speed.sh LOG_DIR
#
#    The wheels install into a temporary folder (nothing in the machine's Python changes); covey
#    runs from the checkout. A rerun of part of it: SKIP_TESTS=1 leaves out the tests,
#    DECODE_MODES= the decode-mode timings, TOTAL_S (default 470) bounds the seconds from the start
#    to the last benchmark run, and BENCH_FLAGS adds flags to python -m bench.gpu (--profile,
#    --covey-variant KEYS, ...), e.g.
#
#      BENCH_FLAGS='--sizes 1.5b --covey-variant algo.micro_batch_size=16' bash scripts/gpu_speed.sh LOG_DIR
#
#    It writes to LOG_DIR: summary.txt (tests, the benchmark table, the targets met or not),
#    bench.md, bench.json, pytest.log and logs.tgz (every child's log and JSON): 5 files.
#
# What it checks: tests/rollout/test_static_decode_gpu.py (greedy tokens under CUDA-graph capture equal
# `generate`'s, with and without torch.compile's kernels; graphs reused between calls; an update synced
# into the bf16 sampling copy reaches the replayed graphs; a GRPO run through the CLI with
# rollout.decode=graphs), then python -m bench.gpu --decode-modes graphs,compile: covey and TRL's
# GRPOTrainer (settings mapped from covey's by bench/trl_side.py; BENCH_FLAGS=--trl-gc for TRL's own
# gradient checkpointing) on random Qwen2.5-0.5B and -1.5B shapes (8 x 8 samples, 256 tokens), per-phase seconds,
# peak GPU memory, covey's decode step against its bandwidth floor, update TFLOP/s against the bf16
# matmul peak, then graphs against compile on each model's decode. Exit status 0 only if every part ran.
# The preamble (machine, wheels, tokenizer, tests) is scripts/gpu_common.sh's; scripts/gpu_all.sh runs this script
# with SKIP_TESTS=1 as one piece of every GPU check.
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
if [ "${1:-}" = "--prepare" ]; then
  set -e
  "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux1_x86_64 -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
    pyarrow==26.0.1
  gpu_pack_tokenizer
  du -sh .whl .gpu_assets
  git ls-files -z | du -ch --files0-from=- | tail -1
  exit 0
fi
gpu_begin gpu_speed "${1:?usage: bash scripts/gpu_speed.sh LOG_DIR | --prepare}"
gpu_machine
# Packages the machine lacks, from the wheels in .whl/; covey itself from this checkout.
gpu_wheels .whl "$LOG/install.log"
"$PY" -c "import trl, datasets; print('trl', trl.__version__, '| datasets', datasets.__version__)" \
  | tee -a "$LOG/machine.txt" || { echo "gpu_speed: trl is not importable: the TRL runs will fail"; status=1; }
gpu_tokenizer

if [ -z "${SKIP_TESTS:-}" ]; then
  gpu_pytest 150 "$LOG/pytest.log" tests/rollout/test_static_decode_gpu.py || status=1
else
  echo "skipped (SKIP_TESTS)" > "$LOG/pytest.log"
fi

left=$(( ${TOTAL_S:-470} - ($(date +%s) - start) ))
echo "== python -m bench.gpu (budget ${left}s)"
# BENCH_FLAGS: extra flags for a trial elsewhere (e.g. BENCH_FLAGS=--smoke on a CPU)
# shellcheck disable=SC2086
timeout $(( left + 30 )) "$PY" -m bench.gpu --out "$WORK/bench" --work "$WORK/models" \
  ${TOKENIZER_DIR:+--tokenizer "$TOKENIZER_DIR"} \
  --decode-modes "${DECODE_MODES-graphs,compile}" --budget-s "$left" ${BENCH_FLAGS:-} 2>&1 \
  | tee "$WORK/bench-stdout.txt" | sed '/^device: /,$d'
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1
cp "$WORK/bench.md" "$WORK/bench.json" "$LOG/" 2>/dev/null || status=1

{ echo "machine: $(tr '\n' ' ' < "$LOG/machine.txt")"
  echo "pytest: $(tail -1 "$LOG/pytest.log")"
  echo "seconds: $(( $(date +%s) - start ))"
  cat "$LOG/bench.md" 2>/dev/null || echo "bench: no result (bench-stdout.txt in logs.tgz)"
} > "$LOG/summary.txt"
mkdir -p "$WORK/bench-logs"
mv "$WORK/bench-stdout.txt" "$LOG/machine.txt" "$WORK/bench-logs/"
[ -f "$LOG/install.log" ] && mv "$LOG/install.log" "$WORK/bench-logs/"
tar czf "$LOG/logs.tgz" -C "$WORK" bench-logs
cat "$LOG/summary.txt"
echo "gpu_speed: $([ $status -eq 0 ] && echo passed || echo FAILED); files in $LOG"
exit $status
