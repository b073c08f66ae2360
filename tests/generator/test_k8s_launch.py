"""The launcher's command line is one that horovodrun accepts, and it reads the operator's hostfile."""

from __future__ import annotations

import sys

import pytest

from hvdgen.errors import HvdgenError
from hvdgen.k8s.launch import HOSTFILE, START_TIMEOUT_S, horovodrun_args
from hvdgen.k8s.mpijob import build_mpijob
from hvdgen.k8s.options import K8sOptions
from hvdgen.spec import ProjectSpec

launch = pytest.importorskip("horovod.runner.launch", reason="Requires: horovod (hvdgen install-horovod)")


def parsed(monkeypatch, argv):
    monkeypatch.setattr(sys, "argv", argv)
    return launch.parse_args()


def launcher_argv(opts: K8sOptions) -> list[str]:
    job = build_mpijob(ProjectSpec(name="demo"), opts, gpu=True)
    container = job["spec"]["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0]
    return container["command"] + container["args"]


def test_static_job_uses_the_operator_hostfile(monkeypatch, tmp_path):
    args = parsed(monkeypatch, launcher_argv(K8sOptions(workers=3, gpus_per_worker=2)))
    assert (args.num_proc, args.hostfile, args.command) == (6, HOSTFILE, ["python", "train.py"])
    assert not launch._is_elastic(args)
    assert (args.use_gloo, args.use_mpi) == (True, False)  # named, not left to what the image has
    assert args.start_timeout == START_TIMEOUT_S > 30  # horovodrun's 30 s is short for a busy node
    # The operator writes one line per worker in OpenMPI's format; horovodrun turns it into -H.
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("demo-worker-0.demo.ml.svc slots=2\ndemo-worker-1.demo.ml.svc slots=2\n")
    from horovod.runner.common.util import hosts

    assert hosts.parse_host_files(str(hostfile)) == "demo-worker-0.demo.ml.svc:2,demo-worker-1.demo.ml.svc:2"


def test_an_mpi_job_names_mpi_and_elastic_jobs_cannot(monkeypatch):
    args = parsed(monkeypatch, launcher_argv(K8sOptions(workers=2, controller="mpi")))
    assert (args.use_gloo, args.use_mpi, args.hostfile) == (False, True, HOSTFILE)
    # horovodrun would drop --mpi in elastic mode without a word, so the answers refuse the pair.
    with pytest.raises(HvdgenError, match=r"^elastic Horovod runs on Gloo only .*use --controller gloo"):
        K8sOptions(workers=2, elastic=True, controller="mpi")
    with pytest.raises(HvdgenError, match=r"^--controller 'nccl' is not known: choose gloo or mpi$"):
        K8sOptions(controller="nccl")


def test_elastic_job_uses_the_discovery_script(monkeypatch):
    opts = K8sOptions(workers=2, gpus_per_worker=2, elastic=True, min_workers=1, max_workers=4)
    args = parsed(monkeypatch, launcher_argv(opts))
    assert (args.num_proc, args.min_num_proc, args.max_num_proc) == (4, 2, 8)
    assert args.host_discovery_script == "/etc/mpi/discover_hosts.sh"
    assert args.start_timeout == START_TIMEOUT_S
    assert launch._is_elastic(args)


def test_without_a_hostfile_horovodrun_would_stay_on_the_launcher(monkeypatch):
    """Why the hostfile flag is there: horovodrun ignores OMPI_MCA_orte_default_hostfile."""
    argv = ["horovodrun"] + [a for a in horovodrun_args(2, 1) if a not in ("--hostfile", HOSTFILE)]
    args = parsed(monkeypatch, argv)
    assert args.hostfile is None and args.hosts is None
    monkeypatch.setenv("OMPI_MCA_orte_default_hostfile", "/etc/mpi/hostfile")
    monkeypatch.setattr(launch, "_run_static", lambda a: a.hosts)
    assert launch._run(args) == "localhost:2"
