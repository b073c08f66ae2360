"""Which Python processes of a test run start cold, and what they cost: a census by kind and by file.

    python bench/cold_starts.py tests/projects/test_run_faults.py -n 2     # pytest's arguments

The suite forks most of its Python processes from warm servers (tests/warm_start); whatever
still starts a fresh interpreter pays for its imports again (torch about 1.8 CPU-s, TensorFlow and
Keras about 3.8). This runs pytest with a hook in this interpreter's site-packages (a `.pth` file,
removed afterwards) that every fresh interpreter runs at start-up and that does nothing unless
HVDGEN_COLD_LOG names a file: there it writes a line when the process starts and, at exit, its
CPU time and the test that started it (PYTEST_CURRENT_TEST). A process forked from a warm server
runs no start-up, so it is counted at its exit only, as warm. A process killed outright writes
no exit line: it is counted as started, its CPU unknown.
"""

from __future__ import annotations

import collections
import os
import re
import site
import subprocess
import sys
import tempfile
from pathlib import Path

HOOK = '''\
import os, sys
_log = os.environ.get("HVDGEN_COLD_LOG")
if _log:
    import atexit
    _pid = os.getpid()

    def _write(kind):
        t = os.times()
        fields = (kind, str(os.getpid()), f"{t.user + t.system:.2f}", os.environ.get("PYTEST_CURRENT_TEST", "-"),
                  " ".join(sys.orig_argv))
        fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.write(fd, "\\t".join(f.replace("\\t", " ").replace("\\n", " ") for f in fields).encode()[:2000] + b"\\n")
        os.close(fd)

    _write("start")
    atexit.register(lambda: _write("end" if os.getpid() == _pid else "warm"))
'''

KINDS = (   # (kind, pattern of the command line), first match wins
    ("horovodrun's per-rank middleman", r"multiprocessing\.spawn import spawn_main"),
    ("multiprocessing's resource tracker", r"multiprocessing\.resource_tracker"),
    ("DataLoader fork server", r"multiprocessing\.forkserver"),
    ("warm server", r"warm_start/server\.py"),
    ("horovodrun", r"/horovodrun "),
    ("pytest worker", r"-c import sys;exec\(eval"),
    ("tracking process", r"hvd_runtime\.tracking\.remote import serve"),
    ("mlflow server", r"mlflow server|mlflow ui|uvicorn|huey"),
    ("pip", r"pip/__pip-runner__|-m pip |pyproject_hooks"),
    ("hvdgen", r"-m hvdgen|bin/hvdgen"),
    ("rank", r"train\.py|train_in_rank_dir\.py"),
)


def kind_of(command: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, command):
            return kind
    script = re.search(r"(\S+\.py)\b", command)
    return f"script {Path(script.group(1)).name}" if script else "other"


def report(log: Path) -> str:
    started: dict[str, tuple[str, str]] = {}
    ended: dict[str, float] = {}
    warm, warm_cpu = 0, 0.0
    for line in log.read_text(errors="replace").splitlines():
        fields = line.split("\t")
        if len(fields) != 5:
            continue
        what, pid, cpu, test, command = fields
        if what == "start":
            started[pid] = (test.split("::")[0], command)
        elif what == "end":
            ended[pid] = float(cpu)
        else:
            warm += 1
            warm_cpu += float(cpu)
    by_kind, count, unknown = collections.Counter(), collections.Counter(), collections.Counter()
    by_file = collections.Counter()
    for pid, (file, command) in started.items():
        kind = kind_of(command)
        count[kind] += 1
        if pid in ended:
            by_kind[kind] += ended[pid]
            by_file[file, kind] += ended[pid]
        else:
            unknown[kind] += 1
    lines = [f"cold starts: {len(started)}, {sum(by_kind.values()):.0f} CPU-s (of those that exited); "
             f"warm processes: {warm}, {warm_cpu:.0f} CPU-s",
             f"{'CPU-s':>8} {'starts':>7} {'killed':>7}  kind"]
    lines += [f"{cpu:8.0f} {count[kind]:7d} {unknown[kind]:7d}  {kind}" for kind, cpu in by_kind.most_common()]
    lines += ["", f"{'CPU-s':>8}  file | kind (the 25 costliest)"]
    lines += [f"{cpu:8.0f}  {file} | {kind}" for (file, kind), cpu in by_file.most_common(25)]
    return "\n".join(lines)


def main(args: list[str]) -> int:
    hook_dir = Path(site.getsitepackages()[0])
    module, pth = hook_dir / "_hvdgen_cold_starts.py", hook_dir / "zz_hvdgen_cold_starts.pth"
    with tempfile.TemporaryDirectory() as folder:
        log = Path(folder) / "starts.tsv"
        module.write_text(HOOK)
        pth.write_text("import _hvdgen_cold_starts\n")
        try:
            code = subprocess.call([sys.executable, "-m", "pytest", *args], env={**os.environ, "HVDGEN_COLD_LOG": str(log)})
        finally:
            pth.unlink()
            module.unlink()
        print(report(log) if log.exists() else "no Python process started")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
