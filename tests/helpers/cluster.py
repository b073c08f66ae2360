"""Hosts on one machine, for multi-host jobs: network namespaces behind a switch, each a "pod".

    PYTHONPATH=tests python -m helpers.cluster up --project demo --workers 2   # pods demo-worker-0/1, demo-launcher
    PYTHONPATH=tests python -m helpers.cluster down                            # (up prints how to enter the launcher)

Each pod is a network namespace with its own address on a private subnet, joined by a veth pair
to a bridge that lives in a namespace of its own (the switch), so nothing changes in the
machine's own network. A pod also sees its own files, as a container of one image would: every
command runs in a private mount namespace, under the pod's own host name, where

- /etc/hosts names every pod (what the cluster's DNS does for an MPIJob's workers),
- /etc/ssh is the machine's, plus the project's docker/sshd.conf and docker/ssh.conf installed
  as its image installs them,
- /root/.ssh is the job's key pair laid out as the MPI Operator mounts its Secret (id_rsa,
  id_rsa.pub, authorized_keys) at spec.sshAuthMountPath; the rest of /root is the machine's
  under a layer of the pod's own, so nothing a pod writes there reaches the machine (its
  ~/.bashrc there skips `pyenv rehash`, which an image would not run),
- or, for non-root jobs (sshAuthMountPath /home/mpiuser/.ssh), every command runs as the images'
  user `mpiuser` (uid 1000, in the pod's own /etc/passwd), the keys at /home/mpiuser/.ssh as a
  Secret volume with `fsGroup: 1000` leaves them (root:1000; the private key 0640, which is also
  the mode the Trainer gives it); the pod's workspace belongs to the user, the job's volumes to its
  group. The machine's files are not laid out as an image's (its interpreter may sit in a folder
  only root may enter), so those processes keep one capability, reading and searching folders
  (CAP_DAC_READ_SEARCH); every write, and every ownership check ssh and sshd make, is uid 1000's,
- the workspace path shows the pod's own copy of the project, with the job's volumes (a
  directory each, shared by the pods that mount it, like a ReadWriteMany claim) mounted inside.

A worker runs the MPIJob's worker command (its sshd) in its pod; the launcher pod runs the
launcher command. Everything is torn down by `down()`, also after a failure: processes in the
namespaces are killed, then the namespaces deleted. Needs root (namespaces, mounts).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

SUBNET = "10.213.77"  # addresses exist only inside the namespaces made here
SWITCH = "sw"
ROOT_SSH = "/root/.ssh"
USER, UID, HOME = "mpiuser", 1000, "/home/mpiuser"  # the images' non-root user


def why_unavailable() -> str | None:
    """One line saying why namespaces and sshd cannot be had here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and mounts)"
    if not shutil.which("ip"):
        return "needs iproute2's `ip`"
    if not Path("/usr/sbin/sshd").exists() or not shutil.which("ssh"):
        return "needs openssh-server and openssh-client"
    name = f"hvdgen-probe-{os.getpid()}"  # one per process: pytest's workers probe side by side
    probe = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"cannot make a network namespace here: {probe.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _kill_all_in(netns: str) -> None:
    for pid in subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_groups(processes: list[subprocess.Popen]) -> None:
    """SIGKILL each process's group (each was started in a session of its own) and reap it."""
    for proc in processes:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(["-n", netns] if netns else []), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


@dataclass
class Pod:
    name: str            # the DNS name the other pods use
    netns: str
    address: str
    files: Path          # this pod's private files: workspace copy, /etc/hosts, /etc/ssh
    volumes: dict[str, Path] = field(default_factory=dict)  # path inside the workspace -> shared directory


