"""`hvdgen slurm`: every project's slurm/train.sbatch, written again from the answers without touching
anything else; bad answers and hand-broken scripts (`--check`) get one line each and change nothing.

The script's run on a real cluster: tests/multihost/test_slurm.py.
"""

from __future__ import annotations

import dataclasses
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from hvdgen import catalog
from hvdgen.cli import main
from hvdgen.overwrite import FINGERPRINTS, fingerprint, read_fingerprints
from hvdgen.render import render_tree
from hvdgen.slurm.check import check_script
from hvdgen.slurm.layout import options_of, ranks_per_node
from hvdgen.spec import SPEC_FILE, ProjectSpec

SCRIPT = "slurm/train.sbatch"


def run(*args):
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> dict[str, Path]:
    """A data-parallel and a pipeline (2 stages x tp 2) project, made once; tests take copies."""
    root = tmp_path_factory.mktemp("pristine")
    made = {}
    for name, flags in (("data", ()), ("pipeline", ("--strategy", "pipeline", "--model", "gpt", "--tp", "2"))):
        result = run("new", f"demo-{name}", "--output", str(root), *flags)
        assert result.exit_code == 0, result.output
        made[name] = root / f"demo-{name}"
    return made


@pytest.fixture
def project(pristine, tmp_path) -> Path:
    return Path(shutil.copytree(pristine["data"], tmp_path / "data", symlinks=True))


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def directives(text: str) -> dict[str, str]:
    return dict(re.findall(r"^#SBATCH --([a-z-]+)(?:=(\S+))?", text, re.M))


SHAPES = [ProjectSpec(name="p", framework=framework, strategy=strategy, model="gpt" if strategy == "tensor" else "mlp")
          for framework, strategy in catalog.AVAILABLE] + [
    ProjectSpec(name="p", strategy="data", elastic=True),
    ProjectSpec(name="p", strategy="pipeline", model="gpt", tp=2),
    ProjectSpec(name="p", strategy="pipeline", stages=3, model="gpt"),
    ProjectSpec(name="p", strategy="tensor", model="gpt", tp=4),
    ProjectSpec(name="p", strategy="model-split", stages=3, model="resnet18"),
    ProjectSpec(name="p", strategy="data", slurm={"controller": "mpi", "gpus_per_node": 8, "nodes": 3,
                                                  "partition": "gpu", "time": "2-00:00:00", "account": "ml"}),
    ProjectSpec(name="p", strategy="pipeline", model="gpt", tp=2, slurm={"gpus_per_node": 0, "tasks_per_node": 4}),
]


@pytest.mark.parametrize("spec", SHAPES, ids=lambda s: f"{s.framework}-{s.strategy}-{s.model}-tp{s.tp}-"
                                                    f"{'elastic' if s.elastic else s.slurm.get('controller', 'gloo')}")
def test_every_project_gets_a_script_that_fits_its_layout(tmp_path, spec):
    """The directives hold the layout's numbers, bash parses the script, and its own --check passes."""
    assert render_tree(spec, tmp_path, only="slurm") == ["slurm/logs/.gitignore", SCRIPT]
    text = (tmp_path / SCRIPT).read_text()
    assert text.startswith("#!/bin/bash\n") and (tmp_path / SCRIPT).stat().st_mode & 0o111
    subprocess.run(["bash", "-n", str(tmp_path / SCRIPT)], check=True)
    opts = options_of(spec)
    per_node = ranks_per_node(spec, opts)
    d = directives(text)
    assert int(d["nodes"]) == opts.nodes and int(d["ntasks-per-node"]) == per_node
    assert d.get("gpus-per-node") == (str(opts.gpus_per_node) if opts.gpus_per_node else None)
    assert (opts.nodes * per_node) % spec.model_ranks == 0 and per_node % spec.tp == 0
    assert d["signal"] == "B:USR1@120" and "requeue" in d and d["open-mode"] == "append"
    assert ("no-kill" in d) == spec.elastic
    for key in ("partition", "time", "account"):
        assert d.get(key) == (getattr(opts, key) or None)
    launch = re.search(r"^launch=\((\S+)", text, re.M).group(1)
    assert launch == ("srun" if opts.controller == "mpi" else "horovodrun")
    (tmp_path / "slurm" / "logs").mkdir(exist_ok=True)
    assert check_script(text, spec, SCRIPT, tmp_path, mpi_built=True) == []


