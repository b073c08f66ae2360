"""Every command a generated project documents runs, for every framework, strategy and shape.

For each shape, the commands are read out of the project itself: the ```bash blocks of README.md
and k8s/README.md, the launch lines of train.py's docstring, and the Makefile's targets. Each one
that can run on one CPU host is run verbatim from the project folder (config.yaml trains one
epoch without tracking, which has tests of its own, so the run is short); each one that cannot is
named with its reason, and an unknown kind of command fails the test, so new documentation cannot
slip past it.

`make ui` serves the project's MLflow store and nothing else, so it runs in the first shape only.
A one-node GPU line needs its GPUs; its rank count is held to the runtime's placement rules.
Commands that only add options whose handling does not depend on the strategy (your own data,
config overrides: data.py and hvd_runtime.config are the same in every shape) run once per
framework, in the data-parallel shape; the other shapes must show them as exactly the launch line
they run themselves plus the same options. A model other than the MLP runs its own data commands
(the model reads their shapes), narrow (config.yaml's ResNet-18 width 8), but not the training
options again. A command another test runs in the same shape with more
checks (`run_elsewhere`: the default shape's `make test`, a 2-stage pipeline's replicas) is named
with that test instead of run twice.

Cost: over 6% of the suite's CPU (docs/testing.md): the torch half of the check above; the same
reasons.
"""

from __future__ import annotations

import ast
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from helpers import free_port, python_command, venv_env
from hvdgen.cli import main
from test_staged_projects import RUNS as staged_runs

pytestmark = pytest.mark.slow

SHAPES = [(framework, *shape) for framework in ("torch", "tensorflow") for shape in (
    ("data", ()), ("data", ("--elastic",)), ("model-split", ()), ("pipeline", ()), ("pipeline", ("--stages", "4")))]
# The models other than the MLP change model.py, data.py, config.yaml and the README's model and
# data sections; their strategy parts are the MLP's, run above.
SHAPES += [(framework, "data", ("--model", model)) for framework in ("torch", "tensorflow") for model in ("resnet18", "gpt")]
# Tensor parallelism splits the GPT, its default model.
SHAPES += [(framework, "tensor", ()) for framework in ("torch", "tensorflow")]

# Commands that need more than this machine, and where they are exercised instead.
NOT_HERE = (
    (r"-H node\d|HVD_HOSTS=\"node", "several hosts: see the multi-host tests"),
    (r"^kubectl ", "a Kubernetes cluster: the manifests are validated against the CRD schema in tests/generator"),
    (r"^sbatch slurm/train\.sbatch( --\S+ \S+)*$", "a Slurm cluster: tests/multihost/test_slurm.py submits the "
                                                    "script this way, with train.py's options after it"),
    (r"^docker ", "a Docker daemon: the image's build script runs in tests/projects/test_outside_checkout.py"),
    (r"^python -m venv|^make setup", "a fresh environment: run in tests/projects/test_outside_checkout.py"),
)


