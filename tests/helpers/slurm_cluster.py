"""A Slurm cluster on one machine: slurmctld and slurmd nodes in network namespaces, for batch jobs.

    PYTHONPATH=tests python -m helpers.slurm_cluster up --nodes 2     # prints how to submit from the login namespace
    PYTHONPATH=tests python -m helpers.slurm_cluster down

The controller and each node is a network namespace behind a switch (tests/helpers/cluster.py's wiring),
under a host name of its own (a UTS namespace). Every node runs slurmd and sshd (horovodrun reaches
the other nodes over ssh, as on a cluster that lets a job's nodes ssh to each other), and sees
the machine's files as a shared filesystem, but for its own /etc/hosts (naming every node), its
ssh client settings (the cluster's key, no host-key prompts) and its own node-local temporary
folder (Slurm's TmpFS, where srun's PMIx keeps a step's files). Authentication is a munged of the
cluster's own (own key and socket). The controller holds a requeued job only a few seconds
(cred_expire; two minutes by default) and looks for jobs to start every second (sched_interval,
bf_interval; a minute and half a minute by default), so a requeue takes seconds. CPU nodes only,
with proctrack and task plugins that need no cgroup hierarchy of their own. Needs root; `down()`
stops the daemons, kills every process left in the namespaces, deletes them, and stops munged.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from helpers.cluster import SWITCH, _ip, _kill_all_in, kill_groups  # the namespaces' wiring, written once

SUBNET = "10.213.78"
TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "scontrol", "sshd", "ip")
CPUS_PER_NODE = 4  # what each node offers the scheduler (they share this machine's cores)


def why_unavailable() -> str | None:
    """One line saying why a Slurm cluster cannot be had here, or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces and mounts)"
    missing = [tool for tool in TOOLS if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists()]
    if missing:
        return (f"needs {', '.join(missing)} (Debian: apt-get install slurm-wlm munge openssh-server; "
                "scripts/test.sh installs them where it may)")
    probe = f"hvdgen-slurm-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot make a network namespace here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass
class Job:
    id: str
    state: str
    exit_code: str
    restarts: int
    output: str


