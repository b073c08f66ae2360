"""A request to stop (SIGTERM, SIGUSR1) ends training after a step every rank agrees on, with a checkpoint there.

A pod's eviction, a spot instance's reclaim and a scheduler's warning ahead of its time limit
send SIGTERM or SIGUSR1; horovodrun, sent SIGTERM or SIGINT itself, sends SIGTERM to every rank.
The handler only notes the signal. The loop asks at each of its log points (train.log_every
steps; every STOP_CHECK_EVERY when that is 0), in the one collective it makes there anyway,
whether any rank was asked: the ranks that were not learn it there, so every rank stops after
the same optimizer step. The loop then writes a checkpoint at that step and raises Preempted, a
SystemExit: the tracker ends the MLflow run as KILLED, and the process exits with 128 + the
signal, as a process the signal had ended would. The next start resumes at that step, exactly.

From the signal on, the rank is held to `train.grace_s` (hvd_runtime.watchdog.limit): a step,
checkpoint or close-out that is not done by then still ends the process, before the sender's
own deadline (SIGKILL) comes.
"""

from __future__ import annotations

import os
import signal
import threading

from hvd_runtime import watchdog

__all__ = ["SIGNALS", "STOP_CHECK_EVERY", "Preempted", "asked", "install", "signal_received"]

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


def asked() -> float:
    """1.0 once this rank has received a stop signal: what it adds to the loop's check."""
    return 1.0 if _received else 0.0


def signal_received(default: int = signal.SIGTERM) -> int:
    """The signal this rank received, or `default` for a rank that learnt of the stop from a peer."""
    return _received[0] if _received else default