@dataclass
class Cluster:
    """Pods on one private subnet. `base` holds every file; `tag` prefixes every namespace."""

    base: Path
    tag: str = "hvdgen"
    workspace: Path | None = None   # the path every pod sees its own copy of the project at
    keys: Path | None = None        # the job's key pair, laid out as the operator's Secret
    pods: list[Pod] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)
    # Each pod's /etc/hosts names the pod itself on 127.0.1.1, as Debian's installer does on a
    # workstation (Kubernetes writes the pod's own address); every other pod by its address.
    own_name_on_loopback: bool = False
    non_root: bool = False  # commands run as the images' mpiuser, the keys at /home/mpiuser/.ssh

    @property
    def switch(self) -> str:
        return f"{self.tag}-{SWITCH}"

    def up(self, project: Path, ssh_auth_mount: str = "/root/.ssh") -> None:
        """The switch, the job's keys, and the pristine project that every pod copies."""
        if ssh_auth_mount not in (ROOT_SSH, f"{HOME}/.ssh"):
            raise ValueError(f"the pods run as root ({ROOT_SSH}) or as {USER} ({HOME}/.ssh), not {ssh_auth_mount}")
        self.non_root = ssh_auth_mount != ROOT_SSH
        self.base.mkdir(parents=True, exist_ok=True)
        self.workspace = self.base / "workspace"
        shutil.copytree(project, self.workspace, symlinks=True)
        self.keys = self.base / "job-ssh"
        self.keys.mkdir()
        subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "521", "-N", "", "-f", str(self.keys / "id_rsa")],
                       check=True)
        shutil.copy(self.keys / "id_rsa.pub", self.keys / "authorized_keys")
        if self.non_root:
            self._user_files()
        _ip("netns", "add", self.switch)
        _ip("link", "add", "br0", "type", "bridge", netns=self.switch)
        _ip("link", "set", "br0", "up", netns=self.switch)
        _ip("link", "set", "lo", "up", netns=self.switch)

    def _user_files(self) -> None:
        """The keys as a Secret volume with fsGroup 1000 holds them, and a passwd and group naming mpiuser."""
        for path, mode in ((self.keys, 0o755), (self.keys / "id_rsa", 0o640), (self.keys / "id_rsa.pub", 0o644),
                           (self.keys / "authorized_keys", 0o644)):
            os.chown(path, 0, UID)
            os.chmod(path, mode)
        for name, line in (("passwd", f"{USER}:x:{UID}:{UID}::{HOME}:/bin/bash\n"), ("group", f"{USER}:x:{UID}:\n")):
            kept = [entry for entry in Path(f"/etc/{name}").read_text().splitlines(keepends=True)
                    if entry.split(":")[2:3] != [str(UID)] and not entry.startswith(f"{USER}:")]
            (self.base / name).write_text("".join(kept) + line)

    def volume(self, name: str) -> Path:
        """A directory the pods may mount (a claim's volume): the job's group may write it, as with fsGroup."""
        path = self.base / name
        path.mkdir()
        if self.non_root:
            os.chown(path, 0, UID)
            os.chmod(path, 0o2775)
        return path

    def add_pod(self, name: str, volumes: dict[str, Path] | None = None) -> Pod:
        """A namespace wired to the switch, with its own copy of the workspace."""
        index = len(self.pods)
        pod = Pod(name=name, netns=f"{self.tag}-{index}", address=f"{SUBNET}.{10 + index}",
                  files=self.base / "pods" / name, volumes=volumes or {})
        _ip("netns", "add", pod.netns)
        self.pods.append(pod)
        host_end, switch_end = f"{self.tag[-6:]}{index}h", f"{self.tag[-6:]}{index}s"
        _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
        _ip("link", "set", host_end, "netns", pod.netns)
        _ip("link", "set", switch_end, "netns", self.switch)
        _ip("link", "set", switch_end, "master", "br0", netns=self.switch)
        _ip("link", "set", switch_end, "up", netns=self.switch)
        _ip("link", "set", host_end, "name", "eth0", netns=pod.netns)
        _ip("addr", "add", f"{pod.address}/24", "dev", "eth0", netns=pod.netns)
        _ip("link", "set", "eth0", "up", netns=pod.netns)
        _ip("link", "set", "lo", "up", netns=pod.netns)
        shutil.copytree(self.workspace, pod.files / "workspace", symlinks=True)
        if self.non_root:
            for path in [pod.files / "workspace", *(pod.files / "workspace").rglob("*")]:
                os.chown(path, UID, UID, follow_symlinks=False)
        etc_ssh = pod.files / "etc-ssh"
        shutil.copytree("/etc/ssh", etc_ssh, ignore=shutil.ignore_patterns("ssh_host_*"))
        shutil.copy(self.workspace / "docker" / "sshd.conf", etc_ssh / "sshd_config.d" / "hvdgen.conf")
        shutil.copy(self.workspace / "docker" / "ssh.conf", etc_ssh / "ssh_config.d" / "hvdgen.conf")
        self._write_hosts()
        return pod

    def _write_hosts(self) -> None:
        for pod in self.pods:
            names = "".join(f"{'127.0.1.1' if p is pod and self.own_name_on_loopback else p.address}\t"
                            f"{p.name} {p.name.split('.')[0]}\n" for p in self.pods)
            (pod.files / "hosts").write_text(f"127.0.0.1\tlocalhost\n{names}")

    def command(self, pod: Pod, argv: list[str]) -> list[str]:
        """argv run inside the pod: its network namespace and its own view of the files."""
        layer = shlex.quote(str(pod.files / "root-layer"))
        keys = shlex.quote(str(self.keys))
        mounts = [  # /root: the machine's (Python may live there) under a layer of the pod's own
            f"mkdir -p {layer} && mount -t tmpfs tmpfs {layer} && mkdir {layer}/upper {layer}/work",
            f"mount -t overlay overlay -o lowerdir=/root,upperdir={layer}/upper,workdir={layer}/work /root",
            "mkdir -p -m 0700 /root/.ssh",
            f"mount --bind {keys} /root/.ssh",
            # The machine's ~/.bashrc may run `pyenv rehash` in every ssh session; a pod's sessions,
            # started together under load, then wait on its lock (60 s, past gloo's rendezvous).
            # An image has no pyenv to rehash: the pod's own layer skips it.
            "if grep -qs 'pyenv init -)' /root/.bashrc; then sed -i 's/pyenv init -)/pyenv init - --no-rehash)/' "
            "/root/.bashrc; fi",
            f"mount --bind {shlex.quote(str(pod.files / 'hosts'))} /etc/hosts",
            f"mount --bind {shlex.quote(str(pod.files / 'etc-ssh'))} /etc/ssh",
            f"mount --bind {shlex.quote(str(pod.files / 'workspace'))} {shlex.quote(str(self.workspace))}",
        ]
        for inside, shared in pod.volumes.items():
            target = self.workspace / inside
            mounts += [f"mkdir -p {shlex.quote(str(pod.files / 'workspace' / inside))}",
                       f"mount --bind {shlex.quote(str(shared))} {shlex.quote(str(target))}"]
        run_as = ""
        if self.non_root:
            base = shlex.quote(str(self.base))
            mounts += [f"mount --bind {base}/passwd /etc/passwd", f"mount --bind {base}/group /etc/group",
                       "mount -t tmpfs -o mode=0755 tmpfs /home", f"mkdir -p {HOME}/.ssh",
                       f"chown {UID}:{UID} {HOME}", f"mount --bind {keys} {HOME}/.ssh"]
            run_as = (f"setpriv --reuid={UID} --regid={UID} --clear-groups --inh-caps=+dac_read_search "
                      f"--ambient-caps=+dac_read_search env HOME={HOME} USER={USER} LOGNAME={USER} ")
        script = (f"hostname {shlex.quote(pod.name.split('.')[0])} && " + " && ".join(mounts)
                  + f" && cd {shlex.quote(str(self.workspace))} && exec {run_as}\"$@\"")
        return ["ip", "netns", "exec", pod.netns, "unshare", "--uts", "bash", "-ec", script, pod.name, *argv]

    def start(self, pod: Pod, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """A long-running process in the pod (a worker's sshd, a launcher), stopped by down()."""
        with log.open("a") as out:  # a pod started again (a restarted worker) logs on
            proc = subprocess.Popen(self.command(pod, argv), stdout=out, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True)
        self.processes.append(proc)
        return proc

    def run(self, pod: Pod, argv: list[str], env: dict | None = None, timeout: float = 600
            ) -> subprocess.CompletedProcess:
        return subprocess.run(self.command(pod, argv), env=env, capture_output=True, text=True, timeout=timeout)

    def wait_for_port(self, pod: Pod, port: int, timeout: float = 30) -> None:
        """Until something listens on pod:port, seen from inside the pod."""
        deadline = time.monotonic() + timeout
        probe = f"import socket; socket.create_connection(('{pod.address}', {port}), 1).close()"
        while time.monotonic() < deadline:
            check = subprocess.run(["ip", "netns", "exec", pod.netns, sys.executable, "-c", probe],
                                   capture_output=True)
            if check.returncode == 0:
                return
            time.sleep(0.2)
        raise TimeoutError(f"nothing listens on {pod.name}:{port} after {timeout:.0f} s")

    def kill_pod(self, pod: Pod) -> None:
        """Every process in the pod's namespace, at once: the host is gone."""
        _kill_all_in(pod.netns)

    def down(self) -> None:
        """Kill everything in the namespaces, delete them, and remove the files."""
        for pod in self.pods:
            self.kill_pod(pod)
        kill_groups(self.processes)
        for netns in [p.netns for p in self.pods] + [self.switch]:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        self.pods.clear()
        self.processes.clear()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--project", type=Path, help="up: the generated project the pods run")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--base", type=Path, default=Path("/tmp/hvdgen-cluster"))
    args = parser.parse_args()
    state = args.base / "cluster.json"
    if args.action == "down":
        if not state.exists():
            sys.exit(f"no cluster at {args.base}")
        for netns in json.loads(state.read_text())["netns"]:
            _kill_all_in(netns)
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        shutil.rmtree(args.base)
        return
    problem = why_unavailable()
    if problem:
        sys.exit(f"error: this machine cannot make the cluster: {problem}")
    if args.project is None:
        sys.exit("error: up needs --project DIR (a generated project)")
    cluster = Cluster(args.base)
    cluster.up(args.project)
    name = args.project.name
    workers = [cluster.add_pod(f"{name}-worker-{i}") for i in range(args.workers)]
    launcher = cluster.add_pod(f"{name}-launcher")
    for worker in workers:
        cluster.start(worker, ["/usr/sbin/sshd", "-D", "-e", "-p", "2222", "-h", "/root/.ssh/id_rsa"],
                      args.base / f"{worker.name}.log")
    state.write_text(json.dumps({"netns": [p.netns for p in cluster.pods] + [cluster.switch]}))
    print(f"pods: {', '.join(p.name + ' ' + p.address for p in cluster.pods)}")
    print(f"enter the launcher: {shlex.join(cluster.command(launcher, ['bash']))}")
    print(f"tear down: PYTHONPATH=tests python -m {__spec__.name} down --base {args.base}")


if __name__ == "__main__":
    _main()
