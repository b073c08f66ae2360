"""The launcher's horovodrun command line.

horovodrun does not read the hostfile the operator mounts unless it is told to: without `--hostfile`
(or a discovery script) it runs every rank on the launcher pod itself. Elastic jobs instead ask the
operator's `discover_hosts.sh`, which lists the worker pods that are running right now. That
script names hosts without slot counts (`echo job-worker-0.job-worker.default.svc`), so the
launcher gives `--slots-per-host`; without it Horovod has no slots for any host. And Horovod
blacklists a host whose rank failed, for good unless a cooldown is given: a worker pod that
restarts comes back under the same name, so `--blacklist-cooldown-range` lets it rejoin (after
20-30 s the first time, doubling up to 5 minutes for a host that keeps failing).

Before any rank starts, horovodrun runs a small probe on every host over ssh to find the network
interfaces they share, and gives up when the probes have not all answered within `--start-timeout`.
Its default, 30 s, is shorter than a Python start on a node whose cores are busy (a pod's
neighbours, or the ranks of a job still winding down), so the launcher allows 2 minutes: a host
that is really unreachable still fails the job, later.

The controller is named (`--gloo` or `--mpi`) rather than left to horovodrun, which picks MPI
whenever the image has OpenMPI and its Horovod was built with it: the job then runs the same on
every image. MPI goes through the operator's own set-up (`mpirun` reads the OMPI_MCA_* variables
it sets on the launcher and reaches the workers over the same ssh); elastic jobs are Gloo only.
"""

from __future__ import annotations

HOSTFILE = "/etc/mpi/hostfile"
DISCOVER_HOSTS = "/etc/mpi/discover_hosts.sh"
TRAIN = ("python", "train.py")
START_TIMEOUT_S = 120  # horovodrun's --start-timeout: the probe of every host's interfaces
BLACKLIST_COOLDOWN_S = (10, 300)  # Horovod waits 2-3x the first, doubling per failure, at most the second


def horovodrun_args(workers: int, slots: int, elastic: bool = False,
                    min_workers: int = 1, max_workers: int = 0, controller: str = "gloo") -> list[str]:
    """Arguments after `horovodrun`: -np is workers x slots, so every slot runs exactly one rank."""
    args = ["-np", str(workers * slots)]
    if elastic:
        args += ["--min-np", str(min_workers * slots), "--max-np", str((max_workers or workers) * slots),
                 "--host-discovery-script", DISCOVER_HOSTS, "--slots-per-host", str(slots),
                 "--blacklist-cooldown-range", *map(str, BLACKLIST_COOLDOWN_S)]
    else:
        args += ["--hostfile", HOSTFILE]
    return args + ["--start-timeout", str(START_TIMEOUT_S), f"--{controller}", *TRAIN]


def option_value(args: list[str], *names: str) -> str | None:
    """The value after the first of `names` in an argument list (`-np 4` or `-np=4`)."""
    for i, arg in enumerate(args):
        for name in names:
            if arg == name and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(name + "="):
                return arg[len(name) + 1:]
    return None
