#!/usr/bin/env bash
# Set up everything hvdgen needs on a fresh machine, idempotently: a virtualenv in .venv, the
# frameworks, hvdgen itself, and Horovod built once for those frameworks (cached in
# ~/.cache/hvdgen, so a second run takes seconds). Sourced by demo.sh and test.sh, which share
# the one build: both frameworks by default.
#
#   PYTHON=python3.12 ./scripts/demo.sh      # another interpreter (3.10-3.13)
#   HVDGEN_FRAMEWORKS=torch ./scripts/demo.sh   # torch only: a smaller set-up, its own Horovod build
#   TORCH_SPEC=torch==2.13.0 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 ./scripts/demo.sh
#
# torch comes from pip's default source: where pip finds a CPU wheel it takes it, else the
# index's default build (CUDA on Linux). TORCH_INDEX_URL picks a build explicitly (PyTorch's
# cpu or cuXXX index); `hvdgen install-horovod` then builds Horovod for it (NCCL with CUDA).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVDGEN_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
FRAMEWORKS="${HVDGEN_FRAMEWORKS:-torch tensorflow}"
# The versions generated projects pin (hvdgen/catalog.py FRAMEWORK_PINS; a test keeps them equal).
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TF_SPEC="${TF_SPEC:-tensorflow==2.21.0}"
TORCH_INDEX_URL="${TORCH_INDEX_URL:-}"

SETUP_STARTED=$SECONDS
step() { printf '\n==> [%4ds] %s\n' "$((SECONDS - SETUP_STARTED))" "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  if ! version="$("$PYTHON" --version 2>/dev/null)"; then
    echo "PYTHON=$PYTHON does not run here (not installed, or a pyenv shim of a version not enabled): set PYTHON to an interpreter that runs, e.g. PYTHON=\$(pyenv prefix 3.12)/bin/python" >&2
    exit 1
  fi
  step "creating virtualenv $VENV ($version)"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

step "installing frameworks ($FRAMEWORKS) and hvdgen"
python -m pip install --quiet --upgrade pip
specs=("$TORCH_SPEC")
extras="torch,build,test"
if [[ " $FRAMEWORKS " == *" tensorflow "* ]]; then
  specs+=("$TF_SPEC")
  extras="$extras,tensorflow"
fi
index_args=()
[ -n "$TORCH_INDEX_URL" ] && index_args=(--extra-index-url "$TORCH_INDEX_URL")
# One resolver run for everything: frameworks, hvdgen and its extras download side by side.
python -m pip install --quiet "${index_args[@]}" "${specs[@]}" -e "$ROOT[$extras]"

step "building and installing Horovod (cached after the first run)"
hvdgen install-horovod
hvdgen doctor
step "set-up done"
