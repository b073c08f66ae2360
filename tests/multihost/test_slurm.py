"""A generated project's slurm/train.sbatch, submitted as it is to a real Slurm cluster (tests/helpers/slurm_cluster.py).

munged, slurmctld and two slurmd nodes, each in a network namespace of its own; the project sits
on the filesystem every node shares, as on a cluster's shared home. Each job is the project's
script, written by `hvdgen slurm` for CPU nodes of 2 ranks each, submitted with sbatch from the
controller (the login node) with train.py's arguments after it:

- data parallel, 4 ranks over the 2 nodes: torch with Gloo (one horovodrun on the batch node,
  ssh to the other) and with MPI (`srun --mpi=pmix`), TensorFlow with Gloo, an elastic torch
  project (horovodrun's elastic mode, the hosts from the allocation); a torch pipeline of 2
  stages x 2 replicas. Each ends COMPLETED with exit 0; its ranks ran on both nodes, and end with
  the same weights (a digest per rank at every checkpoint); only rank 0 reports.
- requeue: `scancel --signal=USR1 --batch` while rank 1 is held after step 4 of its first start:
  the script tells the ranks on its node, every rank (those on the other node too) stops at the
  next log point with a checkpoint, the script requeues the job, and the job's second start resumes
  there and ends with the metrics and weights of the same script's uninterrupted run (1e-5), in
  the same MLflow run.

Cost: every rank starts cold (it runs in another network namespace, which the warm start does not
serve), and a job waits a scheduler's round to start; the cluster starts once for the file.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from helpers import venv_env
from hvdgen.slurm.check import mpi_built
from helpers.slurm_cluster import SlurmCluster, why_unavailable
from test_launcher_across_hosts import DIGESTS, mpi_missing

pytestmark = pytest.mark.slow

# Appended to the digests hook: each rank names its node, and in the job's first start rank 1
# holds HVDT_HOLD_S seconds once it has trained HVDT_HOLD_AT steps (marking it in HVDT_HELD).
WHERE_AND_HOLD = '''
if RANK is not None:
    import socket
    (out / f"host-rank{rank}").write_text(socket.gethostname())
    if rank == 1 and os.environ.get("HVDT_HOLD_AT") and os.environ.get("SLURM_RESTART_COUNT", "0") == "0":
        import importlib, time
        batches = importlib.import_module(
            f"hvd_runtime.{'torch' if os.environ['HVDT_FRAMEWORK'] == 'torch' else 'tf'}.batches").ShardedBatches
        original, trained = batches.batches, [0]

        def holding(self, *args, **kwargs):
            for batch in original(self, *args, **kwargs):
                if self.train:
                    if trained[0] == int(os.environ["HVDT_HOLD_AT"]):
                        Path(os.environ["HVDT_HELD"]).write_text(str(os.getpid()))
                        time.sleep(float(os.environ["HVDT_HOLD_S"]))
                    trained[0] += 1
                yield batch

        batches.batches = holding
'''
TRAIN = ["--train.epochs", "2", "--data.source", "synthetic", "--data.synthetic_samples", "512",
         "--checkpoint.every_steps", "2"]
# 13 steps an epoch on 4 ranks: rank 1 held after step 4, the ranks stop at the log point of step 10.
REQUEUED = ["--train.epochs", "2", "--data.source", "synthetic", "--data.synthetic_samples", "2048"]


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    problem = why_unavailable()
    if problem:
        pytest.skip(f"Requires a Slurm cluster of namespaces: {problem}")
    made = SlurmCluster(tmp_path_factory.mktemp("slurm") / "cluster", tag=f"hvs{os.getpid() % 100000}")
    try:
        made.up(nodes=2)
        yield made
    finally:
        made.down()


def slurm_project(tmp_path: Path, framework: str, strategy: str, *slurm_flags: str, elastic: bool = False) -> Path:
    """A project named proj, its script written for CPU nodes of 2 ranks each."""
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--framework", framework, "--strategy", strategy,
                    "--output", str(tmp_path), *(["--elastic"] if elastic else [])], check=True, capture_output=True)
    project = tmp_path / "proj"
    subprocess.run([sys.executable, "-m", "hvdgen", "slurm", "--gpus-per-node", "0", "--tasks-per-node", "2",
                    *slurm_flags], cwd=project, check=True, capture_output=True)
    return project


def submit(slurm: SlurmCluster, project: Path, tmp_path: Path, framework: str, *args: str, **env: str):
    """The project's script as generated, with train.py's arguments; (job id, output file, digests)."""
    hooks, digests = tmp_path / "hooks", tmp_path / "digests"
    hooks.mkdir(parents=True, exist_ok=True)
    digests.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(DIGESTS + WHERE_AND_HOLD)
    job = slurm.submit("slurm/train.sbatch", list(args), cwd=project, env=venv_env(
        PYTHONPATH=str(hooks), HVDT_DIGESTS=str(digests), HVDT_FRAMEWORK=framework, TF_CPP_MIN_LOG_LEVEL="2", **env))
    return job, project / "slurm" / "logs" / f"proj-{job}.out", digests


def ranks_agree(digests: Path, parts: dict[str, list[int]], in_order: bool = True) -> None:
    """Each part's ranks wrote one digest; two ranks ran on each node: 0-1 on n1, 2-3 on n2, but
    where horovodrun's elastic mode numbers the hosts in an order of its own."""
    found: dict[str, dict[int, str]] = {}
    for path in digests.iterdir():
        part, rank = path.name.rsplit("-rank", 1)
        found.setdefault(part, {})[int(rank)] = path.read_text()
    hosts = found.pop("host")
    if in_order:
        assert hosts == {0: "n1", 1: "n1", 2: "n2", 3: "n2"}, hosts
    else:
        assert sorted(hosts) == [0, 1, 2, 3] and sorted(hosts.values()) == ["n1", "n1", "n2", "n2"], hosts
    assert {part: sorted(ranks) for part, ranks in found.items()} == parts
    for part, ranks in found.items():
        assert len(set(ranks.values())) == 1, f"the ranks' {part} weights differ across nodes: {ranks}"


