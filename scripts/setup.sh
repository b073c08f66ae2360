#!/usr/bin/env bash
# Set up everything hvdgen needs on a fresh machine, idempotently: a virtualenv in .venv,
# the frameworks, hvdgen itself, and Horovod built for those frameworks (cached in
# ~/.cache/hvdgen, so a second run takes seconds). Sourced by demo.sh and test.sh.
#
# HVDGEN_FRAMEWORKS picks the frameworks: "torch" (the default) or "torch tensorflow".
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${HVDGEN_VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3}"
FRAMEWORKS="${HVDGEN_FRAMEWORKS:-torch}"
# torch 2.13.0's CPU build; override TORCH_SPEC for another build (e.g. a CUDA one on GPU machines).
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TF_SPEC="${TF_SPEC:-tensorflow==2.21.0}"

step() { printf '\n==> %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  step "creating virtualenv $VENV"
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"

step "installing frameworks ($FRAMEWORKS) and hvdgen"
python -m pip install --quiet --upgrade pip
python -m pip install --quiet "$TORCH_SPEC"
extras="torch,build,test"
if [[ " $FRAMEWORKS " == *" tensorflow "* ]]; then
  python -m pip install --quiet "$TF_SPEC"
  extras="$extras,tensorflow"
fi
python -m pip install --quiet -e "$ROOT[$extras]"

step "building and installing Horovod (cached after the first run)"
hvdgen install-horovod
hvdgen doctor