def test_the_command_writes_only_the_script_and_its_answers(project):
    (project / "train.py").write_text((project / "train.py").read_text() + "\n# my change\n")
    before, spec_before = snapshot(project), yaml.safe_load((project / SPEC_FILE).read_text())
    result = run("slurm", "--project", str(project), "--nodes", "4", "--gpus-per-node", "8", "--partition", "gpu",
                 "--time", "1-00:00:00", "--account", "ml-team", "--controller", "mpi", "--grace-s", "300")
    assert result.exit_code == 0, result.output
    after = snapshot(project)
    changed = {rel for rel in before.keys() | after.keys() if before.get(rel) != after.get(rel)}
    assert changed == {SCRIPT, SPEC_FILE, FINGERPRINTS}, changed
    assert not list(project.glob(".hvdgen-slurm-*")), "staging folder left behind"
    spec_after = yaml.safe_load((project / SPEC_FILE).read_text())
    assert {k: v for k, v in spec_after.items() if k != "slurm"} == {k: v for k, v in spec_before.items() if k != "slurm"}
    text = (project / SCRIPT).read_text()
    assert {k: directives(text).get(k) for k in ("nodes", "ntasks-per-node", "gpus-per-node", "partition", "time",
                                                 "account", "signal")} == {
        "nodes": "4", "ntasks-per-node": "8", "gpus-per-node": "8", "partition": "gpu", "time": "1-00:00:00",
        "account": "ml-team", "signal": "B:USR1@300"}
    assert "launch=(srun --mpi=pmix" in text
    assert read_fingerprints(project)[SCRIPT] == fingerprint(project / SCRIPT), "the new script is not hvdgen's own"
    # options left out keep the recorded answers
    assert run("slurm", "--project", str(project), "--nodes", "2").exit_code == 0
    assert {k: directives((project / SCRIPT).read_text()).get(k) for k in ("nodes", "ntasks-per-node", "account")} \
        == {"nodes": "2", "ntasks-per-node": "8", "account": "ml-team"}
    assert run("slurm", "--project", str(project), "--check").exit_code == 0


REFUSED = [
    ("data", ["--nodes", "0"], "--nodes must be between 1 and 1024, got 0: e.g. --nodes 2"),
    ("data", ["--gpus-per-node", "-1"], "--gpus-per-node must be between 0 and 64, got -1: e.g. --gpus-per-node 4"),
    ("pipeline", ["--gpus-per-node", "3"], "tensor parallelism keeps each group of tp 2 ranks on one node (they "
                                            "exchange activations in every layer), so --gpus-per-node 3 must be a "
                                            "multiple of 2: use e.g. --gpus-per-node 2"),
    ("pipeline", ["--gpus-per-node", "2", "--nodes", "3"], "--nodes 3 x 2 ranks per node (--gpus-per-node 2) is 6 "
                                                           "ranks, not a multiple of the pipeline's 2 stages x tp 2: "
                                                           "use e.g. --nodes 4"),
    ("data", ["--controller", "nccl"], "Invalid value for '--controller': 'nccl' is not one of 'gloo', 'mpi'."),
    ("data", ["--tasks-per-node", "2"], "--tasks-per-node is for CPU nodes: with --gpus-per-node 4 a node runs one "
                                        "rank per GPU; leave it out, or give --gpus-per-node 0"),
    ("data", ["--time", "tomorrow"], "--time 'tomorrow' is not a Slurm time limit: use minutes, HH:MM:SS or "
                                     "D-HH:MM:SS (e.g. --time 1-00:00:00)"),
    ("data", ["--time", "2", "--grace-s", "120"], "--time 2 leaves no training before the stop signal 120 s ahead "
                                                  "of it: give a longer --time, or a --grace-s below 120"),
    ("data", ["--partition", "gpu a"], "--partition 'gpu a' is not a Slurm partition name"),
    ("data", ["--file", "x.sbatch"], "--file works with --check only: add --check"),
    ("data", ["--check", "--nodes", "2"], "--check changes nothing, so --nodes do not apply: leave them out"),
]


@pytest.mark.parametrize("kind, args, message", REFUSED, ids=[" ".join(a) for _, a, _ in REFUSED])
def test_bad_answers_get_one_line_and_change_nothing(pristine, tmp_path, kind, args, message):
    project = Path(shutil.copytree(pristine[kind], tmp_path / kind, symlinks=True))
    before = snapshot(project)
    proc = subprocess.run([sys.executable, "-m", "hvdgen", "slurm", *args], cwd=project, capture_output=True, text=True)
    assert proc.returncode != 0 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert message in line, line
    assert snapshot(project) == before


