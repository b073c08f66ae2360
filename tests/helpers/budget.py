"""The suite's budget: what each test file costs, printed at the end of every run.

Each test is charged the wall seconds from its setup to its teardown and the CPU seconds spent
meanwhile by its pytest worker, by the processes that worker waited for (horovodrun and what it
waited for), and by the warm-start servers of that worker with the ranks they forked
(tests/warm_start): the ranks are their children, not the worker's. Session and module fixtures
are charged to the test that first needs them. The summary lists the costliest files by CPU,
with their share of the whole, and when each worker ran out of tests (one that ends early has left
a core idle). A file over SHARE of the suite's CPU says why in its docstring, in a paragraph that
starts with "Cost:"; the table marks the ones that do not.
"""

from __future__ import annotations

import ast
import os
import resource
import time
from collections import defaultdict
from pathlib import Path

import pytest

SHARE = 0.06
SHOWN = 15
JUDGED = 20   # files in the run before a share means anything
TICKS = os.sysconf("SC_CLK_TCK")


_servers_seen: dict[int, float] = {}   # a server's CPU when last read: it still counts once it has ended


def _warm_servers_cpu() -> float:
    """CPU seconds of this process's warm servers and the ranks they reaped."""
    import warm_start

    for pid in warm_start.server_pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        _servers_seen[pid] = sum(int(v) for v in fields[11:15]) / TICKS   # utime, stime, cutime, cstime
    return sum(_servers_seen.values())


def _cpu() -> float:
    own, waited = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + waited.ru_utime + waited.ru_stime + _warm_servers_cpu()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "setup":
        item._budget_start = (time.monotonic(), _cpu())   # before the report's own bookkeeping
    elif call.when == "call":   # the servers' CPU as the test ends: a session's last teardown stops them
        _warm_servers_cpu()
    outcome = yield
    if call.when == "teardown" and hasattr(item, "_budget_start"):
        wall, cpu = item._budget_start
        now = time.monotonic()   # the machine's clock: the same in every worker
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        outcome.get_result().user_properties.append(("budget", (now - wall, _cpu() - cpu, wall, now, worker)))


class _Budget:
    def __init__(self) -> None:
        self.files: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
        self.first_start = float("inf")
        self.last_end: dict[str, tuple[float, str]] = {}   # worker -> when its last test ended, its file

    def add(self, report) -> None:
        for name, value in report.user_properties:
            if name == "budget":
                path = report.nodeid.split("::")[0]
                entry = self.files[path]
                entry[0] += 1
                entry[1] += value[0]
                entry[2] += value[1]
                started, ended, worker = value[2:]
                self.first_start = min(self.first_start, started)
                if ended > self.last_end.get(worker, (0.0, ""))[0]:
                    self.last_end[worker] = (ended, path)


_budget = _Budget()


def pytest_runtest_logreport(report) -> None:
    if report.when == "teardown":
        _budget.add(report)


def _explains_its_cost(path: Path) -> bool:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    except (OSError, SyntaxError):
        return False
    return any(paragraph.lstrip().startswith("Cost:") for paragraph in doc.split("\n\n"))


def pytest_terminal_summary(terminalreporter, config) -> None:
    if not _budget.files or hasattr(config, "workerinput"):
        return
    total_cpu = sum(entry[2] for entry in _budget.files.values()) or 1.0
    total_wall = sum(entry[1] for entry in _budget.files.values())
    rows = sorted(_budget.files.items(), key=lambda kv: -kv[1][2])[:SHOWN]
    write = terminalreporter.write_line
    terminalreporter.section(f"budget: the {len(rows)} costliest of {len(_budget.files)} files, by CPU seconds")
    write(f"{'file':<58} {'tests':>5} {'wall s':>8} {'CPU s':>8} {'share':>6}")
    unexplained = False
    for path, (tests, wall, cpu) in rows:
        over = (len(_budget.files) >= JUDGED and cpu / total_cpu > SHARE
                and not _explains_its_cost(Path(config.rootpath) / path))
        unexplained |= over
        write(f"{path:<58} {tests:>5} {wall:>8.0f} {cpu:>8.0f} {cpu / total_cpu:>6.1%}{' !' if over else ''}")
    write(f"{'all files':<58} {sum(e[0] for e in _budget.files.values()):>5} {total_wall:>8.0f} "
          f"{total_cpu:>8.0f} {1:>6.0%}")
    if len(_budget.last_end) > 1:   # a worker that ends long before the others left its core idle
        ends = sorted((end - _budget.first_start, worker, path) for worker, (end, path) in _budget.last_end.items())
        write("workers ended at " + ", ".join(f"{end:.0f} s" for end, _, _ in ends) + f" (the last in {ends[-1][2]})")
    if unexplained:
        write(f"! over {SHARE:.0%} of the suite's CPU with no 'Cost:' paragraph in its docstring saying why")
