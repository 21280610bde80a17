# The GPU scripts' shared preamble, sourced (not run) by scripts/gpu_check.sh, gpu_capacity.sh, gpu_learn.sh,
# gpu_speed.sh and gpu_all.sh: sourcing it moves to the repository root (GPU_CALLER keeps the caller's folder) and
# defines the steps every one of them takes on a GPU machine without network:
#
#   gpu_begin NAME LOG      the log folder (made absolute, relative to the caller), PY, a scratch folder WORK removed
#                           at exit, status=0, start
#   gpu_machine             LOG/machine.txt: the GPU (nvidia-smi), torch with its CUDA, transformers
#   gpu_wheels DIR FILE [SPEC...]
#                           the carried wheels in DIR (only SPECs' name==version, if given; pyarrow's only where the
#                           machine's is missing or older than 24) installed without network or dependencies into
#                           WORK/site (nothing in the machine's Python changes), pip's output in FILE; that folder and
#                           covey's checkout put first on PYTHONPATH
#   gpu_tokenizer           .gpu_assets/smollm2-tokenizer.tgz unpacked: TOKENIZER_DIR (empty without it)
#   gpu_pytest LIMIT_S FILE [TEST_FILE...]
#                           the tests marked `gpu` (default: every test file holding one) under `timeout`, the
#                           output in FILE and its last lines shown; pytest's exit status
#   gpu_pack_tokenizer      (--prepare, with network) SmolLM2's tokenizer from covey's model cache into .gpu_assets/
#
# A script started by another that has installed the wheels and described the machine (gpu_all.sh) reuses both:
# COVEY_GPU_SITE names the installed folder, COVEY_GPU_MACHINE the machine.txt written. PYTHON replaces python3.
# shellcheck shell=bash disable=SC2034

GPU_CALLER=$PWD
cd "$(dirname "${BASH_SOURCE[0]}")/.." || exit 1

gpu_path() { case "$1" in /*) echo "$1" ;; *) echo "$GPU_CALLER/$1" ;; esac; }  # a path given relative to the caller

gpu_begin() {
  GPU_NAME=$1
  LOG=$(gpu_path "$2")
  mkdir -p "$LOG" && LOG=$(cd "$LOG" && pwd)
  PY=${PYTHON:-python3}
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  export PYTHONUNBUFFERED=1
  status=0
  start=$(date +%s)
}

gpu_machine() {
  if [ -n "${COVEY_GPU_MACHINE:-}" ] && [ -f "$COVEY_GPU_MACHINE" ]; then
    cp "$COVEY_GPU_MACHINE" "$LOG/machine.txt" && cat "$LOG/machine.txt"
    return
  fi
  { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "no nvidia-smi"
    "$PY" -c "import torch, transformers; print('torch', torch.__version__, 'CUDA', torch.version.cuda,
'| transformers', transformers.__version__, '| GPUs', torch.cuda.device_count())"; } | tee "$LOG/machine.txt"
}

gpu_on_path() { case ":${PYTHONPATH:-}:" in *":$1:"*) ;; *) export PYTHONPATH="$1${PYTHONPATH:+:$PYTHONPATH}" ;; esac; }

gpu_wheels() {
  local dir=$1 out=$2 spec name wheels=""
  shift 2
  if [ -z "${COVEY_GPU_SITE:-}" ]; then
    if [ $# -gt 0 ]; then  # the named wheels only: DIR may hold others
      for spec in "$@"; do
        name=$(echo "${spec%%==*}" | tr - _)
        wheels="$wheels $(ls "$dir/$name-${spec##*==}"-*.whl 2>/dev/null)"
      done
    elif ls "$dir"/*.whl >/dev/null 2>&1; then
      wheels=$(ls "$dir"/*.whl | grep -v /pyarrow-)
      if ! "$PY" -c "import pyarrow, sys; sys.exit(int(pyarrow.__version__.split('.')[0]) < 24)" 2>/dev/null; then
        wheels="$wheels $(ls "$dir"/pyarrow-*.whl 2>/dev/null)"
      fi
    fi
    if [ -n "${wheels// /}" ]; then
      # shellcheck disable=SC2086
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" \
        $wheels > "$out" 2>&1 || { echo "$GPU_NAME: wheels did not install (see $out)"; status=1; }
      export COVEY_GPU_SITE=$WORK/site
    fi
  fi
  [ -n "${COVEY_GPU_SITE:-}" ] && gpu_on_path "$COVEY_GPU_SITE"
  gpu_on_path "$PWD"  # covey itself from this checkout, first
}

gpu_tokenizer() {
  TOKENIZER_DIR=""
  if [ -f .gpu_assets/smollm2-tokenizer.tgz ]; then
    mkdir -p "$WORK/tokenizer" && tar xzf .gpu_assets/smollm2-tokenizer.tgz -C "$WORK/tokenizer" \
      && TOKENIZER_DIR=$WORK/tokenizer
  fi
}

gpu_pytest() {
  local limit=$1 out=$2 files
  shift 2
  if [ $# -gt 0 ]; then
    files=("$@")
  else  # only the files that hold gpu tests: collecting the rest would need every optional extra (datasets, ...)
    mapfile -t files < <(grep -rl "pytest.mark.gpu" tests | sort)
  fi
  echo "== pytest -m gpu ${files[*]}"
  timeout -k 10 "$limit" "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs "${files[@]}" > "$out" 2>&1
  local rc=$?
  tail -15 "$out"
  return "$rc"
}

gpu_pack_tokenizer() {
  mkdir -p .gpu_assets
  tar czf .gpu_assets/smollm2-tokenizer.tgz -C "${COVEY_CACHE:-$HOME/.cache/covey}/models/SmolLM2-135M-Instruct" \
    tokenizer.json tokenizer_config.json chat_template.jinja
}