def test_an_elastic_project_is_refused_an_mpi_launch(tmp_path):
    assert run("new", "el", "--output", str(tmp_path), "--elastic").exit_code == 0
    before = snapshot(tmp_path / "el")
    proc = subprocess.run([sys.executable, "-m", "hvdgen", "slurm", "--controller", "mpi"], cwd=tmp_path / "el", capture_output=True,
                          text=True)
    assert proc.returncode == 1 and proc.stderr.splitlines() == [
        "Error: elastic Horovod runs on Gloo only (horovodrun's elastic mode has no MPI launch): use --controller "
        "gloo, or a project made without --elastic for an MPI job"]
    assert snapshot(tmp_path / "el") == before


def _edit(old: str, new: str):
    def edit(text: str) -> str:
        assert old in text, old
        return text.replace(old, new, 1)
    return edit


# (project, edit of its generated script, the one problem --check names)
BROKEN = [
    ("data", _edit("#SBATCH --nodes=2\n", ""), "no #SBATCH --nodes"),
    ("data", _edit("#SBATCH --ntasks-per-node=4\n", ""), "no #SBATCH --ntasks-per-node"),
    ("data", _edit("--ntasks-per-node=4", "--ntasks-per-node=2"),
     "--ntasks-per-node=2 with 4 GPUs a node: data runs one rank per GPU, so write --ntasks-per-node=4"),
    ("pipeline", lambda t: t.replace("--nodes=2", "--nodes=4").replace("--gpus-per-node=4", "--gpus-per-node=3")
     .replace("--ntasks-per-node=4", "--ntasks-per-node=3"), "splits tensor-parallel groups of tp 2"),
    ("pipeline", lambda t: t.replace("--nodes=2", "--nodes=1").replace("--gpus-per-node=4", "--gpus-per-node=2")
     .replace("--ntasks-per-node=4", "--ntasks-per-node=2"), "is 2 ranks, not whole copies of the model"),
    ("data", _edit("#SBATCH --requeue\n", ""), "the job is not requeueable: add #SBATCH --requeue"),
    ("data", _edit("--signal=B:USR1@120", "--signal=USR1@120"),
     "--signal=USR1@120 signals the job's steps, not this script"),
    ("data", _edit("#SBATCH --signal=B:USR1@120\n", ""), "nothing sends it before the time limit"),
    ("data", _edit("#SBATCH --open-mode=append\n", ""), "would truncate the job's output file"),
    ("data", _edit("--output=slurm/logs/%x-%j.out", "--output=out/%x-%j.out"),
     "the folder out does not exist, and Slurm would fail the job without a word"),
    ("data", _edit('launch=(horovodrun -np "$SLURM_NTASKS"', 'launch=(horovodrun -np 16'),
     "horovodrun -np 16 is not the job's --nodes 2 x --ntasks-per-node 4"),
    ("data", _edit('launch=(horovodrun -np "$SLURM_NTASKS" -H "${hosts%,}" --start-timeout 120 --gloo', "launch=(srun"),
     "srun starts the ranks without an MPI plugin"),
    ("data", _edit('#SBATCH --requeue\n', "#SBATCH --requeue\n#SBATCH --time=1:00\n"),
     "--signal=B:USR1@120 comes 120 s before a --time of 60 s"),
    ("data", lambda t: re.sub(r"^launch=\(.*\)$", "launch=(true)", t, flags=re.M), "no line starts the ranks"),
]


@pytest.mark.parametrize("kind, edit, message", BROKEN, ids=[m[:40] for _, _, m in BROKEN])
def test_check_names_each_broken_script_in_one_line(pristine, tmp_path, kind, edit, message):
    project = Path(shutil.copytree(pristine[kind], tmp_path / kind, symlinks=True))
    script = project / SCRIPT
    script.write_text(edit(script.read_text()))
    before = snapshot(project)
    result = run("slurm", "--project", str(project), "--check")
    assert result.exit_code == 1
    [line] = result.stderr.splitlines()
    assert line.startswith(f"{script}:") and message in line, line
    assert snapshot(project) == before


def test_check_reads_another_file_and_finds_an_mpi_launch_without_mpi(pristine, tmp_path):
    spec = dataclasses.replace(ProjectSpec.from_yaml((pristine["data"] / SPEC_FILE).read_text()),
                               slurm={"controller": "mpi"})
    render_tree(spec, tmp_path, only="slurm")
    text = (tmp_path / SCRIPT).read_text()
    assert check_script(text, spec, "x", tmp_path, mpi_built=True) == []
    [problem] = check_script(text, spec, "x", tmp_path, mpi_built=False)
    assert "the Horovod here was built without MPI" in str(problem)
    result = run("slurm", "--project", str(pristine["data"]), "--check", "--file", str(tmp_path / SCRIPT))
    assert result.exit_code == 0, result.output
