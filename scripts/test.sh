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
# One pytest worker more than there are cores, a test file each at a time (its module fixtures
# stay whole): a worker's test waits on a server, ssh, pip's downloads or a rank's rendezvous
# for a sixth of its time, and the extra worker keeps the cores busy then. At most one per
# 6 GiB of memory (an 8-rank TensorFlow job holds about 5). HVDGEN_TEST_WORKERS sets the count.
# Files go out in tests/conftest.py's order, longest first (xdist would otherwise send the files
# with the most tests first, and the few long ones would run last, one worker alone).
cores="$(nproc)"
memory_gib="$(( $(awk '/^MemTotal:/ {print $2}' /proc/meminfo) / 1048576 ))"
workers="$(( cores + 1 ))"
[ "$workers" -gt "$(( memory_gib / 6 ))" ] && workers="$(( memory_gib / 6 ))"
[ "$workers" -lt 1 ] && workers=1
workers="${HVDGEN_TEST_WORKERS:-$workers}"
set +e
python -m pytest -n "$workers" --dist loadfile --no-loadscope-reorder "$@"
status=$?
set -e
step "tests done (pytest exit $status)"
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
