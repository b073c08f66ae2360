"""Checkpoint writes that fail: a full disk, an I/O error, a read-only folder (`checkpoint.max_failures`).

A write that fails on any rank is never published (hvd_runtime.sharded.write_checkpoint): its
hidden staging folder is removed and the previous checkpoint stays the newest valid one, and
retention removes old checkpoints only once a new one is in place (CheckpointStore.publish).
Every rank learns the same outcome from rank 0, so every rank goes on or stops alike:

    a failed write, up to checkpoint.max_failures in a row: one warning from rank 0, training
        goes on, and the next checkpoint tries again (a disk that an operator or a log rotation
        frees meanwhile loses nothing but the checkpoints between)
    one more in a row, or the run's last checkpoint (the trained model is written from it):
        one line from rank 0 and the run stops (exit status 1, the MLflow run FAILED), having
        lost no more than the work since the newest checkpoint, from which a restart resumes
"""

from __future__ import annotations

import sys

__all__ = ["CheckpointsFailing", "WriteFailures"]


class CheckpointsFailing(SystemExit):
    """The run stopped because its checkpoints could not be written: exit status 1, the MLflow run FAILED."""

    run_status = "FAILED"

    def __init__(self, step: int):
        super().__init__(1)
        self.step = step


class WriteFailures:
    """Counts the checkpoint writes that failed in a row; `failed` warns or stops."""

    def __init__(self, max_failures: int = 0):
        self.max_failures = max_failures
        self.in_a_row = 0

    def written(self) -> None:
        self.in_a_row = 0

    def failed(self, reason: str, step: int, last: bool, directory, say: bool) -> None:
        """Checkpoint `step` was not written, for `reason` (the same on every rank); `last`: the run's
        final one. `say`: this process prints (rank 0). Raises CheckpointsFailing to stop."""
        self.in_a_row += 1
        if last or self.in_a_row > self.max_failures:
            why = ("it was the run's last checkpoint, which the trained model is written from" if last
                   else f"{self.in_a_row} in a row, more than checkpoint.max_failures {self.max_failures}")
            self._say(say, f"checkpoint: {reason}; {why}: stopping at step {step}, so that no more is lost than "
                           f"the steps since the newest checkpoint: make {directory} writable with room for a "
                           f"checkpoint (or choose another --checkpoint.dir) and launch again to resume from it")
            raise CheckpointsFailing(step)
        self._say(say, f"checkpoint: {reason}; training goes on and tries again at the next checkpoint "
                       f"({self.in_a_row} failed in a row; checkpoint.max_failures {self.max_failures})")

    @staticmethod
    def _say(say: bool, line: str) -> None:
        if say:
            print(line, file=sys.stderr, flush=True)
