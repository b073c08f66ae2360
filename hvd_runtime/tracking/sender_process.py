"""MLflow's work in a process of its own, so that it never holds the training process's GIL.

Why a process: MLflow's import, the embedded store's first migrations, torch.export of each
epoch's checkpoint and MLflow's requirements check are Python work. As a thread of rank 0 they
took the training thread's interpreter lock: on the generated demo (np=2, 2 CPU cores, 20 epochs)
16.5 CPU-s of it, the step went from 8 to 25 ms and the run from 10 to 26 s. Here they run in
a child of the training process, at a lower priority (nice 10: it takes the CPU training
leaves), with no GPU (CUDA_VISIBLE_DEVICES empty: it must not take a GPU's memory) and one
thread.

The training process's end (`TrackingProcess`, what `Tracker` holds) pickles each record and writes
it to a pipe; the child's main thread only reads them and hands them to the `Sender` thread,
which sends them in order (or spools them). The child reports back the run id once the run is
open, and every warning and log line, which the training process logs as before. It exits when
it has sent the `end` record; when asked to give up (`drain`: spool what is left); or, when the
training process is gone without ending the run, once it has sent what it holds (at most
DETACH_TIMEOUT s), leaving the run for a resumed or elastic job to continue.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Callable

from . import records
from .sender import Sender
from .spool import SPOOL_FILE, Spool

DRAIN_TIMEOUT = 60.0    # seconds drain waits for the child to spool what it holds (models are saved)
DETACH_TIMEOUT = 60.0   # seconds the child goes on sending after the training process is gone
NICENESS = 0
BOOT = ("import sys; sys.path[:0] = sys.argv[3:]; from hvd_runtime.tracking.sender_process import main; "
        "main(int(sys.argv[1]), int(sys.argv[2]))")

log = logging.getLogger("hvd_runtime.tracking")


class TrackingProcess:
    """The training process's end of the tracking process: `Tracker` calls submit, ready, run_id,
    join, is_alive and drain, as it would on a thread."""

    def __init__(self, uri: str, header: dict, params: dict, spool_dir: Path, warn: Callable[[str], None],
                 queue_size: int = 10_000):
        self.warn = warn
        self.run_id: str | None = header.get("run_id")
        self.ready = threading.Event()      # set once the run is open, opening it failed, or the child is gone
        self.spool_path = Path(spool_dir) / SPOOL_FILE
        self._lock = threading.Lock()
        self._gone = False
        child_reads, to_child = os.pipe()
        parent_reads, to_parent = os.pipe()
        env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")     # TF's start-up notes were printed by the rank already
        # The training process's import path, so the child unpickles the project's own classes
        paths = [str(Path(p or ".").resolve()) for p in sys.path]
        try:
            self._process = subprocess.Popen([sys.executable, "-c", BOOT, str(child_reads), str(to_parent), *paths],
                                             pass_fds=(child_reads, to_parent), stdin=subprocess.DEVNULL, env=env)
        finally:
            os.close(child_reads)
            os.close(to_parent)
        self._to = Connection(to_child, readable=False)
        self._from = Connection(parent_reads, writable=False)
        self._send(("setup", {"uri": uri, "header": header, "params": params, "spool_dir": str(spool_dir),
                              "queue_size": queue_size}))
        threading.Thread(target=self._listen, name="hvd-runtime-tracking-replies", daemon=True).start()

    def submit(self, record: dict) -> None:
        self._send(("record", record))

    def _send(self, message: tuple) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        with self._lock:
            if self._gone:
                return
            try:
                self._to.send_bytes(data)
            except OSError as exc:
                self._gone = True
                self.warn(f"the tracking process exited ({exc}); this run logs nothing more")

    def _listen(self) -> None:
        try:
            while True:
                kind, *rest = pickle.loads(self._from.recv_bytes())
                if kind == "ready":
                    self.run_id = rest[0]
                    self.ready.set()
                elif kind == "warn":
                    self.warn(rest[0])
                elif kind == "log":
                    log.log(rest[0], "%s", rest[1])
        except (EOFError, OSError):
            pass
        finally:
            self.ready.set()    # nothing waits for a run id from a process that is gone

    def is_alive(self) -> bool:
        return self._process.poll() is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def drain(self) -> None:
        """After close gave up waiting: the child spools what it holds (or is being sent) and exits."""
        self._send(("abandon",))
        try:
            self._process.wait(DRAIN_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.warn(f"the tracking process did not spool its records within {DRAIN_TIMEOUT:.0f} s; "
                      "they are lost")
            self._process.kill()
            self._process.wait()


class _Forward(logging.Handler):
    """The child's log lines, to be logged by the training process (its handlers, its format)."""

    def __init__(self, reply: Callable[..., None]):
        super().__init__(logging.INFO)
        self.reply = reply

    def emit(self, record: logging.LogRecord) -> None:
        self.reply("log", record.levelno, record.getMessage())


def _exit() -> None:
    """Leave at once: the Sender thread may be stuck on a server, and is a daemon."""
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(0)


def main(read_fd: int, write_fd: int) -> None:
    """The child: read records until the run ends, the parent gives up, or the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # Ctrl-C is the training process's to handle
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    inbox = Connection(read_fd, writable=False)
    outbox = Connection(write_fd, readable=False)
    lock = threading.Lock()

    def reply(*message) -> None:
        with lock:
            try:
                outbox.send_bytes(pickle.dumps(message))
            except OSError:     # the training process is gone; the spool still works
                pass

    forwarded = logging.getLogger("hvd_runtime.tracking")
    forwarded.addHandler(_Forward(reply))
    forwarded.setLevel(logging.INFO)
    forwarded.propagate = False

    _, setup = pickle.loads(inbox.recv_bytes())
    sender = Sender(setup["uri"], setup["header"], setup["params"], None, lambda problem: reply("warn", problem),
                    queue_size=setup["queue_size"])
    sender.spool = Spool(Path(setup["spool_dir"]), sender.segment_head)

    def report_then_exit() -> None:
        sender.ready.wait()
        reply("ready", sender.run_id)
        sender.join()       # it returns after sending the end record
        _exit()

    sender.start()
    threading.Thread(target=report_then_exit, daemon=True).start()
    while True:
        try:
            kind, *rest = pickle.loads(inbox.recv_bytes())
        except (EOFError, OSError):
            break
        if kind == "record":
            sender.submit(rest[0])
        elif kind == "abandon":
            sender.drain()
            _exit()
    # The training process is gone without ending the run: send what is queued, end nothing.
    sender.submit(records.detach())
    sender.join(DETACH_TIMEOUT)
    sender.drain()
    _exit()
