#!/usr/bin/env bash
# The GPU machine's check of the CUDA kernel library: install the carried wheels (.whl: gguf),
# make `import ntx.*` work without installing the package, precompile the kernels in parallel
# (cupy's on-disk cache), run the GPU tests, then the kernel benchmark. Logs and JSON go to $OUT.
#
# From the repo root on the device machine:
#   bash scripts/device_check.sh [--quick] [--no-bench] [--no-tests] [--sanitize] [--decode-bench]
#                                [--stream-bench] [--profile] [--only-copy] [pytest args]
# --sanitize: first run the attention/KV/graph/rope/i16s tests under compute-sanitizer memcheck.
# --decode-bench: write synthetic Llama-3-8B-shaped models (Q4_K_M, Q8_0, F16) under ~/models and
#   time fully resident decode (scripts/bench_decode.py), SmolLM2 too when it is there.
#   DECODE_TYPES (default "Q4_K_M Q8_0 F16"; "" for none) and DECODE_BATCH (default "1 8") steer it;
#   DECODE_QWEN2=1 adds Qwen2.5-1.5B's shape as Qwen2 and as a Llama (what its biases and pairs cost); DECODE_ARGS go
#   to bench_decode.py as they are (e.g. "--kernels batch-invariant=off batch-invariant=on"; with
#   "--rounds 6" in front, the settings alternate in one process: the way to time a cost of a few %).
# --profile: each operation's share of one decode pass (B=1 and B=8, or PROFILE_BATCH) and one 512-token prefill
#   pass of the synthetic 8B Q4_K_M (PROFILE_TYPE: another make_gguf type) (scripts/profile_pass.py)
#   into $OUT/profile.{json,txt}; PROFILE_ARGS go to profile_pass.py as they are (a later --prompt
#   wins; e.g. "--prompt 0 --kernels batch-invariant=on,invariant-fixed=on").
# --stream-bench: write a 70B-shaped Q4_K_M and run `ntxctl bench` (scenarios a, b, c, check, d; spec on request).
# STREAM_OUT (default $OUT), STREAM_TOKENS, STREAM_BATCH, STREAM_SCENARIOS steer --stream-bench.
#   BENCH_ARGS (e.g. "--spec-verify-passes 1" for spec, "--skip-layers 40-59" for skip) goes to
#   the bench as it is. With `spec` in STREAM_SCENARIOS (speculative decoding, replay drafter)
#   DRAFT_MODEL=1 also writes a Llama-3.2-1B-shaped Q4_K_M (~0.8 GB) and runs it behind the
#   replay (--draft-model). Both go to this tree's bench only, never to a BASELINE tree's (which
#   may not know the options).
# --status-demo: start the 70B as in (a), generate 40 tokens, and save `ntxctl status` (text and
#   JSON) taken in the middle of the decode to $OUT/status-a.txt / status-a.json.
# --first-requests: write the 70B-shaped Q4_K_M, start it at 24 GiB and time the first token of
#   each new prompt shape sent after ready, then the same shapes again, and decode after a long
#   prompt against a short one (scripts/bench_first_requests.py) into $OUT/first_requests.json.
# --gemm-paths: time each matrix-product path per matrix (dev/cuda/bench_gemm_paths.py, GEMM_ARGS
#   passed to it) into $OUT/gemm_paths.{json,log}.
# --lab-tests: the kernel lab's tests (pytest dev/cuda; the positional pytest args go to them too,
#   e.g. -k mvq2_rows) into $OUT/lab-tests.log.
# --fx-variants: fixed-point mmq beside variants of it (dev/cuda/bench_fx_variants.py: each variant a folder
#   of sources, its bits checked first; with BASELINE, that tree's daemons/compute/cuda as "base"; FX_VARIANTS,
#   more NAME=DIR, and FX_VARIANTS_ARGS, e.g. "--types Q6_K --ts 40,48,64", go to it) into $OUT/fx_variants.{json,log}.
# --mmq-rows: mmq at one and two rows (mmq_rows_kernel) against mmq_kernel and the i16 matvec, its
#   bits checked first (dev/cuda/bench_mmq_rows.py, MMQ_ROWS_ARGS passed to it) into $OUT/mmq_rows.{json,log}.
# --mmqx: mmq with x staged in shared memory once per CTA (dev/cuda/bench_mmqx.py: the fixed form's bits
#   checked against fixed-point mmq, the default's against mmq, then every launch timed beside both; MMQX_ARGS,
#   e.g. "--types Q4_K --ts 64 --configs 4x2,8x3", go to it) into $OUT/mmqx.{json,log}.
# --no-precompile: skip the parallel precompile of every production kernel (~35 s cold), for calls that
#   run only lab benches.
# --draft-acceptance: drafting without a model on the real SmolLM2 on the GPU (scripts/draft_acceptance.py
#   --backend cuda: the nine texts, the auto shapes and the fixed chain; DRAFT_DRAFTERS replaces the
#   drafter list, DRAFT_TOKENS the budget (8; lookahead: 32 or 63: 64 drafted tokens make 65-row verify passes,
#   past which the default kernels round otherwise and greedy identity may break) into
#   $OUT/draft-acceptance-smollm2-cuda.{json,log}; needs SmolLM2 joined (both .models parts).
# --cluster-bench: 2 CPU replicas of SmolLM2 under Ray Serve against one (scripts/bench_cluster.py,
#   CLUSTER_ARGS replace its load options; NTX_CPU_THREADS per instance, default 4) into
#   $OUT/bench-cluster.json. The machine has no Ray: scripts/prepare_ray_wheels.sh writes its wheels
#   here as .dev/raydeps, .dev/ray1 and .dev/ray2 (~120 MB), carried in three calls while the machine
#   stays warm (each call keeps what it carried in ~/wh); the call that carries the last joins and
#   installs them. Needs SmolLM2 joined.
# --only-copy: only copy the carried model part(s) to ~/models and stop.
# --cpu-compare: the CPU backend beside llama.cpp's CPU build on the host's cores
#   (scripts/cpu_vs_llamacpp.py): SmolLM2 (when joined) at CPU_SMOL_THREADS (default 2) threads and a
#   Llama-3-8B-shaped Q4_K_M at CPU_8B_THREADS (default: every core; CPU_8B_ROUNDS rounds, default 3) into $OUT/cpu-*.json. llama.cpp
#   is built first (scripts/build_llama_cpp.sh, cached in ~/.cache/ntx) from a carried source
#   tarball, .dev/src/llama.cpp-*-src.tar.xz (build_llama_cpp.sh --pack writes it); numba and
#   llvmlite come as carried wheels (.whl, or .dev/llvm for llvmlite's 60 MB in a call of its own).
# BASELINE=DIR (a copy of another revision's tree, e.g. `git archive REV | tar x -C .baseline`,
#   carried): the decode and stream benchmarks run for that tree too, right after this one's, on
#   the same models in the same call, into $OUT/baseline-*: a before/after on one machine.
#   BASELINE_BENCH_ARGS go to that tree's stream bench only (e.g. "--cpu-layers 0": the figure
#   before the cpu tier existed).
# The real SmolLM2 (98 MB) is over one call's 64 MiB: carry .models/p1 in one call and .models/p2
# in the next (the machine keeps ~/models while warm); once both parts are there they are joined
# and NTX_TEST_MODEL points the GPU tests at it.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/.device_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# whatever happens (a hang killed at the time limit included), bring the daemons' logs back
# (one tarball: a call brings back at most 8 files)
trap 'L=$(mktemp -d); for f in /tmp/ntx-*/logs/*/*; do [ -f "$f" ] && tail -c 20000 "$f" > "$L/$(basename "$(dirname "$f")")-$(basename "$f")"; done 2>/dev/null; tar czf "$OUT/logs.tgz" -C "$L" . 2>/dev/null; true' EXIT
QUICK=""; BENCH=1; TESTS=1; SANITIZE=0; DECODE=0; PROFILE=0; STREAM=0; STATUS_DEMO=0; ONLY_COPY=0; FIRST=0; GEMM=0; MMQ_ROWS=0
FX_VARIANTS_RUN=0; MMQX=0; PRECOMPILE=1
CPU_COMPARE=0; DRAFT_ACC=0; CLUSTER=0; LAB_TESTS=0; PYTEST_ARGS=()
for a in "$@"; do
  case "$a" in
    --quick) QUICK="--quick" ;;
    --no-bench) BENCH=0 ;;
    --no-tests) TESTS=0 ;;
    --sanitize) SANITIZE=1 ;;
    --decode-bench) DECODE=1 ;;
    --profile) PROFILE=1 ;;
    --stream-bench) STREAM=1 ;;
    --status-demo) STATUS_DEMO=1 ;;
    --only-copy) ONLY_COPY=1 ;;
    --first-requests) FIRST=1 ;;
    --gemm-paths) GEMM=1 ;;
    --mmq-rows) MMQ_ROWS=1 ;;
    --fx-variants) FX_VARIANTS_RUN=1 ;;
    --mmqx) MMQX=1 ;;
    --no-precompile) PRECOMPILE=0 ;;
    --lab-tests) LAB_TESTS=1 ;;
    --cpu-compare) CPU_COMPARE=1 ;;
    --draft-acceptance) DRAFT_ACC=1 ;;
    --cluster-bench) CLUSTER=1 ;;
    *) PYTEST_ARGS+=("$a") ;;
  esac
