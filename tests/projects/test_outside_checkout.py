"""A generated project works away from this checkout, as a user gets it on another machine.

For each framework: generate a project, copy it to a folder of its own, then, with nothing of
this checkout on PATH or PYTHONPATH, run its image build script (`docker/build-env.sh`, what both
Dockerfiles run) into a fresh virtualenv, then `make setup` and `make test` with that
virtualenv's Python. hvdgen must come from the wheel the project carries, not from any index or
from this checkout; Horovod is built (or taken from the user's cache) for that environment.

The build scripts of all frameworks start together, when the first test needs one: each is a
pip install of about 2 GB of packages on one core, minutes long, and they do not share a venv.

Cost: over 6% of the suite's CPU (docs/testing.md), nearly all of it pip installing the frameworks
into the two fresh environments (the point of the test: nothing of this checkout's), once per run,
both side by side.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner

import warm_start
from hvdgen import __version__, catalog
from hvdgen.cli import main

pytestmark = pytest.mark.slow
CHECKOUT = Path(__file__).resolve().parents[2]


def _clean_env(venv: Path) -> dict[str, str]:
    """The user's environment: this checkout's virtualenv, sources and the tests' warm start are
    nowhere on the paths."""
    ours = str(Path(sys.executable).parent)
    path = [p for p in warm_start.without_bin_folder(os.environ.get("PATH", "")).split(os.pathsep) if p and p != ours]
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME", warm_start.VARIABLE)}
    env["PATH"] = os.pathsep.join([str(venv / "bin"), *path])
    return env


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


@dataclass
class Moved:
    """A generated project copied away from the checkout, and its image build script, running."""

    project: Path
    venv: Path
    env: dict[str, str]
    build: subprocess.Popen
    log: Path               # the build's output: a file, so a long build log never blocks it on a full pipe

    def built(self) -> None:
        """Wait for the build script; it must have succeeded."""
        try:
            self.build.wait(timeout=1500)
        except subprocess.TimeoutExpired:
            self.build.kill()
            raise
        assert self.build.returncode == 0, f"docker/build-env.sh {self.venv}\n{self.log.read_text()[-6000:]}"


@pytest.fixture(scope="module")
def moved_projects(tmp_path_factory) -> Iterator[dict[str, Moved]]:
    """Per framework, the project moved elsewhere, its build script started; all build at once."""
    moved = {}
    for framework in catalog.FRAMEWORKS:
        root = tmp_path_factory.mktemp(framework)
        made = root / "made"
        result = CliRunner().invoke(main, ["new", "moved", "-o", str(made), "--framework", framework],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output
        project = root / "elsewhere" / "moved"
        shutil.copytree(made / "moved", project, symlinks=True)
        shutil.rmtree(made)
        venv = root / "env"
        env = _clean_env(venv)
        # The images' build steps, run as the Dockerfiles run them (minus the system packages).
        log = root / "build-env.log"
        with log.open("w") as out:
            # pip's options pass through its environment (as the script says): no byte-compiling
            # of the ~12,000 modules it installs, which only the first import of each would use.
            build = subprocess.Popen(["docker/build-env.sh", str(venv)], cwd=project,
                                     env=dict(env, PYTHON=sys.executable, PIP_COMPILE="false"),
                                     stdout=out, stderr=subprocess.STDOUT)
        moved[framework] = Moved(project, venv, env, build, log)
    yield moved
    for each in moved.values():
        if each.build.poll() is None:
            each.build.kill()
            each.build.wait()


@pytest.mark.parametrize("framework", catalog.FRAMEWORKS)
def test_project_sets_up_and_passes_its_tests_away_from_the_checkout(moved_projects, framework):
    moved = moved_projects[framework]
    project, venv, env = moved.project, moved.venv, moved.env
    python = str(venv / "bin" / "python")
    moved.built()
    # Then the README's set-up and test commands.
    _run(["make", "setup", f"PYTHON={python}"], project, env, timeout=600)
    tests = _run(["make", "test", f"PYTHON={python}"], project, env, timeout=600)
    assert " passed" in tests.stdout and "failed" not in tests.stdout, tests.stdout[-2000:]
    logged = [name for name in ("mlflow.db", "mlruns") if (project / name).exists()]
    assert not logged, f"make test logged its runs into the project's MLflow store: {logged}"

    where = _run([python, "-c", "import hvd_runtime, hvdgen; print(hvd_runtime.__file__); print(hvdgen.__file__)"],
                 project, env, timeout=60).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), f"imported from outside the venv: {where}"
    origin = json.loads(_run([python, "-c", "from importlib import metadata; "
                              "print(metadata.distribution('hvdgen').read_text('direct_url.json'))"],
                             project, env, timeout=60).stdout)
    assert origin["url"] == (project / "wheels" / f"hvdgen-{__version__}-py3-none-any.whl").as_uri()
    assert not Path(origin["url"].removeprefix("file://")).is_relative_to(CHECKOUT)
    build = _run([str(venv / "bin" / "horovodrun"), "--check-build"], project, env, timeout=120).stdout
    assert f"[X] {'PyTorch' if framework == 'torch' else 'TensorFlow'}" in build