CASES = [("torch", "data", "gloo"), ("torch", "data", "mpi"), ("tensorflow", "data", "gloo"),
         ("torch", "pipeline", "gloo"), ("torch", "elastic", "gloo")]


@pytest.mark.parametrize("framework, strategy, controller", CASES, ids=["-".join(case) for case in CASES])
def test_the_generated_script_trains_across_nodes(slurm, tmp_path, framework, strategy, controller):
    """elastic: a data-parallel project made with --elastic, whose horovodrun finds the hosts with
    discover_hosts.sh, fed from the allocation."""
    if controller == "mpi":
        if mpi_missing():
            pytest.skip(f"Requires: Horovod with MPI: {mpi_missing()}")
        assert mpi_built(), "hvdgen slurm --check would take this Horovod for one without MPI"
    elastic = strategy == "elastic"
    project = slurm_project(tmp_path, framework, "data" if elastic else strategy, "--controller", controller,
                            elastic=elastic)
    job, output, digests = submit(slurm, project, tmp_path, framework, *TRAIN, "--tracking.enabled", "false")
    ended = slurm.wait(job, output)
    assert (ended.state, ended.exit_code, ended.restarts) == ("COMPLETED", "0:0", 0), ended.output[-4000:]
    started = "pipeline of 2 stages x 2 replica(s)" if strategy == "pipeline" else "training on 4 rank(s)"
    assert started in ended.output and re.search(r"epoch\s+2\b.*val_", ended.output), ended.output[-4000:]
    assert f"slurm: job {job}, start 1, on n1 n2" in ended.output
    # what the README tells users to run: this submission, without or with train.py's options
    readme = re.findall(r"^(sbatch .*?)\s+#", (project / "README.md").read_text(), re.M)
    assert readme == ["sbatch slurm/train.sbatch", "sbatch slurm/train.sbatch --train.epochs 20"], readme
    reports = re.findall(r"^(.*)epoch\s+\d+\s+step", ended.output, re.M)
    # only rank 0 reports: Gloo tags its lines [0]<stdout>:, srun passes them untagged
    assert reports == (["[0]<stdout>:"] * 2 if controller == "gloo" else [""] * 2), ended.output[-3000:]
    ranks_agree(digests, {"stage0": [0, 2], "stage1": [1, 3]} if strategy == "pipeline" else {"model": [0, 1, 2, 3]},
                in_order=not elastic)


