"""An elastic job's tracker: whichever rank is rank 0 now logs, into the one run of the job.

Rank 0 can be lost with its host. The survivors renumber themselves and one of them becomes
rank 0; its tracker, until then doing nothing, opens the job's run (by the id every rank was
given at the last commit, see elastic_reset.share_run_id_at_commit) and goes on logging into
it: the run keeps every epoch, whichever ranks trained it. Rank 0 only ever changes by being
lost (Horovod keeps surviving hosts first, in order), so a writer never has to hand back.
"""

from __future__ import annotations

from typing import Callable

from .tracker import NullTracker

Start = Callable[[int, int, "str | None"], NullTracker]   # (rank, world size, run id) -> tracker


class HandoverTracker(NullTracker):
    def __init__(self, start: Start, rank: int, world_size: int, run_id: str | None):
        self._start = start
        self._inner = start(rank, world_size, run_id)

    @property
    def tracking(self) -> bool:
        """Whether this rank logs (it is rank 0, and tracking is on)."""
        return type(self._inner) is not NullTracker

    @property
    def run_id(self) -> str | None:
        return self._inner.run_id

    def opened_run_id(self) -> str | None:
        """The run id if the run is open already: never waits (it is asked at every commit)."""
        return self._inner.opened_run_id() if self.tracking else None

    def follow(self, rank: int, world_size: int, run_id: str | None) -> None:
        """After an elastic reset: the new rank 0 starts logging, into `run_id` when there is one."""
        if rank == 0 and not self.tracking:
            self._inner = self._start(rank, world_size, run_id)

    def log_metrics(self, metrics, step):
        self._inner.log_metrics(metrics, step)

    def set_tags(self, tags):
        self._inner.set_tags(tags)

    def log_artifact(self, path, artifact_path=None):
        self._inner.log_artifact(path, artifact_path)

    def log_model(self, model, input_example, name="model", step=0, checkpoint=False):
        self._inner.log_model(model, input_example, name, step, checkpoint)

    def wants_checkpoint_model(self) -> bool:
        return self._inner.wants_checkpoint_model()

    def close(self, status="FINISHED", timeout=None):
        self._inner.close(status, timeout)

    def __exit__(self, exc_type, exc, tb):
        # a stop asked for by a signal (hvd_runtime.preemption.Preempted) is KILLED, any other exception FAILED
        self.close("FINISHED" if exc_type is None else getattr(exc, "run_status", "FAILED"))
        return False
