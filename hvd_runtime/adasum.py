"""Whether this Horovod job can run Adasum: a decision on what Horovod reports, framework-free.

Horovod implements Adasum only inside its MPI controller (AdasumMPI, and on GPUs Adasum over
NCCL plus MPI). A Gloo job has no Adasum op at all: every allreduce with `op=hvd.Adasum` fails
with HorovodInternalError, so `horovod.adasum: true` would train nothing, and in an elastic job
each failed collective is a reset, so it would reset forever. Both frameworks' optimizers ask
here at start-up, after hvd.init(), so the user gets one config-error line with the fix instead.
"""

from __future__ import annotations

from hvd_runtime.config import ConfigError


def adasum_refusal(adasum: bool, mpi_built: bool, mpi_enabled: bool) -> str | None:
    """The one line refusing horovod.adasum in this job, or None when Adasum can run (or is off).

    `mpi_built`: Horovod was compiled with MPI (`hvd.mpi_built()`); `mpi_enabled`: this job runs
    on the MPI controller (`hvd.mpi_enabled()`, known after hvd.init()).
    """
    if not adasum or mpi_enabled:
        return None
    if mpi_built:
        fix = "launch with horovodrun --mpi (this Horovod has MPI)"
    else:
        fix = ("use a Horovod built with MPI (`hvdgen install-horovod` with mpicxx on PATH) "
               "and launch with horovodrun --mpi")
    return (f"horovod.adasum needs Horovod's MPI controller, but this job runs on Gloo: "
            f"use --horovod.adasum false, or {fix}")


def check_adasum(adasum: bool, hvd) -> None:
    """Raise ConfigError when horovod.adasum is on and this job (`hvd`, a started horovod.torch
    or horovod.tensorflow) has no Adasum op."""
    problem = adasum_refusal(adasum, hvd.mpi_built(), hvd.mpi_enabled())
    if problem:
        raise ConfigError(problem)
