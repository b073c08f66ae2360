"""The warm interpreter: imports a framework once, then forks a rank for each launch it is sent.

Started by launcher.py (the test suite's `python`) as `python server.py FOLDER PROFILE OWNER_PID`,
in the environment of the first launch that needed it. It imports the profile's packages
(PROFILES) with nothing initialised and no thread started (it refuses to serve otherwise), then
listens on FOLDER/socket. Each connection brings one launch: the launcher's file descriptors
(its standard streams and any it inherited), its arguments, environment, working folder, umask,
resource limits and signal state. The server forks; the child takes all of that over (each
descriptor at its own number; sys.executable is the launcher, so what the rank starts with it or
through multiprocessing, a DataLoader's fork server say, starts warm too), runs the script (or
`-m`'s module) as `__main__`, exits through the interpreter's own finalisation, and the server
sends its exit status back to the launcher, which exits with it. A launcher that goes away
(SIGKILL from horovodrun's clean-up) takes its rank with it: the server kills the child when the
connection closes; a rank that stops (SIGSTOP) stops its launcher, so a test that watches the
launcher sees the rank's state. The server ends when its owner (the pytest worker) has gone.

Single-threaded on purpose: a fork copies only the thread that forks, so the server never
starts one (select over the connections, SIGCHLD through a wake-up pipe).
"""

from __future__ import annotations

import fcntl
import gc
import io
import json
import os
import pickle
import re
import resource
import select
import signal
import socket
import struct
import sys
import tempfile
import types
import warnings
from importlib.machinery import BuiltinImporter, SourceFileLoader
from pathlib import Path

# What each profile imports, in order, and whether TensorFlow comes in hvd_runtime.tf's way
# (Keras' unused extras hidden while it loads: hvd_runtime/tf/lean_import.py).
PROFILES = {
    "torch": ("numpy", "torch", "horovod.torch", "torch._dynamo", "matplotlib.pyplot"),
    # (multiprocessing.spawn, which torch imports: so that rank 0's tracking process starts warm too)
    "tf-lean": ("numpy", "tensorflow", "keras", "horovod.tensorflow", "multiprocessing.spawn", "matplotlib.pyplot"),
    "tf": ("numpy", "tensorflow", "keras", "horovod.tensorflow", "multiprocessing.spawn", "matplotlib.pyplot"),
    # Rank 0's tracking process (hvd_runtime.tracking.remote): MLflow, and for a torch run the
    # flavor and torch.export it imports once the run is open (hvd_runtime.tracking.sink.prepare_flavor).
    "tracking": ("numpy", "mlflow"),
    "tracking-torch": ("numpy", "torch", "mlflow", "mlflow.pytorch", "torch.export"),
    # horovodrun, and its per-rank middlemen and resource tracker (multiprocessing's spawn).
    "runner": ("horovod.runner.launch", "multiprocessing.spawn", "multiprocessing.resource_tracker"),
}
# Modules a rank imports later on its own, imported ahead (last): torch._dynamo, which a torch
# rank's first optimizer step or a model built on the meta device imports, about 0.9 CPU-s; and
# matplotlib's pyplot, which a pipeline's rank 0 imports at the end of its run to draw its
# timeline, about 0.7 CPU-s (after Keras in the tf profiles, as in a rank, so Keras' import never
# sees it). A cold rank makes their changes to the environment (TORCHINDUCTOR_CACHE_DIR) and to
# the warnings filters (sympy's) only then, so a child starts without them.
LATER = ("torch._dynamo", "matplotlib.pyplot")
KERAS_EXTRAS = ("sklearn", "matplotlib", "pandas")
HEADER = struct.Struct("!I")
VARIABLE = "HVDGEN_WARM_START"   # warm_start.VARIABLE (this file imports nothing of the suite's)
MAX_FDS = 253   # the most one message carries (the kernel's SCM_MAX_FD)
REPO = Path(__file__).resolve().parents[2]


def threads() -> int:
    """This process's threads, but jemalloc's background thread (pyarrow's, which MLflow imports):
    jemalloc's fork handlers stop it, and the child allocates without it."""
    return sum(Path(f"/proc/self/task/{task}/comm").read_text() != "jemalloc_bg_thd\n"
               for task in os.listdir("/proc/self/task"))


