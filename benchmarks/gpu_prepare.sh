#!/usr/bin/env bash
# Prepares, on this machine, everything benchmarks/gpu_device.sh needs on a lent GPU machine, which has
# no network: the wheels of what its image lacks and SciFact (../shared/device/wheels.sh, into .whl/ and
# .dkdata/), then the suite's own inputs in .dkdata/gpu_suite/ (all-MiniLM-L6-v2's tokenizer and config,
# SciFact's training queries with BM25 negatives, a sample of wiki1m's passages: benchmarks/gpu_inputs.py),
# and checks that what a device call carries fits its 64 MiB. Run once, from the repository root:
#   bash benchmarks/gpu_prepare.sh            # PYTHON=... to name another interpreter than .venv's
# Both folders are git-ignored; the device call names them in `carry`.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
python=${PYTHON:-.venv/bin/python}
shared=$(readlink -f "${SHARED:-../shared}")
if [ -d .git ]; then
  bash "$shared/device/wheels.sh"
else
  # a git worktree, whose .git is a file: wheels.sh's note in .git/info/exclude cannot be written there
  # (.gitignore ignores both folders anyway), so it runs in a scratch repository and its folders move here
  scratch=$(mktemp -d)
  git -C "$scratch" init -q
  (cd "$scratch" && bash "$shared/device/wheels.sh")
  rm -rf .whl .dkdata
  mv "$scratch/.whl" "$scratch/.dkdata" .
  rm -rf "$scratch"
fi
PYTHONPATH="$PWD/src:$PWD" "$python" -m benchmarks.gpu_inputs --shared "$shared/data" --out .dkdata/gpu_suite
# what travels: the tracked files, the untracked ones git does not ignore, and the carried folders
tree=$( (git ls-files -z; git ls-files -z --others --exclude-standard) | xargs -0 stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
carried=$(du -sb .whl .dkdata | awk '{s += $1} END {print s}')
total=$((tree + carried))
echo "travels: $((total / 1048576)) MiB (tree $((tree / 1048576)), .whl and .dkdata $((carried / 1048576))) of 64"
[ "$total" -le $((64 * 1048576)) ] || { echo "over the 64 MiB a device call carries" >&2; exit 1; }
