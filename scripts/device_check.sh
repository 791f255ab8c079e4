#!/usr/bin/env bash
# The GPU machine's check of the CUDA kernel library: install the carried wheels (.whl: gguf),
# make `import ntx.*` work without installing the package, precompile the kernels in parallel
# (cupy's on-disk cache), run the GPU tests, then the kernel benchmark. Logs and JSON go to $OUT.
#
# From the repo root on the device machine:
#   bash scripts/device_check.sh [--quick] [--no-bench] [--no-tests] [--sanitize] [pytest args]
# --sanitize: first run the attention/KV/graph tests under compute-sanitizer memcheck.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/.device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
QUICK=""; BENCH=1; TESTS=1; SANITIZE=0; PYTEST_ARGS=()
for a in "$@"; do
  case "$a" in
    --quick) QUICK="--quick" ;;
    --no-bench) BENCH=0 ;;
    --no-tests) TESTS=0 ;;
    --sanitize) SANITIZE=1 ;;
    *) PYTEST_ARGS+=("$a") ;;
  esac
done

if ls "$REPO"/.whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$REPO"/.whl/*.whl \
    || { echo "wheel install failed"; exit 1; }
fi
# ntx namespace without installing: /tmp/nsroot/ntx/{daemons,shared,ctl} -> the repo's folders
NS=/tmp/nsroot
rm -rf "$NS" && mkdir -p "$NS/ntx"
for f in "$REPO"/ntx/*; do ln -s "$f" "$NS/ntx/"; done
for d in daemons shared ctl; do [ -d "$REPO/$d" ] && ln -s "$REPO/$d" "$NS/ntx/$d"; done
export PYTHONPATH="$NS:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
cd /tmp  # not the repo root: its ntx/ would shadow the namespace farm

{
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c "import cupy, numpy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'numpy', numpy.__version__)"
  python3 -c "import gguf; print('gguf', gguf.__file__)"
  python3 -c "import ntx.daemons.compute.cuda.kernels as k; print('ntx kernels from', k.__file__)"
} 2>&1 | tee "$OUT/env.txt"

t0=$(date +%s)
python3 "$REPO/scripts/bench_kernels.py" --precompile --jobs "$(nproc)" 2>&1 | tee "$OUT/precompile.log"
# pytest puts the repo root (parent of the tests package) first on sys.path, where ntx/ lacks the
# mapped subpackages: import ntx from the farm before pytest starts.
PYTEST=(python3 -c "import sys, ntx.daemons.compute.cuda.kernels, pytest; sys.exit(pytest.main(sys.argv[1:]))")
rc=0
if [ "$SANITIZE" = 1 ] && command -v compute-sanitizer >/dev/null; then
  timeout 240 compute-sanitizer --tool memcheck --print-limit 5 "${PYTEST[@]}" "$REPO/tests/gpu" -q -x -p no:cacheprovider \
    -k "attention or kv_append or graph" 2>&1 | tail -40 | tee "$OUT/sanitizer.log"
fi
if [ "$TESTS" = 1 ]; then
  "${PYTEST[@]}" "$REPO/tests/gpu" -q -p no:cacheprovider --timeout 600 --junitxml="$OUT/tests.xml" \
    "${PYTEST_ARGS[@]}" 2>&1 | tee "$OUT/tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$BENCH" = 1 ]; then
  python3 "$REPO/scripts/bench_kernels.py" $QUICK --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
echo "device_check: tests rc=$rc, $(( $(date +%s) - t0 )) s"
exit $rc
