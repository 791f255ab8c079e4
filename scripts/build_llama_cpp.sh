#!/usr/bin/env bash
# Build llama.cpp's benchmark tools from the source vendored in llama-cpp-python 0.3.36, the
# reference every side-by-side figure in docs/PERFORMANCE.md is measured against
# (scripts/cpu_vs_llamacpp.py runs the CPU build's llama-bench).
#
# Only the C/C++ tools are built (llama-bench, llama-batched-bench, llama-perplexity,
# llama-simple), never the Python package: cmake, Release, the host's native CPU flags, static
# libraries. llama-cli is left out: it needs the server and its web UI.
#
#   scripts/build_llama_cpp.sh                      # CPU build; the sdist from PyPI (pip download)
#   scripts/build_llama_cpp.sh --source SRC          # SRC: the sdist (.tar.gz), an extracted sdist,
#                                                    # a llama.cpp source folder, or --pack's tarball
#   scripts/build_llama_cpp.sh --cuda                # CUDA build (-DGGML_CUDA=ON, sm_90), beside the CPU one
#   scripts/build_llama_cpp.sh --pack OUT.tar.xz     # also write the trimmed source (5.8 MB) to
#                                                    # carry to a machine without a package registry
#   scripts/build_llama_cpp.sh --print-bin           # the folder the binaries go to, nothing built
#
# Where things go: $NTX_CACHE_DIR, else $XDG_CACHE_HOME/ntx, else ~/.cache/ntx (the models'
# cache, ntx.ctl.models.cache_dir), under llama.cpp-0.3.36/: src/ (the vendored llama.cpp
# without its vocab files, docs, tests and benchmarks results), build-cpu/bin/ and
# build-cuda/bin/. A build whose stamp (source, flags) matches is skipped, so running this again
# costs nothing; --force builds again.
#
# Sizes: the sdist is 77 MB (a git pack, vocab GGUFs and operator tables make most of it); the
# source kept under src/ is 47 MB unpacked and 5.8 MB as --pack's tar.xz. The CPU build took
# 12.5 minutes on a 2-core machine that other work shared (the build folder: 94 MB).
set -euo pipefail

VERSION=0.3.36
ARCH=90
source_arg=""
cuda=0
force=0
pack_out=""
print_bin=0
jobs=$(nproc 2>/dev/null || echo 2)

usage() { sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "build_llama_cpp.sh: $*" >&2; exit 1; }

while [ $# -gt 0 ]; do
    case "$1" in
        --source) [ $# -ge 2 ] || die "--source needs a path (the sdist, its folder or a llama.cpp folder)"; source_arg=$2; shift 2 ;;
        --source=*) source_arg=${1#--source=}; shift ;;
        --cuda) cuda=1; shift ;;
        --cuda-arch) [ $# -ge 2 ] || die "--cuda-arch needs a value, e.g. 90"; ARCH=$2; shift 2 ;;
        --pack) [ $# -ge 2 ] || die "--pack needs an output path, e.g. llama.cpp-$VERSION-src.tar.xz"; pack_out=$2; shift 2 ;;
        --force) force=1; shift ;;
        --jobs|-j) [ $# -ge 2 ] || die "--jobs needs a number"; jobs=$2; shift 2 ;;
        --print-bin) print_bin=1; shift ;;
        -h|--help) usage; exit 0 ;;
        *) die "unknown argument '$1' (see --help)" ;;
    esac
done

if [ -n "${NTX_CACHE_DIR:-}" ]; then cache=$NTX_CACHE_DIR
elif [ -n "${XDG_CACHE_HOME:-}" ]; then cache=$XDG_CACHE_HOME/ntx
else cache=$HOME/.cache/ntx
fi
root=$cache/llama.cpp-$VERSION
src=$root/src
if [ "$cuda" = 1 ]; then flavour=cuda; else flavour=cpu; fi
build=$root/build-$flavour
if [ "$print_bin" = 1 ]; then echo "$build/bin"; exit 0; fi

# Paths of the vendored tree a tools-only build never reads (the biggest: vocab GGUFs, the
# operator tables under docs/, the web UI).
EXCLUDES=(.git .github .devops docs models benches media tests gguf-py tools/ui)