def bash_blocks(markdown: str) -> list[str]:
    """The commands of a markdown file's ```bash blocks: continuations joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.S):
        for command in block.replace("\\\n", " ").splitlines():
            command = re.sub(r"\s+#.*$", "", command).strip()
            if command and not command.startswith("#"):
                commands.append(re.sub(r"\s+", " ", command))
    return commands


def docstring_commands(train_py: str) -> list[str]:
    doc = ast.get_docstring(ast.parse(train_py)) or ""
    lines = doc.replace("\\\n", " ").splitlines()
    return [re.sub(r"\s+", " ", re.sub(r"\s+#.*$", "", line)).strip() for line in lines
            if re.match(r'(\w+=("[^"]*"|\S+) +)*horovodrun ', line.strip())]  # with its environment, if any


def documented_commands(project: Path) -> list[str]:
    commands = bash_blocks((project / "README.md").read_text())
    commands += bash_blocks((project / "k8s" / "README.md").read_text())
    commands += docstring_commands((project / "train.py").read_text())
    targets = re.findall(r"^([a-z]+):.*## ", (project / "Makefile").read_text(), re.M)
    commands += [f"make {target}" for target in targets]
    return list(dict.fromkeys(commands))  # each once, in order


GPU_NODE_LINE = re.compile(r"horovodrun -np (\d+) -H localhost:\1 python train\.py$")


def gpu_node_fits(command: str, strategy: str, stages: int) -> bool:
    """A one-node GPU line (`horovodrun -np N -H localhost:N python train.py  # one node, G GPUs`)
    needs G GPUs to run; here it is held to the rules the runtime applies at start-up instead:
    a pipeline's ranks are a multiple of its stages, a tensor-parallel job's of its tp (2 here),
    and model-split's ranks each find their stages' GPUs on the node (hvd_runtime.devices.stage_gpus)."""
    from hvd_runtime.devices import stage_gpus

    ranks = int(GPU_NODE_LINE.match(command).group(1))
    gpus = ranks * (stages if strategy == "model-split" else 1)
    if strategy == "pipeline":
        return ranks % stages == 0
    if strategy == "tensor":
        return ranks % 2 == 0
    if strategy == "model-split":
        return all(stage_gpus(stages, rank, ranks, gpus) for rank in range(ranks))
    return True



def run_elsewhere(command: str, framework: str, strategy: str, extra: tuple[str, ...]) -> str | None:
    """Where another test runs this very command in this very shape, with more checks: there, not twice."""
    if command == "make test" and strategy == "data" and not extra:
        return "the default shape's tests: run in tests/projects/test_outside_checkout.py, in a fresh environment"
    replicas_line = "horovodrun -np 4 -H localhost:4 --gloo python train.py"
    if command == replicas_line and not extra and (framework, strategy, 4, []) in staged_runs:
        return "2 stages x 2 replicas: trained in tests/projects/test_staged_projects.py, each rank in its own folder"
    return None


def expand(command: str, cpu_launch: str) -> str:
    """The docstring's `horovodrun ... python train.py --x y` stands for any launch line: use the CPU one."""
    return command.replace("horovodrun ... python train.py", cpu_launch)


def write_user_data(project: Path) -> None:
    """The files the README's own-data commands name: my_data.npz, images/<class>/<file>, my_corpus.txt."""
    from PIL import Image
    from sklearn.datasets import load_digits

    (project / "my_corpus.txt").write_text((project / "README.md").read_text() * 3)
    digits = load_digits()
    np.savez(project / "my_data.npz", x=digits.images.astype("float32") / 16.0, y=digits.target)
    for label in range(3):
        (project / "images" / str(label)).mkdir(parents=True)
        for i, image in enumerate(digits.images[digits.target == label][:24]):
            Image.fromarray((image * 15).astype("uint8")).resize((16, 16)).save(
                project / "images" / str(label) / f"{i}.png")


def run_ui(command: str, project: Path, env: dict) -> None:
    """`make ui` serves until stopped: it must answer on its port, then it is stopped."""
    port = free_port()
    proc = subprocess.Popen(shlex.split(command) + [f"PYTHON={sys.executable}", f"PORT={port}"], cwd=project,
                            start_new_session=True, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=2) as response:
                    assert response.status == 200
                    return
            except OSError:
                time.sleep(0.5)
        pytest.fail("make ui did not answer within 120 s")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)


def shapes_of(framework: str) -> list[tuple]:
    return [shape for shape in SHAPES if shape[0] == framework]


def shape_id(shape: tuple) -> str:
    framework, strategy, extra = shape
    return f"{framework}-{strategy}{''.join(extra).replace('--', '-')}"


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("framework, strategy, extra", shapes_of("torch"), ids=map(shape_id, shapes_of("torch")))
def test_every_documented_command_runs(tmp_path, framework, strategy, extra):
    every_documented_command_runs(tmp_path, framework, strategy, extra)


