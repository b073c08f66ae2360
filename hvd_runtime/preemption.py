"""A request to stop (SIGTERM, SIGUSR1) ends training after a step every rank agrees on, with a checkpoint there.

A pod's eviction, a spot instance's reclaim and a scheduler's warning ahead of its time limit
send SIGTERM or SIGUSR1; horovodrun, sent SIGTERM or SIGINT itself, sends SIGTERM to every rank.
The handler only notes the signal. The loop asks at each of its log points (train.log_every
steps; every STOP_CHECK_EVERY when that is 0), in the one collective it makes there anyway,
whether any rank was asked, and with which signal: the ranks that were not learn it there, so
every rank stops after the same optimizer step, on the same signal (SIGTERM where any rank got
it, since it asks for no requeue). The loop then writes a checkpoint at that step and raises
Preempted, a SystemExit: the tracker ends the MLflow run as KILLED, and every process exits with
128 + that signal, as a process the signal had ended would. The next start resumes at that step,
exactly.

From the signal on, the rank is held to `train.grace_s` (hvd_runtime.watchdog.limit): a step,
checkpoint or close-out that is not done by then still ends the process, before the sender's
own deadline (SIGKILL) comes.
"""

from __future__ import annotations

import os
import signal
import threading

from hvd_runtime import watchdog

__all__ = ["SIGNALS", "STOP_CHECK_EVERY", "Preempted", "agreed", "asked", "install"]

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_CHECK_EVERY = 10   # steps between the loop's checks when it has no log points

_received: list[int] = []


class Preempted(SystemExit):
    """Training stopped on a signal after `step`, its checkpoint written."""

    run_status = "KILLED"   # what the tracker ends the run as

    def __init__(self, signum: int, step: int):
        super().__init__(128 + signum)
        self.signum, self.step = signum, step

    @property
    def signal_name(self) -> str:
        return signal.Signals(self.signum).name


def install(grace_s: float) -> None:
    """Note SIGTERM and SIGUSR1 from now on (the main thread's; elsewhere nothing is installed)."""
    _received.clear()
    if threading.current_thread() is not threading.main_thread():
        return

    rank = os.getpid()

    def note(signum, frame) -> None:
        if os.getpid() != rank:   # a process forked from the rank (a data worker): the signal's usual end
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if not _received:
            _received.append(signum)
            watchdog.limit(grace_s, f"the stop {signal.Signals(signum).name} asked for has not finished "
                                    f"in {grace_s:g} s (train.grace_s)")

    for sig in SIGNALS:
        signal.signal(sig, note)


def asked() -> list[float]:
    """What this rank adds to the loop's check: 1.0 for the stop signal it has received, one entry
    per SIGNALS, in their order."""
    return [1.0 if _received[:1] == [sig] else 0.0 for sig in SIGNALS]


def agreed(counts) -> int | None:
    """The signal every rank stops on, from asked() summed over the ranks; None while none was asked.
    SIGTERM where any rank got it: it asks for a stop without a requeue, and wins over SIGUSR1."""
    for sig, count in zip(SIGNALS, counts):   # SIGTERM first
        if count > 0:
            return int(sig)
    return None
