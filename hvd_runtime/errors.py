"""A failure the user's input or environment caused ends the job in one line, printed by rank 0.

Every such failure is a UserError (config.ConfigError, data.DataError and the rest below them),
raised with the problem and the fix. train.py's `main()` hands it to `end_run`: rank 0 prints the
line and exits with status 1; any other rank exits with the same status without a word, once the
launcher has had time to end it. Internal bugs are other exceptions and keep their tracebacks.

A rank other than 0 does not exit at once. The launchers (horovodrun, mpirun, srun) end every rank
as soon as one exits with an error, and a rank that found the problem first would have rank 0
ended before rank 0 printed its line. So it waits, up to LINGER_S, for the launcher to end it
after rank 0 has exited. A problem only that rank met (rank 0 is still working, or waits for it
in a collective) never ends rank 0, so the rank prints the line itself when the wait is over.
An elastic job's driver ends no rank when another fails, so there a rank other than 0 exits at
once and quietly: its start-up verdicts are rank 0's, reached in the elastic state's first sync.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from typing import NoReturn

from hvd_runtime import watchdog

__all__ = ["LINGER_S", "UserError", "end_run", "launch_rank"]

LINGER_S = 30.0

# Where each launcher puts this process's rank: horovodrun (Gloo), Open MPI, MPICH and PMIx, Slurm.
_RANK_VARIABLES = ("HOROVOD_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "SLURM_PROCID")


class UserError(Exception):
    """A problem in the user's input or environment: the message names it and the fix."""

    kind = "error"   # the word before the message: "config error: ..."


def launch_rank() -> int:
    """This process's rank as its launcher numbered it (0 when started alone). Read from the
    environment, so it is known before Horovod starts and when Horovod never did."""
    for name in _RANK_VARIABLES:
        value = os.environ.get(name, "")
        if value.isdigit():
            return int(value)
    return 0


def end_run(error: UserError) -> NoReturn:
    """Exit with status 1: rank 0 prints `<kind>: <message>`; the other ranks print nothing
    unless, after LINGER_S, the launcher has not ended them (rank 0 did not stop on it)."""
    line = f"{error.kind}: {error}"
    if launch_rank() == 0:
        sys.exit(line)
    if os.environ.get("HOROVOD_ELASTIC") == "1":
        sys.exit(1)
    _release(error)
    watchdog.stop()   # the wait is no hang: a late beat would dump this rank's stacks
    for signum in (signal.SIGTERM, signal.SIGINT):   # the launcher's end is this rank's end, silently
        signal.signal(signum, _exit_quietly)
    time.sleep(LINGER_S)
    sys.exit(line)


def _exit_quietly(signum, frame) -> NoReturn:
    raise SystemExit(1)   # through the interpreter's own exit: its data workers are stopped


def _release(error: BaseException) -> None:
    """Drop the frames the error's tracebacks hold (a data loader's iterator, its workers'
    queues), so what they hold is closed before the wait, not after it."""
    while error is not None:
        error.__traceback__ = None
        error = error.__cause__ or error.__context__
    gc.collect()