def every_documented_command_runs(tmp_path: Path, framework: str, strategy: str, extra: tuple[str, ...]) -> None:
    """The whole check for one shape (test_documented_commands_tf.py runs the TensorFlow shapes)."""
    result = CliRunner().invoke(main, ["new", "proj", "-o", str(tmp_path), "--framework", framework,
                                       "--strategy", strategy, *extra], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    project = tmp_path / "proj"
    config = project / "config.yaml"
    text = re.sub(r"^  epochs: \d+", "  epochs: 1", config.read_text(), count=1, flags=re.M)
    text = re.sub(r"^  width: 64 ", "  width: 8  ", text, count=1, flags=re.M)  # the narrowest models: the check is that commands run
    config.write_text(re.sub(r"^(tracking:\n  enabled:) true", r"\1 false", text, flags=re.M))
    write_user_data(project)
    env = venv_env()

    commands = documented_commands(project)
    cpu_launch = next(c for c in commands if c.startswith("horovodrun") and "--gloo python train.py" in c
                      and "localhost" in c).split(" python train.py")[0] + " python train.py"
    # `make train` is the CPU launch line under the retry launcher, which makes no restart by default
    # (make -n shows what it would run): one run serves both. RESTARTS=3 is the README's retry line.
    def make_train(*options: str) -> list[str]:
        return subprocess.run(["make", "-n", "train", "PYTHON=python", "HOROVODRUN=horovodrun", *options],
                              cwd=project, capture_output=True, text=True, check=True).stdout.strip().splitlines()

    dry, retry_line = make_train(), f"python -m hvd_runtime.retry --max-restarts 3 -- {cpu_launch}"
    assert dry[-1] == f"python -m hvd_runtime.retry --max-restarts 0 -- {cpu_launch}", \
        f"make train runs {dry!r}, the README shows {cpu_launch!r}"
    assert retry_line in commands and make_train("RESTARTS=3")[-1] == retry_line
    gpt = "gpt" in extra or strategy == "tensor"
    # before it, only a GPT project's data: made from the standard library when data/tokens is missing
    assert dry[:-1] == (["python prepare_tokens.py --out data/tokens"] if gpt else []), dry
    ran, skipped = [cpu_launch], {}
    for command in dict.fromkeys(expand(c, cpu_launch) for c in commands):  # each once, as it runs
        if command in (cpu_launch, retry_line):   # the retry line: make train's, with RESTARTS=3
            continue
        reason = (next((why for pattern, why in NOT_HERE if re.search(pattern, command)), None)
                  or run_elsewhere(command, framework, strategy, extra))
        if reason:
            skipped[command] = reason
            continue
        options = command.removeprefix(cpu_launch)
        if strategy != "data" and options != command and options.startswith(" --"):
            ran.append(command)  # the launch line this shape runs anyway, plus shape-independent options
            continue
        if "--model" in extra and options != command and options.startswith(" --") and "--data." not in options:
            ran.append(command)  # training options the MLP's data shape runs; data options depend on the model
            continue
        if GPU_NODE_LINE.match(command):  # one GPU per rank (model-split: per stage): not on this machine
            stages = 2 if "--stages" not in extra else int(extra[extra.index("--stages") + 1])
            assert gpu_node_fits(command, strategy, stages), command
            skipped[command] = "GPUs: checked against the runtime's placement rules"
            continue
        if command == "make ui":
            if (framework, strategy, extra) == SHAPES[0]:  # serves the MLflow store: the same in every shape
                run_ui(command, project, env)
        elif re.match(r"(horovodrun|make|hvdgen|python prepare_tokens\.py) ", command):
            if "--data." in command:  # other data is a new training: a user's checkpoints would not fit it
                shutil.rmtree(project / "checkpoints", ignore_errors=True)
            if command.startswith("make"):   # this interpreter (as the tests' `python` while the warm start is on)
                command += f" PYTHON={python_command([sys.executable])[0]}"
            proc = subprocess.run(command, shell=True, cwd=project, env=env, capture_output=True, text=True,
                                  timeout=600)
            assert proc.returncode == 0, f"{command}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
            if "--data." in command:  # its checkpoints belong to that data, not to the next command's
                shutil.rmtree(project / "checkpoints", ignore_errors=True)
        else:
            pytest.fail(f"the project documents a command this test does not know how to run: {command}")
        ran.append(command)

    assert any(c.startswith("make train") for c in ran)
    if strategy == "data" and not extra:  # the default shape's make test: test_outside_checkout runs it
        assert skipped.get("make test", "").startswith("the default shape's tests"), skipped
    else:
        assert any(c.startswith("make test") for c in ran)
    assert any(c == cpu_launch for c in ran), "the CPU launch line itself runs in every shape"
    if gpt:
        assert any(c.startswith("python prepare_tokens.py my_corpus.txt") for c in ran)
        assert (project / "data" / "tokens" / "meta.json").is_file()
    else:
        assert any("--data.source npz" in c for c in ran) and any("--data.source image_folder" in c for c in ran)
    if "--elastic" in extra:
        assert any("--host-discovery-script ./discover_hosts.sh" in c and "-H node" not in c for c in ran)
    assert all(reason for reason in skipped.values())
