#!/bin/bash
# The GPU check, one command, on a machine with 1 to 8 NVIDIA GPUs, with or without a package index (`make gpu-check`):
#   bench/gpu/check.sh [RESULTS_DIR, default bench/gpu/results] [SECONDS, default 540]
# Python: $PYTHON (default: .venv/bin/python where it exists, else python3). It installs nothing when torch (CUDA),
# Accelerate, Ray and the project's other packages import already; otherwise from WHEELS=<dir> with --no-index (built
# where pip works by bench/gpu/prepare_wheels.sh: Ray slimmed to what raylaunch uses, about 36 MiB in all), and only
# without WHEELS from the package index. Each stage has its own time bound; one that fails does not stop the next:
#   probe       3 GiB of model + AdamW state on the GPU: session.save (first and later) against save_state; a rerun of
#               the same name must restore it bitwise (bench/gpu/gpuprobe_fn.py)
#   bench       BENCH_GPU=1 bench/run.py: raylaunch against torchrun and Ray Train with NCCL (bench/results-gpu.md)
#   strategies  bench/strategies.py --gpu: FSDP against DDP in fp32, bf16, fp16 (every combination, failures listed)
#   With 2+ GPUs also: tests/test_gpu.py (a hung NCCL collective, every rank's stack, Flight Recorder dumps) and the
#   digits example on `--local-nodes 2`, one GPU each (the embedded cluster divides the machine's GPUs).
# Everything printed goes to RESULTS_DIR/check.log, with the results files: commit them with the machine's name.
set -u; set -m
ROOT=$(cd "$(dirname "$0")/../.." && pwd); cd "$ROOT"
O=${1:-bench/gpu/results}; mkdir -p "$O"; O=$(cd "$O" && pwd)
T0=$(date +%s); DEADLINE=$(( T0 + ${2:-540} ))
exec > >(tee "$O/check.log") 2>&1
PY=${PYTHON:-}
[ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=$(command -v python3); }
export PYTHONUNBUFFERED=1 RAY_USAGE_STATS_ENABLED=0 PATH="$(cd "$(dirname "$PY")" && pwd):$PATH"
at() { echo "$(( $(date +%s) - T0 ))s"; }
stage() {  # stage NAME MAX_S CMD...: the bound ends the stage's whole process group
  local name=$1 max=$2; shift 2
  local t=$(( DEADLINE - $(date +%s) )); (( t > 25 )) || { echo "== $name: skipped, $t s left"; return 0; }
  (( max < t - 10 )) || max=$(( t - 10 ))
  echo "== $name: start at $(at), bound ${max} s"
  "$@" & local pid=$!
  ( sleep "$max"; echo "== $name: past its bound"; kill -TERM -- -"$pid"; sleep 10; kill -KILL -- -"$pid" ) 2>/dev/null &
  local wd=$!; wait "$pid"; local rc=$?; kill -- -"$wd" 2>/dev/null
  echo "== $name: rc=$rc at $(at)"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>/dev/null || echo "nvidia-smi: not found"
needs="import torch, accelerate, ray, yaml, jsonschema, fsspec, pyarrow, psutil, tensorboardX, tqdm, matplotlib, jobs.cli"
setup() {
  if "$PY" -c "$needs" 2>/dev/null && command -v raylaunch >/dev/null; then
    echo "setup: everything imports; nothing installed"
  elif [ -n "${WHEELS:-}" ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "$WHEELS"/*.whl || return 1
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . || return 1
  else
    echo "setup: missing packages and no WHEELS=<dir>: installing from the package index"
    "$PY" -m pip install -q -e '.[test,bench]' || return 1
  fi
  "$PY" -c "import torch, accelerate, ray; print('torch', torch.__version__, 'gpus', torch.cuda.device_count(), 'accelerate', accelerate.__version__, 'ray', ray.__version__)"
}
stage setup 150 setup
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
[ "$GPUS" -ge 1 ] || { echo "gpu-check: torch sees no CUDA GPU (a CPU build of torch, or no driver)"; exit 1; }
probe() {
  local n=gp$(date +%s)
  raylaunch run bench/gpu/gpuprobe.yaml --storage /tmp/gp-runs --name "$n" && cp /tmp/gp-runs/"$n"/result.json "$O/probe-first.json" &&
    raylaunch run bench/gpu/gpuprobe.yaml --storage /tmp/gp-runs --name "$n" --set checkpoint.keep=3 && cp /tmp/gp-runs/"$n"/result.json "$O/probe-resumed.json" &&
    "$PY" - "$O" <<'PYEOF'
import json, statistics, sys
a, b = (json.load(open(f"{sys.argv[1]}/probe-{k}.json"))["return_value"] for k in ("first", "resumed"))
s, l = max(a["session_save_s"]), statistics.median(a["save_state_s"])
print(f"probe: {a['state_mib']:.0f} MiB on {a['cuda_name']}: session.save held {a['session_save_s']} s (longest "
      f"{s:.3f} s = {s / l:.3f}x save_state's median), save_state {a['save_state_s']} s; resumed bitwise: "
      f"{a['fingerprint'] == b.get('fingerprint')}")
PYEOF
  rm -rf /tmp/gp-runs/"$n"
}
stage probe 150 probe
stage bench 180 bash -c "BENCH_GPU=1 BENCH_REPS=1 '$PY' bench/run.py; cp bench/results-gpu.* '$O'/"
stage strategies 150 bash -c "'$PY' bench/strategies.py --gpu; cp bench/results-gpu.md '$O'/strategies-gpu.md"
if [ "$GPUS" -ge 2 ]; then
  stage nccl-hang 150 "$PY" -m pytest -q -n 0 tests/test_gpu.py
  stage local-nodes 120 bash -c "raylaunch run jobs/examples/digits.yaml --local-nodes 2 --storage /tmp/gp-runs --name ln\$(date +%s) --set config.epochs=1"
fi
echo "== done at $(at)"