done

MODELS=$HOME/models
mkdir -p "$MODELS"
for part in "$REPO"/.models/p*/smol.part*; do [ -f "$part" ] && cp "$part" "$MODELS/"; done
if [ -f "$MODELS/smol.part00" ] && [ -f "$MODELS/smol.part01" ] && [ ! -f "$MODELS/SmolLM2.gguf" ]; then
  cat "$MODELS/smol.part00" "$MODELS/smol.part01" > "$MODELS/SmolLM2.gguf" && sha256sum "$MODELS/SmolLM2.gguf"
fi
[ -f "$MODELS/SmolLM2.gguf" ] && export NTX_TEST_MODEL="$MODELS/SmolLM2.gguf"
ls -la "$MODELS"
# Ray's wheels, gathered over calls (see --cluster-bench); the ray wheel comes in two parts
mkdir -p "$HOME/wh"
for d in raydeps ray1 ray2; do [ -d "$REPO/.dev/$d" ] && cp "$REPO/.dev/$d"/* "$HOME/wh/"; done
if [ -f "$HOME/wh/raypart00" ] && [ -f "$HOME/wh/raypart01" ]; then
  cat "$HOME/wh/raypart00" "$HOME/wh/raypart01" > "$HOME/wh/$(cat "$HOME/wh/ray-wheel-name")" && rm "$HOME"/wh/raypart0?
fi
[ "$ONLY_COPY" = 1 ] && exit 0

WHEEL_DIRS=("$REPO"/.whl "$REPO"/.dev/llvm)
if [ "$CLUSTER" = 1 ]; then
  ls "$HOME"/wh/ray-*.whl >/dev/null 2>&1 || { echo "--cluster-bench: Ray's wheels are not all here (carry .dev/raydeps, .dev/ray1, .dev/ray2)"; exit 1; }
  WHEEL_DIRS+=("$HOME/wh")
fi
for wheels in "${WHEEL_DIRS[@]}"; do
  if ls "$wheels"/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheels"/*.whl \
      || { echo "wheel install failed"; exit 1; }
  fi
done
# ntx namespace without installing: NSROOT/ntx/{daemons,shared,ctl} -> the tree's folders
farm() {  # farm TREE NSROOT
  rm -rf "$2" && mkdir -p "$2/ntx"
  for f in "$1"/ntx/*; do ln -s "$f" "$2/ntx/"; done
  for d in daemons shared ctl; do [ -d "$1/$d" ] && ln -s "$1/$d" "$2/ntx/$d"; done
}
farm "$REPO" /tmp/nsroot
SITE_PATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONPATH="/tmp/nsroot:$SITE_PATH"
cd /tmp  # not the repo root: its ntx/ would shadow the namespace farm

{
  nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,clocks.max.sm,clocks.mem --format=csv
  python3 -c "import cupy, numpy, sys; print('python', sys.version.split()[0], 'cupy', cupy.__version__, 'cuda runtime', cupy.cuda.runtime.runtimeGetVersion(), 'numpy', numpy.__version__)"
  python3 -c "import gguf; print('gguf', gguf.__file__)"
  python3 -c "import ntx.daemons.compute.cuda.runtime as k; print('ntx kernels from', k.__file__)"
} 2>&1 | tee "$OUT/env.txt"

if [ "$CPU_COMPARE" = 1 ]; then
  src=$(ls "$REPO"/.dev/src/llama.cpp-*-src.tar.xz 2>/dev/null | head -1)
  bash "$REPO/scripts/build_llama_cpp.sh" ${src:+--source "$src"} 2>&1 | tail -5 | tee "$OUT/llama-build.log"
  bench=$(bash "$REPO/scripts/build_llama_cpp.sh" --print-bin)/llama-bench
  lscpu | grep -E "Model name|^CPU\(s\)|Thread|NUMA node\(s\)" | tee "$OUT/cpu.txt"
  if [ -f "$MODELS/SmolLM2.gguf" ]; then
    python3 "$REPO/scripts/cpu_vs_llamacpp.py" --model "$MODELS/SmolLM2.gguf" --threads "${CPU_SMOL_THREADS:-2}" \
      --llama-bench "$bench" --rounds 5 --json "$OUT/cpu-smol.json" 2>&1 | tee "$OUT/cpu-smol.log"
  fi
  [ -f "$MODELS/llama3-8b-Q4_K_M.gguf" ] || python3 "$REPO/scripts/make_gguf.py" "$MODELS/llama3-8b-Q4_K_M.gguf" \
    --preset llama3-8b --type Q4_K_M -q
  python3 "$REPO/scripts/cpu_vs_llamacpp.py" --model "$MODELS/llama3-8b-Q4_K_M.gguf" --threads "${CPU_8B_THREADS:-$(nproc)}" \
    --llama-bench "$bench" --rounds "${CPU_8B_ROUNDS:-3}" --tokens 32 --json "$OUT/cpu-8b.json" 2>&1 | tee "$OUT/cpu-8b.log"
  exit 0
fi

t0=$(date +%s)
[ "$PRECOMPILE" = 1 ] && python3 "$REPO/scripts/bench_kernels.py" --precompile --jobs "$(nproc)" 2>&1 | tee "$OUT/precompile.log"
# pytest puts the repo root (parent of the tests package) first on sys.path, where ntx/ lacks the
# mapped subpackages: import ntx from the farm before pytest starts.
PYTEST=(python3 -c "import sys, ntx.daemons.compute.cuda.runtime, pytest; sys.exit(pytest.main(sys.argv[1:]))")
rc=0
if [ "$SANITIZE" = 1 ] && command -v compute-sanitizer >/dev/null; then
  timeout 240 compute-sanitizer --tool memcheck --print-limit 5 "${PYTEST[@]}" "$REPO/tests/gpu" -q -x -p no:cacheprovider \
    -k "attention or kv_append or graph or rope or i16s" 2>&1 | tail -40 | tee "$OUT/sanitizer.log"
fi
if [ "$TESTS" = 1 ]; then
  "${PYTEST[@]}" "$REPO/tests/gpu" -q -p no:cacheprovider --timeout 600 --junitxml="$OUT/tests.xml" \
    "${PYTEST_ARGS[@]}" 2>&1 | tee "$OUT/tests.log"
  rc=${PIPESTATUS[0]}
fi
if [ "$LAB_TESTS" = 1 ]; then
  "${PYTEST[@]}" "$REPO/dev/cuda" -q -p no:cacheprovider --timeout 600 "${PYTEST_ARGS[@]}" 2>&1 | tee "$OUT/lab-tests.log"
  [ "${PIPESTATUS[0]}" = 0 ] || rc=1
fi
if [ "$BENCH" = 1 ]; then
  python3 "$REPO/scripts/bench_kernels.py" $QUICK --out "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
fi
if [ "$DRAFT_ACC" = 1 ]; then
  if [ -f "$MODELS/SmolLM2.gguf" ]; then
    python3 "$REPO/scripts/draft_acceptance.py" --model "$MODELS/SmolLM2.gguf" --backend cuda \
      --draft-tokens "${DRAFT_TOKENS:-8}" --drafters ${DRAFT_DRAFTERS:-ngram:1 ngram:auto suffix:auto ngram:1:fixed} --json "$OUT/draft-acceptance-smollm2-cuda.json" 2>&1 \
      | tee "$OUT/draft-acceptance-smollm2-cuda.log"
  else
    echo "--draft-acceptance: SmolLM2 is not joined (carry .models/p1, then .models/p2)" | tee "$OUT/draft-acceptance-smollm2-cuda.log"
  fi
fi
if [ "$CLUSTER" = 1 ]; then
  read -r -a CLUSTER_ARGV <<< "${CLUSTER_ARGS:---replicas 1,2 --concurrency 16 --concurrency-per-replica 16 --requests 256 --max-tokens 32 --light-requests 40}"
  NTX_CPU_THREADS=${NTX_CPU_THREADS:-4} PATH="/tmp/site/bin:$PATH" python3 "$REPO/scripts/bench_cluster.py" \
    --model "$MODELS/SmolLM2.gguf" --instance-args "--max-batch 16" "${CLUSTER_ARGV[@]}" --out "$OUT/bench-cluster.json" 2>&1 \
    | tee "$OUT/bench-cluster.log"
fi
if [ "$GEMM" = 1 ]; then  # GEMM_ARGS (e.g. "--types Q4_K --ts 1,8,32 --paths mm,mmq") go to it as they are
  read -r -a GEMM_ARGV <<< "${GEMM_ARGS:-}"
  python3 "$REPO/dev/cuda/bench_gemm_paths.py" ${GEMM_ARGV[@]+"${GEMM_ARGV[@]}"} --out "$OUT/gemm_paths.json" 2>&1 | tee "$OUT/gemm_paths.log"
fi
if [ "$MMQX" = 1 ]; then
  read -r -a MMQX_ARGV <<< "${MMQX_ARGS:-}"
  python3 "$REPO/dev/cuda/bench_mmqx.py" ${MMQX_ARGV[@]+"${MMQX_ARGV[@]}"} --out "$OUT/mmqx.json" 2>&1 | tee "$OUT/mmqx.log"
fi
if [ "$FX_VARIANTS_RUN" = 1 ]; then
  FXV_NAMES=()
  for nv in ${FX_VARIANTS:-}; do  # NAME=DIR, DIR relative to the repo root or absolute
    d=$(cd "$REPO" && cd "${nv#*=}" && pwd) || { echo "--fx-variants: no folder ${nv#*=}" | tee "$OUT/fx_variants.log"; exit 2; }
    FXV_NAMES+=("${nv%%=*}=$d")
  done
  [ -n "${BASELINE:-}" ] && FXV_NAMES+=("base=$(cd "$REPO" && cd "$BASELINE" && pwd)/daemons/compute/cuda")
  read -r -a FXV_ARGV <<< "${FX_VARIANTS_ARGS:-}"
  if [ "${#FXV_NAMES[@]}" = 0 ]; then
    echo "--fx-variants: no variant (set BASELINE to another tree, or FX_VARIANTS to NAME=DIR ...)" | tee "$OUT/fx_variants.log"
  else
    python3 "$REPO/dev/cuda/bench_fx_variants.py" "${FXV_NAMES[@]}" ${FXV_ARGV[@]+"${FXV_ARGV[@]}"} \
      --out "$OUT/fx_variants.json" 2>&1 | tee "$OUT/fx_variants.log"
  fi
fi
if [ "$MMQ_ROWS" = 1 ]; then
  read -r -a MMQ_ROWS_ARGV <<< "${MMQ_ROWS_ARGS:-}"
  python3 "$REPO/dev/cuda/bench_mmq_rows.py" ${MMQ_ROWS_ARGV[@]+"${MMQ_ROWS_ARGV[@]}"} --out "$OUT/mmq_rows.json" 2>&1 \
    | tee "$OUT/mmq_rows.log"
fi
synth() {  # synth NAME PRESET TYPE [make_gguf args]: write ~/models/NAME.gguf once
  # under a temporary name, renamed once whole: a call stopped at its time limit mid-write (the
  # 70B takes minutes) leaves no truncated model for the next call to take as written
  [ -f "$MODELS/$1.gguf" ] && return 0
  python3 "$REPO/scripts/make_gguf.py" "$MODELS/.part-$1.gguf" --preset "$2" --type "$3" "${@:4}" -q 2>&1 | tail -2
  [ "${PIPESTATUS[0]}" = 0 ] && mv "$MODELS/.part-$1.gguf" "$MODELS/$1.gguf"
}
# the 70B shape trained for 32768 positions (Llama 3.1's reach, capped at --ctx's default cap): the
# default flags' context, and the one long sequence of the bench's ctx scenario
synth70() { synth llama3-70b-Q4_K_M llama3-70b Q4_K_M --context 32768; }
decode_bench() {  # decode_bench TREE OUTPREFIX
  python3 "$1/scripts/bench_decode.py" ${NTX_TEST_MODEL:+"$NTX_TEST_MODEL"} ${DECODE_MODELS[@]} \
    --tokens 128 --batch ${DECODE_BATCH:-1 8} ${DECODE_ARGS:-} --out "$2decode.json" 2>&1 | tee "$2decode.log"
}
stream_bench() {  # stream_bench OUTDIR [more bench args]
  mkdir -p "$1"
  python3 -m ntx.ctl.cli bench --model "$MODELS/llama3-70b-Q4_K_M.gguf" --backend cuda --vram-budget 24GiB \
    --tokens "${STREAM_TOKENS:-4}" --batch "${STREAM_BATCH:-1}" --scenarios "${STREAM_SCENARIOS:-a,c,b,check,d}" \
    --resident-model "$MODELS/llama3-8b-Q4_K_M.gguf" --out "$1" "${@:2}" 2>&1 | tee "$1/stream.log"
}
if [ "$DECODE" = 1 ]; then
  DECODE_MODELS=()
  for t in ${DECODE_TYPES-Q4_K_M Q8_0 F16}; do synth "llama3-8b-$t" llama3-8b "$t"; DECODE_MODELS+=("$MODELS/llama3-8b-$t.gguf"); done
  if [ "${DECODE_QWEN2:-0}" = 1 ]; then  # Qwen2.5-1.5B's shape, and the same shape as a Llama: what Qwen2's biases and pairs cost
    synth qwen2.5-1.5b-Q4_K_M qwen2.5-1.5b Q4_K_M
    synth qwen2.5-1.5b-as-llama-Q4_K_M qwen2.5-1.5b Q4_K_M --arch llama
    DECODE_MODELS+=("$MODELS/qwen2.5-1.5b-Q4_K_M.gguf" "$MODELS/qwen2.5-1.5b-as-llama-Q4_K_M.gguf")
  fi
  decode_bench "$REPO" "$OUT/"
fi
if [ "$PROFILE" = 1 ]; then
  synth "llama3-8b-${PROFILE_TYPE:-Q4_K_M}" llama3-8b "${PROFILE_TYPE:-Q4_K_M}"
  python3 "$REPO/scripts/profile_pass.py" "$MODELS/llama3-8b-${PROFILE_TYPE:-Q4_K_M}.gguf" --batch ${PROFILE_BATCH:-1 8} --prompt 512 \
    ${PROFILE_ARGS:-} --out "$OUT/profile.json" 2>&1 | tee "$OUT/profile.txt"
fi
if [ "$STREAM" = 1 ]; then
  rm -f "$MODELS"/llama3-8b-{Q8_0,F16}.gguf  # the disk holds 64 GB: make room for the 42 GB 70B
  synth llama3-8b-Q4_K_M llama3-8b Q4_K_M; synth70
  SPEC_BENCH_ARGS=()
  read -r -a SPEC_BENCH_ARGS <<< "${BENCH_ARGS:-${SPEC_ARGS:-}}"  # SPEC_ARGS: its older name
  case ",${STREAM_SCENARIOS:-a,c,b,check,d}," in *,spec,*)
    if [ "${DRAFT_MODEL:-0}" = 1 ]; then
      synth llama3-1b-Q4_K_M llama3-1b Q4_K_M
      SPEC_BENCH_ARGS+=(--draft-model "$MODELS/llama3-1b-Q4_K_M.gguf")
    fi ;;
  esac
  # written data still being flushed would slow (and skew) the O_DIRECT reads that (b) measures
  case "${STREAM_SCENARIOS:-a,c,b,check,d}" in *b*) sync ;; esac
  df -h "$MODELS" | tail -1
  stream_bench "${STREAM_OUT:-$OUT}" ${SPEC_BENCH_ARGS[@]+"${SPEC_BENCH_ARGS[@]}"}
fi
if [ -n "${BASELINE:-}" ] && [ "$((DECODE + STREAM))" -gt 0 ]; then
  BASE=$(cd "$REPO" && cd "$BASELINE" && pwd)
  farm "$BASE" /tmp/nsbase
  echo "== baseline tree $BASE"
  ( export PYTHONPATH="/tmp/nsbase:$SITE_PATH"
    [ "$DECODE" = 1 ] && decode_bench "$BASE" "$OUT/baseline-"
    read -r -a BASE_BENCH_ARGS <<< "${BASELINE_BENCH_ARGS:-}"
    [ "$STREAM" = 1 ] && stream_bench "${STREAM_OUT:-$OUT}/baseline" ${BASE_BENCH_ARGS[@]+"${BASE_BENCH_ARGS[@]}"} )
fi
if [ "$FIRST" = 1 ]; then
  rm -f "$MODELS"/llama3-8b-{Q8_0,F16}.gguf  # room for the 42 GB 70B
  synth70
  python3 "$REPO/scripts/bench_first_requests.py" "$MODELS/llama3-70b-Q4_K_M.gguf" --vram-budget 24GiB \
    --out "$OUT/first_requests.json" 2>&1 | tee "$OUT/first_requests.log"
fi
if [ "$STATUS_DEMO" = 1 ]; then
  synth70
  CTL=(python3 -m ntx.ctl.cli)
  L=tcp://127.0.0.1:5597
  # (a)'s setting: one sequence of up to 512 positions, so the KV cache takes little of the 24 GiB
  "${CTL[@]}" start --model "$MODELS/llama3-70b-Q4_K_M.gguf" --name demo --backend cuda --vram-budget 24GiB --listen $L \
    --max-batch 1 --ctx 512 2>&1 | tail -8
  "${CTL[@]}" generate --listen $L --raw --temperature 0 -n 40 "The history of the transistor begins" > "$OUT/status-a-gen.txt" 2>&1 &
  gen=$!
  sleep 10
  COLUMNS=160 "${CTL[@]}" status --name demo > "$OUT/status-a.txt" 2>&1
  "${CTL[@]}" status --name demo --json > "$OUT/status-a.json" 2>&1
  cat "$OUT/status-a.txt"
  wait $gen
  "${CTL[@]}" stop --name demo 2>&1 | tail -2
fi
echo "device_check: tests rc=$rc, $(( $(date +%s) - t0 )) s"
exit $rc
