import os
import signal
from pathlib import Path

import pytest

from helpers.budget import pytest_runtest_logreport, pytest_runtest_makereport, pytest_terminal_summary  # noqa: F401


def pytest_configure(config):
    """Every process the suite starts begins as a terminal's foreground process does: SIGINT raises
    KeyboardInterrupt and no signal is blocked, whatever state the suite itself was started in.

    A caller without job control (`nohup ./scripts/test.sh &`, a CI runner) can hand the suite
    SIGINT ignored or blocked. Children inherit both through fork and exec, and so does a tmux
    server and the command in its pane; a Ctrl-C test would then wait out its timeout."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for signum in (signal.SIGQUIT, signal.SIGTERM):
        if signal.getsignal(signum) == signal.SIG_IGN:
            signal.signal(signum, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    idle_threads_sleep()
    if not hasattr(config, "workerinput"):
        compile_sources(Path(config.rootpath))


def idle_threads_sleep() -> None:
    """Idle worker threads sleep at once in every process the suite starts, unless the caller
    chose otherwise: OpenMP's (OMP_WAIT_POLICY=PASSIVE) and numpy's OpenBLAS pool's
    (OPENBLAS_THREAD_TIMEOUT=4: 2^4 cycles of polling, not OpenBLAS' 2^28, about 0.1 s).

    The suite runs one worker more than there are cores, each starting jobs of 2 to 4 ranks: the
    cores are always shared. torch's OpenMP threads spin between parallel regions by default, and
    OpenBLAS' threads spin (sched_yield) for about 0.1 s after every numpy matrix product, taking
    the core the rank they wait for (or a Horovod loop's allreduce) needs. Both compute the same
    numbers either way; only how the idle threads wait changes (docs/testing.md has what each
    saved)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")


def compile_sources(root: Path) -> None:
    """The checkout's packages byte-compiled once, before the workers start. Under
    PYTHONDONTWRITEBYTECODE (set on some hosts) nothing writes __pycache__, and every rank, `hvdgen`
    and project test would compile hvd_runtime afresh: about 0.08 CPU-s a process. Python still
    reads the files this writes, and takes a file whose source is newer for stale."""
    import compileall

    for package in ("hvd_runtime", "hvdgen", "tests"):
        compileall.compile_dir(root / package, quiet=2)


@pytest.fixture(scope="session", autouse=True)
def warm_start():
    """Every `python` a test starts (horovodrun's ranks included) forks from a warm interpreter
    (tests/warm_start); the servers end with the session. HVDGEN_TEST_WARM_START=0 turns it off
    (to measure what it saves)."""
    import warm_start

    if os.environ.get("HVDGEN_TEST_WARM_START") == "0":
        yield None
        return
    root = warm_start.install()
    yield root
    warm_start.uninstall(root)


@pytest.fixture(autouse=True)
def plain_start(request, monkeypatch):
    """A test marked plain_start starts its processes as users do: a cold interpreter each."""
    if request.node.get_closest_marker("plain_start"):
        import warm_start

        monkeypatch.delenv(warm_start.VARIABLE, raising=False)
        monkeypatch.setenv("PATH", warm_start.without_bin_folder(os.environ["PATH"]))


@pytest.fixture(autouse=True)
def no_inherited_tracking_uri(monkeypatch):
    """mlflow.set_tracking_uri() also exports MLFLOW_TRACKING_URI; an in-process tracking test
    would otherwise point every later horovodrun job at its (by then dead) store."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)


# The files that run longest (10 to 20 minutes of one worker each, measured on a 2-core machine),
# then directories by how long their files run: minutes each for generated projects, seconds for
# the generator's and runtime's own tests.
LONGEST_FIRST = ("projects/test_documented_commands.py", "projects/test_documented_commands_tf.py",
                 "projects/test_staged_projects.py", "projects/test_workload_projects_tf.py",
                 "projects/test_fault_tolerance.py", "projects/test_workload_projects.py",
                 "projects", "multihost", "distributed", "generator", "runtime")


def pytest_collection_modifyitems(items):
    """Long files first: test.sh's two workers take whole files in this order, so they finish
    together, the short files filling the gaps at the end instead of one long file running alone."""
    def rank(item) -> int:
        path = Path(str(item.fspath))
        for key in (f"{path.parent.name}/{path.name}", path.parent.name):
            if key in LONGEST_FIRST:
                return LONGEST_FIRST.index(key)
        return len(LONGEST_FIRST)

    items.sort(key=rank)


def _generate_workloads(root: Path, framework: str) -> dict[str, Path | None]:
    from click.testing import CliRunner

    from hvdgen.cli import main as cli

    projects: dict[str, Path | None] = {"mlp": None}
    for model in ("resnet18", "gpt"):
        result = CliRunner().invoke(cli, ["new", model, "--framework", framework, "--model", model,
                                          "--output", str(root)])
        assert result.exit_code == 0, result.output
        projects[model] = root / model
    return projects


@pytest.fixture(scope="session")
def workload_projects(tmp_path_factory) -> dict[str, Path | None]:
    """Torch projects generated with --model resnet18 and --model gpt, for their model.py (mlp: the tests' own)."""
    return _generate_workloads(tmp_path_factory.mktemp("workloads"), "torch")


@pytest.fixture(scope="session")
def tf_workload_projects(tmp_path_factory) -> dict[str, Path | None]:
    """The same for TensorFlow: Keras projects generated with --model resnet18 and --model gpt."""
    return _generate_workloads(tmp_path_factory.mktemp("tf_workloads"), "tensorflow")