def test_a_stop_before_the_time_limit_requeues_the_job_and_it_resumes_exactly(slurm, tmp_path):
    project = slurm_project(tmp_path, "torch", "data")
    runs = {}
    for name in ("straight", "requeued"):
        tracking = f"sqlite:///{tmp_path / name}.db"
        hold = {"HVDT_HOLD_AT": "4", "HVDT_HOLD_S": "6", "HVDT_HELD": str(tmp_path / "held")} \
            if name == "requeued" else {}
        job, output, _ = submit(slurm, project, tmp_path / name, "torch", *REQUEUED, "--tracking.uri", tracking,
                                "--run_dir", str(tmp_path / name / "run"),
                                "--checkpoint.dir", str(tmp_path / name / "checkpoints"), **hold)
        if hold:
            slurm.wait(job, output, until=("RUNNING",), ready=lambda: (tmp_path / "held").exists())
            slurm.run(["scancel", "--signal=USR1", "--batch", job])
        runs[name] = slurm.wait(job, output)
    straight, requeued = runs["straight"], runs["requeued"]
    assert (straight.state, straight.restarts) == ("COMPLETED", 0), straight.output[-3000:]
    assert (requeued.state, requeued.exit_code, requeued.restarts) == ("COMPLETED", "0:0", 1), \
        requeued.output[-4000:]
    first, second = requeued.output.split(f"slurm: job {requeued.id}, start 2,")
    assert "slurm: USR1: every rank stops at a checkpoint, then the job requeues" in first, first[-3000:]
    # the script tells the ranks on its node; every rank stops at the first log point after the hold
    assert re.findall(r"^\[0\]<stdout>:stopped on SIGUSR1 after step (\d+) \(epoch 0\), its checkpoint written",
                      first, re.M) == ["10"], first[-3000:]
    # 128 + USR1, also from a rank that learnt of the stop from the others (hvd_runtime.preemption);
    # once one has ended, horovodrun ends the rest, past the checkpoint: SIGTERM on the batch node
    # (143), its ssh session to another node (255)
    before, _, after = first.partition("Terminating remaining workers after failure of Process")
    assert set(re.findall(r"Process \d exit with status code (\d+)", before)) <= {"138"}, first[-3000:]
    assert set(re.findall(r"Process \d exit with status code (\d+)", after)) <= {"138", "143", "255"}, first[-3000:]
    assert re.search(r"^\[0\]<stdout>:resuming from .*/ckpt-000000010: epoch 0, step 10$", second, re.M), \
        second[-3000:]
    metrics = {m["epoch"]: m for m in map(json.loads, (tmp_path / "requeued" / "run" / "metrics.jsonl")
                                          .read_text().splitlines())}   # the resumed start's line wins
    expected = [json.loads(line) for line in (tmp_path / "straight" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert sorted(metrics) == [m["epoch"] for m in expected] == [1, 2]
    for want in expected:
        got = metrics[want["epoch"]]
        # the epoch that was cut trained only its rest after the resume: its train totals are partial
        for key in ("val_loss", "val_accuracy", *(("train_loss",) if want["epoch"] == 2 else ())):
            assert got[key] == pytest.approx(want[key], rel=1e-5), (want["epoch"], key)
    got, want = (load_file(str(tmp_path / name / "run" / "model.safetensors")) for name in ("requeued", "straight"))
    assert got.keys() == want.keys()
    for key in want:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6, err_msg=key)
    import mlflow

    client = mlflow.MlflowClient(f"sqlite:///{tmp_path / 'requeued'}.db")
    [experiment] = [e for e in client.search_experiments() if e.name != "Default"]
    [run] = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert len(client.get_metric_history(run.info.run_id, "val_loss")) == 2


def test_doctor_reports_the_allocation_and_whether_it_fits_the_layout(slurm, tmp_path, monkeypatch, capsys):
    """What salloc gives (its variables, read as Slurm sets them) against a pipeline of 2 stages x tp 2."""
    from hvdgen.doctor import _slurm

    subprocess.run([sys.executable, "-m", "hvdgen", "new", "pp", "--strategy", "pipeline", "--model", "gpt", "--tp",
                    "2", "--output", str(tmp_path)], check=True, capture_output=True)
    reports = {}
    for per_node in (2, 1):
        given = slurm.run(["salloc", "-N2", f"--ntasks-per-node={per_node}", "env", "-0"]).stdout
        for name in [n for n in os.environ if n.startswith("SLURM_")]:
            monkeypatch.delenv(name)
        for line in filter(None, given.split("\0")):
            name, _, value = line.partition("=")
            if name.startswith("SLURM_"):
                monkeypatch.setenv(name, value)
        reports[per_node] = _slurm(tmp_path / "pp"), capsys.readouterr().out
    problems, out = reports[2]
    assert problems == [] and re.fullmatch(r"slurm        job \d+: 2 node\(s\) \(n\[1-2\]\), 4 task\(s\), 2 a node, "
                                           r"no GPUs\n  fits         pipeline: 4 ranks, 1 copy of the model\n", out), out
    problems, out = reports[1]
    assert "2 task(s), 1 a node" in out and "fits" not in out
    assert problems == [
        "this allocation does not fit pp: --ntasks-per-node=1 splits tensor-parallel groups of tp 2 over nodes (they "
        "exchange activations in every layer): use a multiple of 2",
        "this allocation does not fit pp: --nodes=2 x --ntasks-per-node=1 is 2 ranks, not whole copies of the model "
        "(2 stages x tp 2): change --nodes or --ntasks-per-node so their product is a multiple of 4"]
