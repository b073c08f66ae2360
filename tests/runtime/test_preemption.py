"""The stop signal every rank of a job agrees on (hvd_runtime.preemption), from what each received.

The stop itself, end to end under horovodrun: test_run_faults (SIGTERM) and test_slurm (SIGUSR1
to the batch node's ranks only: the other node's ranks learn it from them and exit alike).
"""

import os
import signal
import subprocess
import sys
import textwrap

from hvd_runtime import preemption


def test_no_signal_asks_for_no_stop():
    assert preemption.agreed([0.0, 0.0]) is None


def test_the_ranks_stop_on_the_signal_one_of_them_received():
    assert preemption.agreed([0.0, 1.0]) == signal.SIGUSR1
    assert preemption.agreed([3.0, 0.0]) == signal.SIGTERM


def test_sigterm_wins_over_sigusr1_since_it_asks_for_no_requeue():
    assert preemption.agreed([1.0, 3.0]) == signal.SIGTERM


def test_a_rank_reports_the_first_signal_it_received():
    # in a process of its own: install() holds the process to its grace time once a signal came
    code = textwrap.dedent("""
        import os, signal
        from hvd_runtime import preemption, watchdog
        print(preemption.asked())
        preemption.install(grace_s=60)
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        print(preemption.asked(), preemption.agreed(preemption.asked()) == signal.SIGUSR1)
        os._exit(0)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:2] == ["[0.0, 0.0]", "[0.0, 1.0] True"], proc.stdout