@dataclass
class SlurmCluster:
    """The controller (`ctl`, also where jobs are submitted) and nodes n1..nN under `base`."""

    base: Path
    tag: str = "hvdslurm"
    nodes: list[str] = field(default_factory=list)
    namespaces: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.base / "slurm.conf"

    def up(self, nodes: int = 2) -> None:
        self.base.mkdir(parents=True, exist_ok=True)
        for folder in ("state", "log", "ssh", "node-tmp"):
            (self.base / folder).mkdir()
        self.nodes = [f"n{i}" for i in range(1, nodes + 1)]
        self._munge()
        self._ssh()
        names = ["ctl", *self.nodes]
        (self.base / "hosts").write_text("127.0.0.1\tlocalhost\n" + "".join(
            f"{SUBNET}.{10 + i}\t{name}\n" for i, name in enumerate(names)))
        self._write_conf()
        switch = f"{self.tag}-{SWITCH}"
        _ip("netns", "add", switch)
        self.namespaces.append(switch)
        _ip("link", "add", "br0", "type", "bridge", netns=switch)
        _ip("link", "set", "br0", "up", netns=switch)
        for i, name in enumerate(names):
            self._wire(switch, name, f"{SUBNET}.{10 + i}")
        self._start("ctl", ["slurmctld", "-D", "-f", str(self.conf)])
        for node in self.nodes:
            (self.base / "spool" / node).mkdir(parents=True)
            (self.base / "nodes" / node / "tmp").mkdir(parents=True)
            self._start(node, ["/usr/sbin/sshd", "-D", "-e", "-p", "22", "-h", str(self.base / "ssh" / "host_key"),
                               "-o", f"AuthorizedKeysFile={self.base / 'ssh' / 'authorized_keys'}",
                               "-o", "StrictModes=no", "-o", "PidFile=none"], log=f"sshd-{node}")
            self._start(node, ["slurmd", "-D", "-f", str(self.conf)], log=f"slurmd-{node}")
        self._wait_idle()

    def _munge(self) -> None:
        key = self.base / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        subprocess.run(["munged", "--force", f"--socket={self.base / 'munge.sock'}", f"--key-file={key}",
                        f"--log-file={self.base / 'log' / 'munged.log'}", f"--pid-file={self.base / 'munged.pid'}",
                        f"--seed-file={self.base / 'munged.seed'}"], check=True, capture_output=True)

    def _ssh(self) -> None:
        ssh = self.base / "ssh"
        for name in ("id_ed25519", "host_key"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / name)], check=True)
        shutil.copy(ssh / "id_ed25519.pub", ssh / "authorized_keys")
        (ssh / "ssh_config").write_text(f"Host *\n  IdentityFile {ssh / 'id_ed25519'}\n  StrictHostKeyChecking no\n"
                                        "  UserKnownHostsFile /dev/null\n  LogLevel ERROR\n  BatchMode yes\n")

    def _write_conf(self) -> None:
        b = self.base
        node_lines = "".join(f"NodeName={node} NodeAddr={SUBNET}.{11 + i} CPUs={CPUS_PER_NODE} State=UNKNOWN\n"
                             for i, node in enumerate(self.nodes))
        self.conf.write_text(f"""ClusterName=hvdgen
SlurmctldHost=ctl({SUBNET}.10)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={b / 'munge.sock'},cred_expire=5
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=1
MpiDefault=none
ReturnToService=2
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
StateSaveLocation={b / 'state'}
SlurmdSpoolDir={b / 'spool'}/%n
SlurmctldPidFile={b / 'slurmctld.pid'}
SlurmdPidFile={b / 'slurmd'}-%n.pid
SlurmctldLogFile={b / 'log' / 'slurmctld.log'}
SlurmdLogFile={b / 'log'}/slurmd-%n.log
TmpFS={b / 'node-tmp'}
{node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        # The machine's cgroup hierarchy is not a node's own; detected, it would stop slurmd.
        (b / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n")

    def _wire(self, switch: str, name: str, address: str) -> None:
        netns = f"{self.tag}-{name}"
        _ip("netns", "add", netns)
        self.namespaces.append(netns)
        host_end, switch_end = f"{self.tag[-6:]}{name}h", f"{self.tag[-6:]}{name}s"
        _ip("link", "add", host_end, "type", "veth", "peer", "name", switch_end)
        _ip("link", "set", host_end, "netns", netns)
        _ip("link", "set", switch_end, "netns", switch)
        _ip("link", "set", switch_end, "master", "br0", netns=switch)
        _ip("link", "set", switch_end, "up", netns=switch)
        _ip("link", "set", host_end, "name", "eth0", netns=netns)
        _ip("addr", "add", f"{address}/24", "dev", "eth0", netns=netns)
        _ip("link", "set", "eth0", "up", netns=netns)
        _ip("link", "set", "lo", "up", netns=netns)

    def command(self, name: str, argv: list[str]) -> list[str]:
        """argv run on host `name`: its network namespace, host name and node-local files."""
        b = self.base
        mounts = [f"mount --bind {shlex.quote(str(b / 'hosts'))} /etc/hosts",
                  f"mount --bind {shlex.quote(str(b / 'ssh' / 'ssh_config'))} /etc/ssh/ssh_config"]
        if name != "ctl":
            mounts.append(f"mount --bind {shlex.quote(str(b / 'nodes' / name / 'tmp'))} "
                          f"{shlex.quote(str(b / 'node-tmp'))}")
        script = f"hostname {name} && " + " && ".join(mounts) + ' && exec "$@"'
        return ["ip", "netns", "exec", f"{self.tag}-{name}", "unshare", "--uts", "--mount", "--propagation",
                "private", "bash", "-ec", script, name, *argv]

    def _start(self, name: str, argv: list[str], log: str | None = None) -> None:
        with (self.base / "log" / f"{log or name}.out").open("a") as out:
            self.processes.append(subprocess.Popen(self.command(name, argv), stdout=out, stderr=subprocess.STDOUT,
                                                   env=self.env(), start_new_session=True))

    def env(self, base: dict | None = None) -> dict[str, str]:
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}

    def run(self, argv: list[str], env: dict | None = None, cwd: Path | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm command run on the controller, the cluster's login node."""
        proc = subprocess.run(self.command("ctl", argv), env=self.env(env), cwd=cwd, capture_output=True, text=True,
                              timeout=120)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)}: exit {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split()
            if out[1::2] == ["idle"] * len(self.nodes):
                return
            time.sleep(0.3)
        logs = "\n".join(p.read_text()[-1500:] for p in sorted((self.base / "log").glob("*.log")))
        raise TimeoutError(f"the nodes are not idle after {timeout:.0f} s: {out}\n{logs}")

    def submit(self, script: str, args: list[str], cwd: Path, env: dict | None = None) -> str:
        """sbatch `script` (a path relative to `cwd`, submitted as it is) with arguments; the job id."""
        return self.run(["sbatch", "--parsable", script, *args], env=env, cwd=cwd).stdout.strip().split(";")[0]

    def state(self, job: str) -> dict[str, str]:
        text = self.run(["scontrol", "show", "job", "-o", job]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait(self, job: str, output: Path, timeout: float = 300, until: tuple[str, ...] = (),
             ready=lambda: True) -> Job:
        """Until the job has ended (or is in a state of `until` and `ready()` says so); its state and
        output so far."""
        deadline = time.monotonic() + timeout
        ended = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE")
        while True:
            info = self.state(job)
            if info["JobState"] in ended or (info["JobState"] in until and ready()):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job} is {info['JobState']} after {timeout:.0f} s: "
                                   f"{output.read_text()[-3000:] if output.exists() else 'no output'}")
            time.sleep(0.3)
        return Job(job, info["JobState"], info["ExitCode"], int(info["Restarts"]),
                   output.read_text() if output.exists() else "")

    def down(self) -> None:
        """The daemons are asked to stop first: each one this process then reaps brings the CPU time
        of the jobs it ran into this process's children's (what the suite's budget counts)."""
        for proc in self.processes:
            proc.terminate()
        for proc in self.processes:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for netns in self.namespaces:
            _kill_all_in(netns)
        kill_groups(self.processes)
        for netns in self.namespaces:
            subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        pid = self.base / "munged.pid"
        if pid.exists():
            try:
                munged = int(pid.read_text())
                os.kill(munged, signal.SIGTERM)
                deadline = time.monotonic() + 10
                while Path(f"/proc/{munged}").exists() and time.monotonic() < deadline:
                    time.sleep(0.05)   # it removes its socket as it ends: then the files are ours
            except (ProcessLookupError, ValueError):
                pass
        self.namespaces.clear()
        self.processes.clear()


def _main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--base", type=Path, default=Path("/tmp/hvdgen-slurm"))
    args = parser.parse_args()
    state = args.base / "cluster.json"
    if args.action == "down":
        if not state.exists():
            sys.exit(f"no cluster at {args.base}")
        saved = json.loads(state.read_text())
        made = SlurmCluster(args.base, namespaces=saved["namespaces"])
        made.down()
        shutil.rmtree(args.base)
        return
    problem = why_unavailable()
    if problem:
        sys.exit(f"error: this machine cannot make the cluster: {problem}")
    made = SlurmCluster(args.base)
    made.up(args.nodes)
    state.write_text(json.dumps({"namespaces": made.namespaces}))
    print(f"nodes: {', '.join(made.nodes)}; submit from the login namespace:")
    print(f"  {shlex.join(made.command('ctl', ['bash']))}   # SLURM_CONF={made.conf}")
    print(f"tear down: PYTHONPATH=tests python -m {__spec__.name} down --base {args.base}")


if __name__ == "__main__":
    _main()