def native_notice_filter():
    """hvd_runtime.tf.native_logs' patterns, read from its file without importing hvd_runtime."""
    namespace: dict = {}
    source = REPO / "hvd_runtime" / "tf" / "native_logs.py"
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    if os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0":
        return lambda line: True
    patterns = [re.compile(p) for p in namespace["notices"](namespace["host_has_nvidia_device"]())]
    return lambda line: not any(p.search(line) for p in patterns)


def environment_changes(before: dict[str, str]) -> dict[str, tuple[str | None, str]]:
    """The variables set since `before`, each with the value it had then."""
    return {k: (before.get(k), v) for k, v in os.environ.items() if before.get(k) != v}


def preload(profile: str) -> tuple[bytes, int, dict[str, tuple[str | None, str]]]:
    """Import the profile's packages; return what they wrote to stderr (a rank writes it at its
    start), the threads the process had after numpy (OpenBLAS' pool, which it stops itself before
    a fork, pthread_atfork, and starts again in the child when needed; no other may be running),
    and the variables the imports but the LATER ones set in the environment (TensorFlow sets
    some), each with the value it had before. The LATER imports' warnings filters are undone."""
    before = dict(os.environ)
    captured = tempfile.TemporaryFile()
    sys.stderr.flush()
    saved = os.dup(2)
    os.dup2(captured.fileno(), 2)
    hidden = [name for name in KERAS_EXTRAS if name not in sys.modules] if profile == "tf-lean" else []
    allowed = threads()
    changed, filters = None, None   # as the imports before the LATER ones left them
    try:
        for name in hidden:
            sys.modules[name] = None  # type: ignore[assignment]
        for module in PROFILES[profile]:
            if module in LATER and changed is None:
                changed, filters = environment_changes(before), list(warnings.filters)
                for name in hidden:   # the framework is in: a rank imports them as it likes from here on
                    if sys.modules.get(name, False) is None:
                        del sys.modules[name]
            __import__(module)
            if module == "numpy":
                allowed = threads()
    finally:
        for name in hidden:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]
        if filters is not None:
            warnings.filters[:] = filters
            warnings._filters_mutated()
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
    captured.seek(0)
    written = captured.read()
    if profile == "tf-lean":  # what hvd_runtime.tf's import lets through
        keep = native_notice_filter()
        lines = written.decode(errors="surrogateescape").splitlines(keepends=True)
        written = "".join(line for line in lines if keep(line.rstrip("\n"))).encode(errors="surrogateescape")
    return written, allowed, environment_changes(before) if changed is None else changed