# The vendored llama.cpp out of SRC (tarball or folder, sdist or llama.cpp itself) into $src.
extract_source() {
    local from=$1 tmp
    tmp=$(mktemp -d "$root/.src-XXXXXX")
    local ex=()
    for e in "${EXCLUDES[@]}"; do ex+=(--exclude="*/vendor/llama.cpp/$e" --exclude="llama.cpp/$e"); done
    if [ -f "$from" ]; then
        echo "== extracting llama.cpp from $from ($(du -h "$from" | cut -f1))"
        mkdir "$tmp/x"
        tar -xf "$from" -C "$tmp/x" --exclude-vcs "${ex[@]}" || die "cannot extract $from (a .tar.gz/.tar.xz of the sdist or of llama.cpp is needed)"
        from=$tmp/x
        # the one top-level folder of the tarball
        if [ "$(ls -A "$from" | wc -l)" = 1 ] && [ -d "$from/$(ls -A "$from")" ]; then from=$from/$(ls -A "$from"); fi
    fi
    [ -d "$from" ] || die "--source $from: no such file or folder"
    if [ -f "$from/vendor/llama.cpp/CMakeLists.txt" ]; then from=$from/vendor/llama.cpp; fi
    [ -f "$from/CMakeLists.txt" ] && [ -d "$from/ggml" ] && [ -d "$from/tools/llama-bench" ] \
        || die "$from is neither llama-cpp-python's sdist nor a llama.cpp source folder (no CMakeLists.txt, ggml/, tools/llama-bench/)"
    echo "== copying the llama.cpp source into $src"
    mkdir "$tmp/src"
    local rs=()
    for e in "${EXCLUDES[@]}"; do rs+=(--exclude="/$e"); done
    if command -v rsync >/dev/null; then
        rsync -a "${rs[@]}" "$from/" "$tmp/src/"
    else
        (cd "$from" && tar -cf - --exclude-vcs "${EXCLUDES[@]/#/--exclude=./}" .) | tar -xf - -C "$tmp/src"
    fi
    rm -rf "$src"
    mv "$tmp/src" "$src"
    rm -rf "$tmp"
}

mkdir -p "$root"
if [ -n "$source_arg" ]; then
    if [ ! -f "$src/CMakeLists.txt" ] || [ "$force" = 1 ]; then extract_source "$source_arg"; fi
elif [ ! -f "$src/CMakeLists.txt" ]; then
    py=${PYTHON:-python3}
    dl=$(mktemp -d "$root/.dl-XXXXXX")
    echo "== downloading the llama-cpp-python==$VERSION sdist (77 MB) with pip"
    "$py" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$dl" \
        || die "pip could not download llama-cpp-python==$VERSION; on a machine without a registry pass --source (the sdist or --pack's tarball)"
    extract_source "$dl/llama_cpp_python-$VERSION.tar.gz"
    rm -rf "$dl"
fi
echo "== source: $src ($(du -sh "$src" | cut -f1))"

if [ -n "$pack_out" ]; then
    pack_out=$(realpath -m "$pack_out")
    mkdir -p "$(dirname "$pack_out")"
    echo "== packing the source into $pack_out"
    tar -C "$root" -cJf "$pack_out" --transform "s,^src,llama.cpp-$VERSION," src
    echo "== $pack_out: $(du -h "$pack_out" | cut -f1) (carry it, then: $0 --source $(basename "$pack_out") [--cuda])"
fi

command -v cmake >/dev/null || die "cmake is not installed (apt-get install cmake, or pip install cmake)"
targets=(llama-bench llama-batched-bench llama-perplexity llama-simple)
flags=(-DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF
       -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF)
if [ "$cuda" = 1 ]; then
    command -v nvcc >/dev/null || [ -n "${CUDACXX:-}" ] \
        || die "--cuda needs nvcc on PATH (or CUDACXX=/path/to/nvcc)"
    flags+=(-DGGML_CUDA=ON "-DCMAKE_CUDA_ARCHITECTURES=$ARCH")
fi
stamp="$VERSION ${flags[*]} ${targets[*]} $(stat -c %Y "$src/CMakeLists.txt")"
if [ "$force" = 0 ] && [ -f "$build/ntx-stamp" ] && [ "$(cat "$build/ntx-stamp")" = "$stamp" ]; then
    missing=0
    for t in "${targets[@]}"; do [ -x "$build/bin/$t" ] || missing=1; done
    if [ "$missing" = 0 ]; then
        echo "== already built: $build/bin (llama-bench and co; --force builds again)"
        exit 0
    fi
fi

generator=()
if command -v ninja >/dev/null; then generator=(-G Ninja); fi
rm -f "$build/ntx-stamp"
echo "== configuring ($flavour): cmake ${flags[*]}"
cmake -S "$src" -B "$build" "${generator[@]}" "${flags[@]}" >"$build.configure.log" 2>&1 \
    || { tail -30 "$build.configure.log" >&2; die "cmake configure failed (whole log: $build.configure.log)"; }
echo "== building ${targets[*]} with $jobs jobs (minutes on 2 cores; CUDA builds take much longer)"
start=$(date +%s)
cmake --build "$build" --target "${targets[@]}" -j "$jobs"
echo "$stamp" >"$build/ntx-stamp"
echo "== built in $(( $(date +%s) - start )) s: $build/bin"
ls -la "${targets[@]/#/$build/bin/}"
