"""The test suite's `python`: a rank started from a warm interpreter instead of a cold one.

Installed by warm_start.install() as `python` and `python3` first on the tests' PATH, with
`#!<real python> -IS` as its first line, so horovodrun's `python train.py` and the tests'
`python script.py` / `python -c CODE` land here. It asks the warm server of its kind
(server.py, started on first use: one per profile and per environment that matters while a
framework loads) to fork the rank, hands over its file descriptors (the standard streams and any
it inherited), arguments, environment, working folder and signal state, forwards the signals it
gets, stops while the rank is stopped, and exits as the rank did (the same code, or killed by
the same signal). A DataLoader's fork server, which a warm rank starts through this launcher,
is forked from the torch server too, and so is a generated project's `python -m pytest` (its
train.py names the framework). Anything it does not recognise runs the real interpreter in its
place (execv): other options, other modules, a script that imports neither or both frameworks,
MPI's ranks, a launch whose import path holds a start-up hook (sitecustomize), another network
namespace, or no warm start asked for.
"""

import hashlib
import os
import pickle
import re
import resource
import signal
import socket
import struct
import sys
import time


def inherited_fds() -> list:
    """The file descriptors above 2 this process was started with (not close-on-exec: inherited, as
    a `pass_fds` leaves them); a cold interpreter keeps them, so the rank gets them too."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and os.get_inheritable(fd):
                found.append(fd)
        except OSError:   # the listing's own descriptor, closed by now
            pass
    return sorted(found)


INHERITED = inherited_fds()
REAL = sys.executable
SERVER = os.path.join(os.path.dirname(os.path.realpath(__file__)), "server.py")
# Installed as `horovodrun` too: then this launches the real one, beside the real interpreter.
HOROVODRUN = os.path.basename(sys.argv[0]) == "horovodrun"
ARGS = ([os.path.join(os.path.dirname(REAL), "horovodrun")] if HOROVODRUN else []) + sys.argv[1:]
FORWARDED = (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGALRM, signal.SIGCONT)
# The environment a framework may read while it loads: a server serves only launches that agree on it.
# (PYTHONPATH is not among them: each rank's import path is its own, checked by shadows() instead.)
LOAD_TIME = re.compile(r"^(PYTHON(?!PATH$)|OMP_|MKL_|KMP_|OPENBLAS_|GOTO|TF_|KERAS|XLA_|TORCH|PYTORCH_|CUDA_|NCCL_|LD_"
                       r"|MALLOC|GLIBC|HOME$|TMPDIR$|LANG$|LC_)")
# multiprocessing's fork server (a DataLoader's, started by a warm rank through this launcher:
# server.py points multiprocessing at it); its preloaded modules stand for the script's imports.
FORK_SERVER = re.compile(r"^from multiprocessing\.forkserver import main; main\(\d+, \d+, \[([^\]]*)\]")
# Rank 0's tracking process (hvd_runtime.tracking.remote), its MLflow flavor after the code.
TRACKING = re.compile(r"^import sys; from hvd_runtime\.tracking\.remote import serve; serve\(\*sys\.argv\[1:\]\)$")
# A script's own imports, at its top level (unindented).
TF = re.compile(r"^(import|from) +(tensorflow|keras|horovod\.tensorflow|horovod\.keras|hvd_runtime\.tf)\b", re.M)
TORCH = re.compile(r"^(import|from) +(torch|horovod\.torch|hvd_runtime\.torch)\b", re.M)
# A process an MPI launcher started as a rank (mpirun's daemon, srun's PMI): it stays the process
# that launcher started, which MPI_Init reports to. (Settings such as OMPI_MCA_* do not count.)
MPI_STARTED = ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "PMI_FD")
# What horovodrun starts through multiprocessing: spawn's per-rank middleman and its resource tracker.
SPAWNED = re.compile(r"^from multiprocessing\.(spawn|resource_tracker) import")
# A script of horovodrun's kind: it, and SPAWNED, fork from the server that imported horovod.runner.
RUNNER = re.compile(r"^(import|from) +horovod\.runner\b", re.M)
LEAN = re.compile(r"^(import|from) +(hvd_runtime\.tf\b|(sklearn|matplotlib|pandas)\b)", re.M)


def horovodruns(code: str) -> bool:
    """Whether this launch is horovodrun itself or a process it starts through multiprocessing."""
    return HOROVODRUN or bool(SPAWNED.match(code))


def plain():
    os.execv(REAL, [REAL, *ARGS])


def parse():
    """(script, code, module, unbuffered), two of the first three None; or None where this is no
    launch to warm. The modules run warm are pytest (a generated project's `make test`) and
    horovodrun's own (horovod.runner.task_fn: the task service it starts on each host)."""
    unbuffered, args = False, list(ARGS)
    # -B where PYTHONDONTWRITEBYTECODE is set already (the server's flags then have it): what
    # multiprocessing adds from that flag to a DataLoader's fork server and its spawned processes.
    quiet_bytecode = bool(os.environ.get("PYTHONDONTWRITEBYTECODE"))
    while args and (args[0] == "-u" or args[0] == "-B" and quiet_bytecode):
        unbuffered, args = unbuffered or args[0] == "-u", args[1:]
    if args[:1] == ["-c"] and len(args) > 1:
        return None, args[1], None, unbuffered
    if args[:1] == ["-m"] and len(args) > 1 and (args[1] == "pytest" or args[1].startswith("horovod.runner.")):
        return None, None, args[1], unbuffered
    if not args or args[0].startswith("-") or not os.path.isfile(args[0]):
        return None
    return args[0], None, None, unbuffered


def profile_of(text: str, args: list):
    """The server to fork from: HVDGEN_WARM_PROFILE, else by the framework the script imports at its
    top level, else by the one of a generated project's train.py among `args`, named or in a folder
    named (a test's wrapper that runs `train.py` after it patched something;
    tests/projects/scripts/train_in_rank_dir.py's arguments; pytest's working folder); None where
    that is neither or both."""
    if horovodruns(text):   # (what HVDGEN_WARM_PROFILE names is the ranks')
        return "runner"
    chosen = os.environ.get("HVDGEN_WARM_PROFILE")
    if chosen:
        return chosen
    if TRACKING.match(text):
        return "tracking-torch" if args[-1:] == ["pytorch"] else "tracking"
    fork_server = FORK_SERVER.match(text)
    if fork_server:
        names = [name.strip("'\" ") for name in fork_server.group(1).split(",")]
        text = "".join(f"import {name}\n" for name in names if name)
    if not TF.search(text) and not TORCH.search(text):
        if RUNNER.search(text):
            return "runner"
        projects = [path for path in (arg if os.path.basename(arg) == "train.py" else os.path.join(arg, "train.py")
                                      for arg in args) if os.path.isfile(path)]
        if len(projects) != 1:
            return None
        with open(projects[0], "rb") as train:
            text = train.read().decode(errors="replace")
    tf, torch = TF.search(text), TORCH.search(text)
    if bool(tf) == bool(torch):
        return None
    if torch:
        return "torch"
    first = LEAN.search(text)   # TensorFlow as hvd_runtime.tf imports it, unless Keras' extras come first
    return "tf-lean" if first and first.group(2).startswith("hvd_runtime") else "tf"


def server_folder(root: str, profile: str, unbuffered: bool) -> str:
    loading = sorted((k, v) for k, v in os.environ.items() if LOAD_TIME.match(k))
    key = repr((profile, REAL, unbuffered, loading)).encode(errors="surrogateescape")
    return os.path.join(root, f"{profile}-{hashlib.sha1(key).hexdigest()[:12]}")


def start_server(folder: str, profile: str, owner: str, unbuffered: bool) -> None:
    """Start the server (detached twice: not a descendant of anything horovodrun cleans up)."""
    os.makedirs(folder, exist_ok=True)
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            log = os.open(os.path.join(folder, "server.log"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(log, 1)
            os.dup2(log, 2)
            os.closerange(3, resource.getrlimit(resource.RLIMIT_NOFILE)[0])   # none of this launch's own
            with open(os.path.join(folder, "pid"), "w") as out:
                out.write(str(os.getpid()))
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # each launch brings its own
            os.execve(REAL, [REAL, *(["-u"] if unbuffered else []), SERVER, folder, profile, owner], env)
        os._exit(0)
    os.wait()


# What a cold start's `site` imports from the import path (the server, started without
# PYTHONPATH, did not): a launch whose path has one starts cold.
STARTUP_HOOKS = ("sitecustomize", "usercustomize")


def shadows(folder: str, first: str) -> bool:
    """Whether this launch's import path would find one of the modules the server imported (its
    names file) somewhere else first: in the script's folder (or, for -c, the working folder) or a
    PYTHONPATH entry the server's path lacks. A cold start would import that one instead, and
    would run a start-up hook found there."""
    import importlib.machinery
    import json

    with open(os.path.join(folder, "names")) as names:
        served = json.load(names)
    modules, path = set(served["modules"]), set(served["path"])
    entries = os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.environ.get("PYTHONPATH") else []
    if "" in entries:
        return True   # an empty entry: the working folder, wherever the import happens
    suffixes = sorted(importlib.machinery.all_suffixes(), key=len, reverse=True)
    for entry in [first, *(os.path.abspath(e) for e in entries if os.path.abspath(e) not in path)]:
        try:
            listing = os.scandir(entry)
        except NotADirectoryError:
            return True   # a zip file on the path: not looked into
        except OSError:
            continue
        with listing:
            for item in listing:
                name = next((item.name[:-len(x)] for x in suffixes if item.name.endswith(x)), None)
                if item.is_dir() and any(os.path.exists(os.path.join(item.path, "__init__" + x)) for x in suffixes):
                    name = item.name
                if name in modules or name in STARTUP_HOOKS:
                    return True
    return False


def connect(root: str, owner: str, profile: str, unbuffered: bool, first: str):
    """A connection to the ready server of this kind, started if need be; None if it cannot serve."""
    import fcntl

    folder = server_folder(root, profile, unbuffered)
    with open(folder + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)   # one launch starts the server; the others wait for it
        if not os.path.exists(os.path.join(folder, "socket")) and not os.path.exists(os.path.join(folder, "broken")):
            start_server(folder, profile, owner, unbuffered)
        deadline = time.monotonic() + 600
        while not os.path.exists(os.path.join(folder, "socket")):
            if os.path.exists(os.path.join(folder, "broken")) or time.monotonic() > deadline:
                return None
            time.sleep(0.02)
    if shadows(folder, first):
        return None
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(os.path.join(folder, "socket"))
    except OSError:
        return None
    return connection


def launch_state(script, code, module, unbuffered) -> dict:
    ignored = set()
    for signum in range(1, signal.NSIG):
        try:
            if signal.getsignal(signum) == signal.SIG_IGN and signum not in (signal.SIGPIPE, signal.SIGXFSZ):
                ignored.add(signum)
        except (ValueError, OSError):
            pass
    limits = {}
    for name in dir(resource):
        if name.startswith("RLIMIT_"):
            limits[getattr(resource, name)] = resource.getrlimit(getattr(resource, name))
    umask = os.umask(0)
    os.umask(umask)
    if module is not None:   # (runpy puts the module's file in argv[0], as `-m` does)
        argv = ["-m", *ARGS[ARGS.index("-m") + 2:]]
    elif code is not None:
        argv = ["-c", *ARGS[ARGS.index("-c") + 2:]]
    else:
        argv = [script, *ARGS[ARGS.index(script) + 1:]]
    return {"argv": argv, "orig_argv": [REAL, *ARGS], "code": code, "module": module, "cwd": os.getcwd(),
            "env": dict(os.environ), "umask": umask, "rlimits": limits, "ignored": ignored, "blocked": signal.pthread_sigmask(signal.SIG_BLOCK, []),
            "unbuffered": unbuffered, "fds": [0, 1, 2, *INHERITED],
            # a rank's own process group (its signals to the group do not reach the server); not for
            # horovodrun's processes: its middleman starts a session, which a group's leader cannot
            "own_group": not horovodruns(code or "")}


def run(connection: socket.socket, state: dict) -> None:
    child, pending = [0], []

    def send(signum):
        try:
            os.kill(child[0], signum)
        except ProcessLookupError:   # the rank has just ended: its status is on its way
            pass

    def forward(signum, _frame):
        if child[0]:
            send(signum)
        else:
            pending.append(signum)

    for signum in FORWARDED:
        if signum not in state["ignored"]:
            signal.signal(signum, forward)
    payload = pickle.dumps(state)
    connection.sendmsg([struct.pack("!I", len(payload)) + payload],
                       [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack(f"{len(state['fds'])}i", *state["fds"]))])
    # The rank holds the inherited descriptors now, as a cold one would alone: a pipe it closes, or
    # that closes when it ends, must read as closed at the other end (horovodrun's middleman learns
    # so that horovodrun has died).
    for fd in state["fds"][3:]:
        os.close(fd)
    replies = connection.makefile("rb")
    for line in replies:
        kind, number = line.split()
        if kind == b"pid":
            child[0] = int(number)
            for signum in pending:
                send(signum)
        elif kind == b"stopped":   # as the rank is (SIGCONT, forwarded, continues both)
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == b"exit":
            os._exit(int(number))
        else:   # killed by a signal: so is this process
            signum = int(number)
            resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
            if signum != signal.SIGKILL:   # (which no process can catch, block or ignore)
                signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
                signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            os._exit(128 + signum)
    os.write(2, b"warm start: the server went away before the rank ended\n")
    if child[0]:
        send(signal.SIGKILL)
    os._exit(1)


def main() -> None:
    warm = os.environ.get("HVDGEN_WARM_START")
    parsed = parse() if warm else None
    mpi = any(k in os.environ for k in MPI_STARTED)
    if parsed is None or mpi or len(INHERITED) > 250:   # (one message carries 253 descriptors at most)
        plain()
    root, owner, netns = warm.rsplit(":", 2)
    try:
        os.kill(int(owner), 0)
        same_host = os.stat("/proc/self/ns/net").st_ino == int(netns)
    except OSError:
        same_host = False
    script, code, module, unbuffered = parsed
    if not same_host:
        plain()
    text = code or ""
    if script is not None:
        try:
            with open(script, "rb") as source:
                text = source.read().decode(errors="replace")
        except OSError:
            plain()
    if module is not None and module != "pytest":   # horovodrun's own (a host's task service)
        profile = "runner"
    else:
        profile = profile_of(text, [os.getcwd()] if module else ARGS)
    first = os.path.dirname(os.path.realpath(script)) if script is not None else os.getcwd()
    connection = connect(root, owner, profile, unbuffered, first) if profile else None
    if connection is None:
        plain()
    run(connection, launch_state(script, code, module, unbuffered))


main()