def receive(connection: socket.socket) -> tuple[dict, list[int]]:
    """One launch: a length-prefixed pickle, the launcher's fds (0, 1, 2 and those it inherited)
    alongside its first bytes."""
    data, fds = b"", []
    while len(data) < HEADER.size or len(data) < HEADER.size + HEADER.unpack_from(data)[0]:
        chunk, ancillary, _flags, _address = connection.recvmsg(1 << 20, socket.CMSG_SPACE(MAX_FDS * 4))
        if not chunk:
            raise EOFError
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += list(struct.unpack(f"{len(payload) // 4}i", payload[:len(payload) // 4 * 4]))
        data += chunk
    return pickle.loads(data[HEADER.size:]), fds


def status_of(wait_status: int) -> bytes:
    if os.WIFSIGNALED(wait_status):
        return b"signal %d\n" % os.WTERMSIG(wait_status)
    return b"exit %d\n" % os.waitstatus_to_exitcode(wait_status)


def serve(folder: Path, owner: int):
    """Fork a child for each launch; return (in the child only) its launch and fds."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    staging = folder / f"socket.{os.getpid()}"
    listener.bind(str(staging))
    listener.listen(64)
    # What a launcher checks its import path against (launcher.shadows), then the socket.
    names = {"modules": sorted({name.partition(".")[0] for name in sys.modules}), "path": sys.path}
    (folder / "names").write_text(json.dumps(names))
    os.rename(staging, folder / "socket")   # launchers connect only once it is ready
    children: dict[int, socket.socket] = {}   # pid -> the launcher's connection
    while True:
        watched = [listener, wake_read, *children.values()]
        readable, _, _ = select.select(watched, [], [], 2.0)
        try:
            os.kill(owner, 0)
        except ProcessLookupError:
            for pid in children:
                os.kill(pid, signal.SIGKILL)
            os._exit(0)
        for ready in readable:
            if ready is listener:
                connection, _ = listener.accept()
                try:
                    launch, fds = receive(connection)
                except (EOFError, OSError):
                    connection.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    for fd in (wake_read, wake_write):
                        os.close(fd)
                    for other in (listener, connection, *children.values()):
                        other.close()
                    return launch, fds
                for fd in fds:
                    os.close(fd)
                connection.sendall(b"pid %d\n" % pid)
                children[pid] = connection
            elif ready == wake_read:
                os.read(wake_read, 4096)
            else:  # the launcher went away before its rank ended: so does the rank
                pid = next(p for p, c in children.items() if c is ready)
                if not ready.recv(1, socket.MSG_PEEK):
                    os.kill(pid, signal.SIGKILL)
        while children:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG | os.WUNTRACED)
            except ChildProcessError:
                break
            if pid == 0:
                break
            if os.WIFSTOPPED(wait_status):   # the launcher stops too: what watches it sees the rank's state
                try:
                    children[pid].sendall(b"stopped %d\n" % os.WSTOPSIG(wait_status))
                except (KeyError, OSError):
                    pass
                continue
            connection = children.pop(pid, None)
            if connection is not None:
                try:
                    connection.sendall(status_of(wait_status))
                except OSError:
                    pass
                connection.close()


def standard_stream(fd: int, mode: str, like: io.TextIOWrapper, unbuffered: bool) -> io.TextIOWrapper:
    """A sys.stdin/out/err over fd as the interpreter makes them at start-up (Python/pylifecycle.c,
    create_stdio): unbuffered (-u) writes go straight to the raw file and through the text layer;
    otherwise a terminal's streams and stderr are line-buffered."""
    raw = io.FileIO(fd, mode, closefd=False)
    raw.name = like.name
    buffer = raw if unbuffered and mode == "w" else (io.BufferedReader(raw) if mode == "r" else io.BufferedWriter(raw))
    stream = io.TextIOWrapper(buffer, encoding=like.encoding, errors=like.errors,
                              line_buffering=not unbuffered and (raw.isatty() or fd == 2), write_through=unbuffered)
    stream.mode = mode
    return stream


def become(launch: dict, fds: list[int], notices: bytes, imports_set: dict) -> dict:
    """Take over the launcher's process state; return the globals of a fresh __main__."""
    if launch["own_group"]:   # a rank that signals its own process group must not reach the server
        os.setpgid(0, 0)
    # Each of the launcher's descriptors at its own number: first all out of the way of those numbers.
    above = max(launch["fds"]) + 1
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, above) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(launch["fds"], moved):
        os.dup2(fd, target, inheritable=True)
        os.close(fd)
    os.chdir(launch["cwd"])
    os.umask(launch["umask"])
    for which, limits in launch["rlimits"].items():
        try:
            resource.setrlimit(which, limits)
        except (ValueError, OSError):
            pass
    os.environ.clear()
    os.environ.update(launch["env"])
    for name, (before, after) in imports_set.items():   # as the imports would have set them here
        if os.environ.get(name) == before:
            os.environ[name] = after
    for signum in range(1, signal.NSIG):
        if signum in (signal.SIGKILL, signal.SIGSTOP) or signum in (32, 33):
            continue
        try:
            if signum in launch["ignored"] or signum in (signal.SIGPIPE, signal.SIGXFSZ):
                signal.signal(signum, signal.SIG_IGN)
            elif signum == signal.SIGINT:
                signal.signal(signum, signal.default_int_handler)
            else:
                signal.signal(signum, signal.SIG_DFL)
        except (OSError, ValueError):
            pass
    signal.pthread_sigmask(signal.SIG_SETMASK, launch["blocked"])
    unbuffered = launch["unbuffered"] or bool(os.environ.get("PYTHONUNBUFFERED"))
    sys.stdin = sys.__stdin__ = standard_stream(0, "r", sys.__stdin__, unbuffered)
    sys.stdout = sys.__stdout__ = standard_stream(1, "w", sys.__stdout__, unbuffered)
    sys.stderr = sys.__stderr__ = standard_stream(2, "w", sys.__stderr__, unbuffered)
    if notices:
        sys.stderr.buffer.write(notices)
        sys.stderr.flush()
    if "numpy" in sys.modules:
        numpy = sys.modules["numpy"]
        numpy.random.seed()   # a fresh process seeds numpy's global generator afresh
        numpy.ones((256, 256)) @ numpy.ones((256, 256))   # and has OpenBLAS' threads (stopped by the fork)
    if "multiprocessing" in sys.modules:   # and its own key for its children's connections
        sys.modules["multiprocessing"].current_process().authkey = os.urandom(32)
    # The interpreter this process was started as is the tests' `python` (the launcher): what it
    # starts with sys.executable (a generated project's test starting its ranks) or through
    # multiprocessing (a DataLoader's fork server, spawn's children) starts through it, warm too
    # where it can serve them.
    sys.executable = os.path.join(launch["env"][VARIABLE].rsplit(":", 2)[0], "bin", "python")
    if "multiprocessing.spawn" in sys.modules:   # (torch imports it; it took sys.executable before)
        sys.modules["multiprocessing.spawn"].set_executable(sys.executable)
    sys.argv = list(launch["argv"])
    sys.orig_argv = list(launch["orig_argv"])
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=sys.modules["builtins"], __spec__=None, __package__=None, __cached__=None)
    if launch["module"] is not None:   # runpy sets the rest, as `-m` does
        first = launch["cwd"]
    elif launch["code"] is None:
        path = os.path.abspath(launch["argv"][0])
        first = os.path.dirname(os.path.realpath(path))
        main.__file__ = path
        main.__loader__ = SourceFileLoader("__main__", path)
    else:
        first = ""
        main.__loader__ = BuiltinImporter
    # The import path a cold start computes: the script's folder (unless -P), then PYTHONPATH's
    # entries made absolute, then the rest of the server's (started without PYTHONPATH), each once.
    rest = sys.path if sys.flags.safe_path else sys.path[1:]
    entries = launch["env"].get("PYTHONPATH", "")
    entries = [os.path.abspath(entry) for entry in entries.split(os.pathsep)] if entries else []
    sys.path[:] = ([] if sys.flags.safe_path else [first]) + list(dict.fromkeys([*entries, *rest]))
    sys.modules["__main__"] = main
    return main.__dict__


def without_server_frames(hook):
    """sys.excepthook, showing the script's frames only, as a plain start's traceback does."""
    def show(kind, value, traceback):
        while traceback is not None and traceback.tb_frame.f_code.co_filename == __file__:
            traceback = traceback.tb_next
        hook(kind, value if value is None else value.with_traceback(traceback), traceback)
    return show


if __name__ == "__main__":
    folder, profile, owner = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    try:
        written, allowed, imports_set = preload(profile)
    except BaseException:
        import traceback
        (folder / "broken").write_text(traceback.format_exc())
        raise
    if threads() != allowed:
        (folder / "broken").write_text(f"{profile}: {threads()} threads after the imports, {allowed} after numpy's;"
                                       " a fork would lose them\n")
        sys.exit(1)
    gc.collect()
    gc.freeze()   # what the imports made is shared with every rank, unwalked by its collector
    launch, fds = serve(folder, owner)
    namespace = become(launch, fds, written, imports_set)
    del launch["env"]
    if launch["module"] is not None:   # as `-m` runs it, in this __main__
        code = compile(f"__import__('runpy')._run_module_as_main({launch['module']!r})", __file__, "exec")
    else:
        source = launch["code"] if launch["code"] is not None else Path(namespace["__file__"]).read_bytes()
        code = compile(source, "<string>" if launch["code"] is not None else namespace["__file__"], "exec")
    sys.excepthook = without_server_frames(sys.excepthook)
    try:
        exec(code, namespace)
    except BaseException as raised:   # as the interpreter ends an uncaught one: SystemExit quietly
        if sys.excepthook.__name__ != "show":
            sys.excepthook = without_server_frames(sys.excepthook)
        raise raised.with_traceback(raised.__traceback__.tb_next)
