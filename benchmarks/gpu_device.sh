#!/usr/bin/env bash
# The one command of a lent GPU machine (prepared here first by benchmarks/gpu_prepare.sh; the device
# call carries .whl and .dkdata): installs the carried wheels where its image lacks them, then runs the
# whole GPU suite, writing gpu_suite.json and its log under $OUT (runs/benchmarks without one). Extra
# arguments go to the suite (e.g. --parts encode,exact_search).
#   bash benchmarks/gpu_device.sh
set -uo pipefail
site=${SITE:-/tmp/site}  # where the wheels go (another folder to try the script on this machine)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl \
  || { echo "the carried wheels did not install: run benchmarks/gpu_prepare.sh and carry .whl" >&2; exit 3; }
export PYTHONPATH="$site:$PWD/src:$PWD" HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
out=${OUT:-runs/benchmarks}
mkdir -p "$out"
python3 -m benchmarks.gpu_suite --device cuda --output "$out/gpu_suite.json" "$@" 2>&1 | tee "$out/gpu_suite.log"
