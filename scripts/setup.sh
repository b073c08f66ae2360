#!/usr/bin/env bash
# Set up everything hvdgen needs on a fresh machine, idempotently: OpenMPI and OpenSSH (where this
# user may apt-get them), a virtualenv in .venv, the frameworks, hvdgen itself, and Horovod built
# once for those frameworks (cached in ~/.cache/hvdgen, so a second run takes seconds). Sourced by
# demo.sh and test.sh, which share the one build: both frameworks by default.
#
#   PYTHON=python3.12 ./scripts/demo.sh      # another interpreter (3.10-3.13)
#   HVDGEN_FRAMEWORKS=torch ./scripts/demo.sh   # torch only: a smaller set-up, its own Horovod build
#   TORCH_SPEC=torch==2.13.0 TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 ./scripts/demo.sh
#   HVDGEN_SYSTEM_PACKAGES=0 ./scripts/demo.sh   # never apt-get: Horovod then has MPI only if it is there
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

# OpenMPI gives Horovod its MPI controller (install-horovod builds it in when mpicxx is on PATH;
# the MPI Operator's images run OpenMPI) and OpenSSH is how horovodrun reaches other hosts. They
# come from apt, in the background while pip downloads the frameworks; without root or apt-get a
# note says what to install, and Horovod builds with Gloo alone. The test suite (HVDGEN_FOR_TESTS=1,
# set by test.sh) also drives `hvdgen new`'s questions in a real terminal: tmux; and submits the
# generated Slurm scripts to a Slurm cluster it starts itself: slurmctld, slurmd and munge.
SYSTEM_PACKAGES_PID=""
missing_system_packages() {
  local -A provides=([mpicxx]=libopenmpi-dev [mpirun]=openmpi-bin [sshd]=openssh-server [ssh]=openssh-client
                     [tmux]=tmux [slurmctld]=slurmctld [slurmd]=slurmd [sbatch]=slurm-client [munged]=munge)
  local tool tools=(mpicxx mpirun sshd ssh)
  [ "${HVDGEN_FOR_TESTS:-0}" = 1 ] && tools+=(tmux slurmctld slurmd sbatch munged)
  for tool in "${tools[@]}"; do
    command -v "$tool" >/dev/null || [ -x "/usr/sbin/$tool" ] || printf '%s ' "${provides[$tool]}"
  done
}
system_packages="$(missing_system_packages)"
if [ -n "$system_packages" ] && [ "${HVDGEN_SYSTEM_PACKAGES:-1}" != 0 ]; then
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null; then
    step "installing ${system_packages% } with apt-get (in the background)"
    SYSTEM_PACKAGES_LOG="$(mktemp -t hvdgen-apt.XXXXXX)"
    # shellcheck disable=SC2086  # one word per package
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
       $system_packages) >"$SYSTEM_PACKAGES_LOG" 2>&1 &
    SYSTEM_PACKAGES_PID=$!
  else
    echo "note: ${system_packages% } missing and this user cannot apt-get them: Horovod builds without MPI" \
         "and multi-host runs need ssh; install them (Debian/Ubuntu: sudo apt-get install ${system_packages% })" \
         "and rerun, or set HVDGEN_SYSTEM_PACKAGES=0 to silence this" >&2
  fi
fi

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

if [ -n "$SYSTEM_PACKAGES_PID" ]; then
  step "waiting for apt-get (${system_packages% })"
  if wait "$SYSTEM_PACKAGES_PID"; then
    rm -f "$SYSTEM_PACKAGES_LOG"
  else
    tail -5 "$SYSTEM_PACKAGES_LOG" >&2
    echo "note: apt-get could not install ${system_packages% } (log: $SYSTEM_PACKAGES_LOG): Horovod builds" \
         "without MPI and the ssh tests skip; fix apt and rerun" >&2
  fi
fi
# root's sshd wants its privilege-separation directory, which systemd makes on a booted machine
# (RuntimeDirectory=sshd) but nothing makes in a container.
if [ "$(id -u)" -eq 0 ] && [ -x /usr/sbin/sshd ] && [ ! -d /run/sshd ]; then
  install -d -m 0755 /run/sshd
fi

step "building and installing Horovod (cached after the first run)"
hvdgen install-horovod
hvdgen doctor
step "set-up done"
