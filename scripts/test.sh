#!/usr/bin/env bash
# The whole test suite, set-up included: frameworks, Horovod build (cached), then pytest —
# generator and runtime tests, real horovodrun jobs, generated projects trained end to end.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Both frameworks: the suite generates and trains TensorFlow projects too.
export HVDGEN_FRAMEWORKS="${HVDGEN_FRAMEWORKS:-torch tensorflow}"
source "$ROOT/scripts/setup.sh"

cd "$ROOT"
step "running the test suite"
set +e
python -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
