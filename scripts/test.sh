#!/usr/bin/env bash
# The whole test suite, set-up included: frameworks, Horovod build (cached), then pytest —
# generator and runtime tests, real horovodrun jobs, generated projects trained end to end.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Both frameworks, whatever the caller's environment says: the suite trains TensorFlow projects
# too, and a Horovod without TensorFlow would only make those tests skip.
export HVDGEN_FRAMEWORKS="torch tensorflow"
export HVDGEN_FOR_TESTS=1     # and the tools only tests use (tmux)
source "$ROOT/scripts/setup.sh"

step "checking that Horovod was built for both frameworks"
build="$(horovodrun --check-build 2>/dev/null)"
for framework in PyTorch TensorFlow; do
  if ! grep -Eq "\[X\] $framework" <<<"$build"; then
    echo "Horovod was built without $framework: rerun with a fresh cache (hvdgen install-horovod --force)" >&2
    exit 1
  fi
done

cd "$ROOT"
step "running the test suite"
# Two pytest workers, a test file each at a time (its module fixtures stay whole): one worker
# alone leaves a core idle whenever a test waits on pip, a server or a single-threaded build.
# Files go out in tests/conftest.py's order, longest first (xdist would otherwise send the files
# with the most tests first, and the few long ones would run last, one worker alone).
set +e
python -m pytest -n 2 --dist loadfile --no-loadscope-reorder "$@"
status=$?
set -e
step "tests done (pytest exit $status)"
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
