"""MLflow in a process of its own beside rank 0, so that its Python never takes the training's turn.

Everything MLflow does is Python holding the interpreter's lock: its import and the embedded
store's creation, each metrics write to sqlite, each model logged. On a thread of the training
process, training would wait meanwhile, and at every allreduce the other ranks would wait for
rank 0 (docs/tracking.md, "Where MLflow runs", has what that cost). In a process of its own, the
same work runs on another core.

The sender thread holds a RemoteSink, which offers MlflowSink's two calls (open_run, apply) and
carries each over a socket to a Python process running `serve`; there a real MlflowSink
applies it and answers. A failure there comes back as an exception with MLflow's error code, so
the sender tells a rejected record from a failed server as it would in-process, and a process that
ended counts as a failed server (the rest of the run is spooled). A torch model crosses pickled
(cloudpickle: a class defined in the training script goes by value); the tracking process of a
torch run imports torch, MLflow's flavor and torch.export as soon as the run is open, beside the
first epochs, so that the final model does not wait for them at the end. Other models are
logged by an MlflowSink in this process, on the sender thread: a Keras model (it
unpickles only where its custom layers are registered), a model on a GPU, and one that cannot be
pickled here or unpickled there.
"""

from __future__ import annotations

import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
from multiprocessing import spawn
from multiprocessing.connection import Connection

import cloudpickle

from .models import ModelFile

CLOSE_SECONDS = 10.0    # how long close() waits for the process to exit once told to
UNPICKLABLE = "HVD_RUNTIME_UNPICKLABLE"  # the error code of a request the tracking process cannot read

# One thread at a time imports MLflow into this process (the sender for a local model, or the
# spool saving one): two importing it at once can see it half-initialised.
MLFLOW_IMPORT = threading.Lock()


class TrackingProcessError(Exception):
    """An exception raised in the tracking process, with its MLflow error code (None if none)."""

    def __init__(self, message: str, error_code: str | None = None):
        super().__init__(message)
        self.error_code = error_code


def _failure(message: str, error_code: str | None, os_error: bool) -> Exception:
    if os_error:  # the server is unreachable: a ConnectionError, as it was in this process
        exc = ConnectionError(message)
        exc.error_code = error_code
        return exc
    return TrackingProcessError(message, error_code)


def local_sink(uri: str):
    """An MlflowSink in this process, for the models that are logged here."""
    with MLFLOW_IMPORT:
        from .sink import MlflowSink
    return MlflowSink(uri)


def _child_environment() -> dict[str, str]:
    """This process's environment, with its import path: a model unpickles in the tracking
    process only if its class's module (the project's model.py) is found there too."""
    path = [entry for entry in sys.path if entry and os.path.exists(entry)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


class RemoteSink:
    """MlflowSink's calls, applied by a tracking process (`serve`) that it starts."""

    def __init__(self, uri: str, flavor: str | None = None):
        """flavor: the MLflow flavor of the run's models ("pytorch"), for the process to load early."""
        self.uri = uri
        self._local = None
        ours, theirs = socket.socketpair()
        # The interpreter multiprocessing starts its processes with: sys.executable, unless the
        # program embedding this one named another (multiprocessing.set_executable).
        command = [spawn.get_executable(), "-c", f"import sys; from {__name__} import serve; serve(*sys.argv[1:])",
                   uri, str(theirs.fileno()), *([flavor] if flavor else [])]
        try:
            self._process = subprocess.Popen(command, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                             env=_child_environment())
        finally:
            theirs.close()
        self._connection = Connection(ours.detach())

    def open_run(self, header: dict, reopen: bool = True) -> str:
        return self._call("open_run", header, reopen)

    def apply(self, run_id: str, group: list[dict]) -> None:
        if group[0]["kind"] == "model":
            request = self._pickled_model(run_id, group)
            if request is not None:
                try:
                    self._exchange(request)
                    return
                except TrackingProcessError as exc:
                    if exc.error_code != UNPICKLABLE:   # say its class's module is not importable there
                        raise
            if self._local is None:
                self._local = local_sink(self.uri)
            self._local.apply(run_id, group)
            return
        self._call("apply", run_id, group)

    @staticmethod
    def _pickled_model(run_id: str, group: list[dict]) -> bytes | None:
        """The request that logs a torch model there; None for a model to log here. A model with a
        tensor on a GPU stays here: unpickled there, it would open a CUDA context of its own (GPU
        memory on the device training uses)."""
        if any(record.get("flavor") != "pytorch" or not _on_cpu(record["model"]) for record in group):
            return None
        try:
            return cloudpickle.dumps(("apply", run_id, group))
        except Exception:  # noqa: BLE001 - a model that cannot be pickled is logged here instead
            return None

    def _call(self, *request):
        return self._exchange(pickle.dumps(request))

    def _exchange(self, request: bytes):
        try:
            self._connection.send_bytes(request)
            reply = pickle.loads(self._connection.recv_bytes())
        except (EOFError, OSError) as exc:
            raise ConnectionError(f"the tracking process ended ({self._ending()})") from exc
        if reply[0] == "ok":
            return reply[1]
        _, message, error_code, os_error = reply
        raise _failure(message, error_code, os_error)

    def _ending(self) -> str:
        """How the process ended: its socket closed, so it is ending if it has not yet."""
        try:
            code = self._process.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            return "it closed its end and still runs"
        return f"killed by signal {-code}" if code < 0 else f"exit code {code}"

    def close(self) -> None:
        """Let the process finish what it was asked (it has answered everything), then end it."""
        self._connection.close()
        try:
            self._process.wait(CLOSE_SECONDS)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        """When the sender gives up on it (a hung server): nothing it still does is wanted."""
        if self._process.poll() is None:
            self._process.kill()
            self._process.wait()


def _on_cpu(module) -> bool:
    """A live module with every tensor on the CPU, or a ModelFile (built on the CPU where it is logged)."""
    return isinstance(module, ModelFile) or all(t.device.type == "cpu"
                                                for t in (*module.parameters(), *module.buffers()))


def _reply_to_failure(exc: BaseException) -> tuple:
    text = str(exc).strip() or type(exc).__name__
    return ("error", text, getattr(exc, "error_code", None), isinstance(exc, OSError))


def serve(uri: str, fd: str, flavor: str | None = None) -> None:
    """The tracking process: answer each request with MlflowSink until the socket closes."""
    # Ctrl-C reaches the whole process group; the training process handles it and still ends
    # the run (FAILED) through this process, so this one must not die of it first.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    connection = Connection(int(fd))
    sink = None
    prepared = flavor is None
    while True:
        try:
            data = connection.recv_bytes()
        except EOFError:  # the sender closed: everything asked is answered, so stored
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)   # at once: the interpreter's teardown (MLflow's, SQLAlchemy's) took 0.6 s
        try:
            name, *arguments = pickle.loads(data)
        except Exception as exc:  # noqa: BLE001 - a model whose class cannot be imported here
            connection.send_bytes(pickle.dumps(("error", f"cannot unpickle: {exc}", UNPICKLABLE, False)))
            continue
        try:
            if sink is None:
                from .sink import MlflowSink
                sink = MlflowSink(uri)
            reply = ("ok", getattr(sink, name)(*arguments))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the sender to judge
            reply = _reply_to_failure(exc)
        connection.send_bytes(pickle.dumps(reply))
        if not prepared and name == "open_run":
            prepared = True
            try:
                from .sink import prepare_flavor
                prepare_flavor(flavor)
            except Exception:  # noqa: BLE001 - only a head start: logging a model imports it again
                pass
