"""A rank whose training stops moving ends itself, with every thread's stack, so that the job ends.

A collective waits for every rank of its set: one stopped, lost or deadlocked peer blocks all the
others for ever, horovodrun waits on them, and a cluster job holds its GPUs until its wall-clock
limit with nothing in the log that says where. Here the loop marks each point it passes (a step,
an evaluation, a checkpoint) with `beat(what)`; a thread of its own ends the process
when the next mark is late:

    watchdog.start(cfg.train)                 # hvd_runtime's init(): start-up has its allowance
    watchdog.beat(f"step {n}")                # the loop, before each step: train.hang_timeout_s
    watchdog.beat("checkpoint", allowance=True)   # first steps, evaluations, checkpoints: longer
    watchdog.stop()                           # training's collectives are over

Late, it writes one line naming what did not finish and in how long, then every thread's Python
stack (`faulthandler`: the frame waiting in a Horovod call names the operation) to stderr, which
horovodrun prefixes with the rank, and exits with HANG_EXIT without cleaning up (a blocked
collective would block the interpreter's own exit too). horovodrun then stops the other ranks.
Horovod's own stall warnings, which name the tensors and the ranks missing from them, are turned
on at half the timeout, 60 s at most (HOROVOD_STALL_CHECK_TIME_SECONDS, unless set), and print on
rank 0 when ranks submit different tensors. Against a stopped peer they stay silent: rank 0's
background loop blocks first in the collective that coordinates Horovod's response cache.

`train.hang_timeout_s: 0` turns it off. A process-wide watchdog, as faulthandler itself is.
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

__all__ = ["HANG_EXIT", "Watchdog", "beat", "start", "stop"]

HANG_EXIT = 124   # as timeout(1) ends what ran too long: not a crash's 1 nor a signal's 128 + n


class Watchdog:
    """Ends the process when the time since the last beat passes that beat's allowance."""

    def __init__(self, timeout_s: float, allowance_s: float) -> None:
        self.timeout_s, self.allowance_s = timeout_s, allowance_s
        self._lock = threading.Condition()   # an RLock: limit() may run in a signal handler inside beat()
        self._what, self._deadline, self._allowed = "", float("inf"), 0.0
        self._limit, self._limit_why = float("inf"), ""
        self._stopped = False
        self._thread: threading.Thread | None = None

    def beat(self, what: str, allowance: bool = False) -> None:
        """`what` starts now and must be followed by the next beat within its time."""
        seconds = self.allowance_s if allowance else self.timeout_s
        with self._lock:
            deadline = time.monotonic() + seconds
            sooner = deadline < self._deadline
            self._what, self._allowed, self._deadline = what, seconds, deadline
            if sooner:   # the thread sleeps until the old deadline: wake it (a later one it finds itself)
                self._lock.notify()
            if self._thread is None and not self._stopped:
                self._thread = threading.Thread(target=self._watch, name="hvd_runtime.watchdog", daemon=True)
                self._thread.start()

    def limit(self, seconds: float, why: str) -> None:
        """End the process `seconds` from now whatever the beats say (a stop's grace time), and
        stay armed after stop(): the run's close-out is held to it too."""
        self._limit, self._limit_why = time.monotonic() + seconds, why   # read again on every wake
        with self._lock:
            self._stopped = False
            self._lock.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="hvd_runtime.watchdog", daemon=True)
                self._thread.start()

    def stop(self) -> None:
        with self._lock:
            self._stopped = self._limit == float("inf")
            self._deadline = float("inf")
            self._lock.notify()

    def _watch(self) -> None:
        with self._lock:
            while not self._stopped:
                now = time.monotonic()
                if self._limit <= now:
                    self._end(f"{self._limit_why}: ending this rank (exit {HANG_EXIT}) before its time is up")
                if self._deadline <= now:
                    self._end(f"{self._what} has not finished in {self._allowed:.0f} s "
                              f"(train.hang_timeout_s / train.hang_allowance_s): ending this rank "
                              f"(exit {HANG_EXIT}) so that the job ends; a peer that stopped or a collective "
                              "that never completed blocks it")
                left = min(self._deadline, self._limit) - now
                self._lock.wait(timeout=None if left == float("inf") else left)

    def _end(self, why: str) -> None:
        out = sys.stderr
        out.write(f"hang: {why}. Every thread's stack:\n")
        out.flush()
        faulthandler.dump_traceback(file=out, all_threads=True)
        out.flush()
        os._exit(HANG_EXIT)


_current: Watchdog | None = None


def start(train_cfg) -> Watchdog | None:
    """The process's watchdog from cfg.train, armed for start-up (None when hang_timeout_s is 0).

    Before hvd.init: Horovod reads its stall-warning period at start-up."""
    global _current
    stop()
    if train_cfg.hang_timeout_s <= 0:
        return None
    os.environ.setdefault("HOROVOD_STALL_CHECK_TIME_SECONDS", str(max(1, min(60, int(train_cfg.hang_timeout_s // 2)))))
    _current = Watchdog(train_cfg.hang_timeout_s, max(train_cfg.hang_allowance_s, train_cfg.hang_timeout_s))
    _current.beat("start-up", allowance=True)
    return _current


def beat(what: str, allowance: bool = False) -> None:
    """Mark a point of the run on the process's watchdog, if it has one."""
    if _current is not None:
        _current.beat(what, allowance)


def limit(seconds: float, why: str) -> None:
    """Hold the process to `seconds` from now (hvd_runtime.preemption's grace time), with a
    watchdog of its own if hang_timeout_s is 0."""
    global _current
    if _current is None:
        _current = Watchdog(float("inf"), float("inf"))
    _current.limit(seconds, why)


def stop() -> None:
    """Training's collectives are over: beats stop counting (a limit still holds)."""
    global _current
    if _current is not None:
        _current.stop()
        if _current._stopped:
            _current = None
