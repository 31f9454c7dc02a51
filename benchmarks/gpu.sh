#!/usr/bin/env bash
# Everything a short lease of a GPU machine should measure, in one run:
#   1. the environment: nvidia-smi, and CuPy for the driver's CUDA major (installed if missing);
#   2. the CUDA backend's tests (tests/test_cuda_backend.py), now including the real kernels;
#   3. the GPU benchmark (benchmarks/bench_gpu.py): fused vs unfused CUDA vs CuPy dense ops,
#      and torch's attention when torch with CUDA is importable.
# All results and logs go to one directory: the first argument, else $OUT, else ./gpu-results.
#
#   benchmarks/gpu.sh [OUT_DIR] [extra bench_gpu.py arguments...]
#
# Environment: PYTHON (default: what scripts/find-python finds, a Python >= 3.12), VENV (where to install if bbrules or CuPy is missing;
# default OUT_DIR/venv), WHEELHOUSE (a directory of wheels for an offline machine).
# Exit status: 0 when tests and benchmark passed, 1 when either failed, 2 when the machine is
# not usable (no GPU, or CuPy cannot be installed).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ $# -gt 0 && "$1" != -* ]]; then OUT="$1"; shift; fi
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
exec > >(tee -a "$OUT/gpu.log") 2>&1

log() { printf '[gpu.sh %s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { log "ERROR: $*"; exit 2; }

log "results in $OUT"
cd "$ROOT"

# -- 1. the machine -------------------------------------------------------------------------
command -v nvidia-smi >/dev/null || die "nvidia-smi not found: this is not a GPU machine"
nvidia-smi > "$OUT/nvidia-smi.txt" || die "nvidia-smi failed (see $OUT/nvidia-smi.txt)"
CUDA_MAJOR="$(sed -n 's/.*CUDA Version: *\([0-9][0-9]*\).*/\1/p' "$OUT/nvidia-smi.txt" | head -n1)"
[[ -n "$CUDA_MAJOR" ]] || die "cannot read the driver's CUDA version from nvidia-smi"
log "GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -n1); driver CUDA $CUDA_MAJOR"
if (( CUDA_MAJOR >= 13 )); then CUPY="cupy-cuda13x[ctk]"; else CUPY="cupy-cuda12x[ctk]"; fi

# bbrules needs Python >= 3.12 (egglog 14 is only built for it); scripts/find-python honours $PYTHON
PY="$(scripts/find-python)" || die "no Python >= 3.12 found (set PYTHON): bbrules needs it for egglog 14"
log "Python: $PY ($("$PY" --version 2>&1))"
ready() { "$PY" -c 'import bbrules, cupy, pytest, hypothesis; assert cupy.is_available()' 2>/dev/null; }
if ready; then
  log "using $PY as it is: bbrules and a working CuPy are importable"
else
  VENV="${VENV:-$OUT/venv}"
  log "installing into $VENV: bbrules (editable) with test extras, and $CUPY"
  [[ -x "$VENV/bin/python" ]] || "$PY" -m venv --system-site-packages "$VENV" \
    || die "cannot create a virtual environment with $PY"
  PY="$VENV/bin/python"
  PIP=("$PY" -m pip install --disable-pip-version-check)
  if [[ -n "${WHEELHOUSE:-}" ]]; then PIP+=(--no-index --find-links "$WHEELHOUSE"); fi
  "${PIP[@]}" -e "$ROOT[test]" "$CUPY" > "$OUT/pip.log" 2>&1 \
    || die "pip install failed (see $OUT/pip.log); on an offline machine set WHEELHOUSE"
  ready || die "CuPy is installed but finds no usable GPU: $("$PY" -c 'import cupy; cupy.show_config()' 2>&1 | tail -n 3)"
fi
"$PY" -c 'import cupy; cupy.show_config()' > "$OUT/cupy-config.txt" 2>&1 || true
"$PY" -c 'import torch; print(torch.__version__, torch.cuda.is_available())' \
  > "$OUT/torch.txt" 2>&1 || echo "torch not importable: no SDPA baseline" > "$OUT/torch.txt"
log "torch: $(cat "$OUT/torch.txt")"

# -- 2. tests ---------------------------------------------------------------------------------
status=0
log "running tests/test_cuda_backend.py (log: $OUT/tests.log)"
if "$PY" -m pytest -q -rs tests/test_cuda_backend.py --junitxml="$OUT/tests.xml" \
    > "$OUT/tests.log" 2>&1; then
  log "tests passed: $(tail -n 1 "$OUT/tests.log")"
else
  status=1
  log "TESTS FAILED: $(tail -n 1 "$OUT/tests.log") (the benchmark runs anyway)"
fi

# -- 3. benchmark -----------------------------------------------------------------------------
log "running benchmarks/bench_gpu.py (log: $OUT/bench.log)"
if "$PY" benchmarks/bench_gpu.py --out "$OUT" "$@" > "$OUT/bench.log" 2>&1; then
  log "benchmark done"
else
  status=1
  log "BENCHMARK REPORTED FAILURES (see $OUT/bench.log)"
fi
[[ -f "$OUT/bench_gpu.md" ]] && cat "$OUT/bench_gpu.md"
log "finished with status $status; everything is in $OUT"
exit "$status"
