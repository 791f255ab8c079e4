#!/usr/bin/env bash
# Ray Serve's wheels for the GPU machine (Python 3.12, no registry), in three folders that each fit
# one device call's carry (64 MiB with the tree): .dev/raydeps (its dependencies and the gateway's,
# less numpy, which the machine has), .dev/ray1 and .dev/ray2 (the ray wheel, about 80 MB, cut in
# two; ray-wheel-name says what to call it once joined). scripts/device_check.sh --cluster-bench
# joins and installs them. .dev/ is ignored by git (add /.dev/ to .git/info/exclude if it is not).
#   usage: scripts/prepare_ray_wheels.sh [RAY_VERSION]   (default: the version installed here)
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
version=${1:-$(python3 -c "import ray; print(ray.__version__)" 2>/dev/null || true)}
[ -n "$version" ] || { echo "prepare_ray_wheels.sh: no ray here to take the version from: give it (e.g. 2.60.0)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$tmp" \
  "ray[serve]==$version" "starlette>=0.37" "uvicorn>=0.29" "prometheus_client>=0.20" httpx
rm -f "$tmp"/numpy-*.whl
rm -rf .dev/raydeps .dev/ray1 .dev/ray2 && mkdir -p .dev/raydeps .dev/ray1 .dev/ray2
wheel=$(basename "$(ls "$tmp"/ray-"$version"-*.whl)")
mv "$tmp/$wheel" "$tmp/ray.wheel"
mv "$tmp"/*.whl .dev/raydeps/
split -b 40000000 -d "$tmp/ray.wheel" "$tmp/raypart"
mv "$tmp/raypart00" .dev/ray1/ && mv "$tmp/raypart01" .dev/ray2/
echo "$wheel" > .dev/ray1/ray-wheel-name
du -sh .dev/raydeps .dev/ray1 .dev/ray2
