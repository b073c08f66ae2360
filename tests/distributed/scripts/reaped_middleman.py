"""Horovod's launcher runs each rank (and each host-discovery call) through safe_shell_exec.execute,
which starts a middleman process and joins it. When another thread of the launcher starts a process
meanwhile, multiprocessing's _cleanup() polls every child, this middleman included: if that waitpid
reaps it first, join() returns before the exit status is recorded (CPython gh-130895, gh-148318),
and an elastic job whose ranks all exited 0 failed with 'Exit code: None'.

This script makes the race's losing side happen on purpose: a second thread waits on each
middleman too, and records the status it reaps only 0.3 s later, as a thread that lost the GIL
right after its waitpid would. Whichever thread's waitpid wins, execute() must return the
command's exit status (3). Prints the statuses, one per run, as JSON.

    python reaped_middleman.py RUNS
"""

import json
import multiprocessing.process
import os
import sys
import threading
import time

from horovod.runner.common.util import safe_shell_exec


def reap_first(stop: threading.Event) -> None:
    while not stop.is_set():
        for process in list(multiprocessing.process._children):
            popen = process._popen
            if popen is None or popen.returncode is not None:
                continue
            try:
                _, status = os.waitpid(popen.pid, 0)   # races execute()'s join() for the status
            except ChildProcessError:                  # execute()'s join() reaped it
                continue
            time.sleep(0.3)                            # ... and records it late
            popen.returncode = os.waitstatus_to_exitcode(status)
        time.sleep(0.001)


def main() -> None:
    statuses = []
    for _ in range(int(sys.argv[1])):
        stop = threading.Event()
        reaper = threading.Thread(target=reap_first, args=(stop,), daemon=True)
        reaper.start()
        statuses.append(safe_shell_exec.execute("sleep 0.2; exit 3"))
        stop.set()
        reaper.join()
    print(json.dumps(statuses))


if __name__ == "__main__":  # execute() starts its middleman with the spawn method, which re-imports this file
    main()
