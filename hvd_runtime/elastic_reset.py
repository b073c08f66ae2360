"""What every elastic job does around a reset, whatever the framework.

At start-up every rank takes rank 0's state in one sync (sync_now). After a reset the survivors
have restored the last commit and renumbered themselves: each re-shards the data
from the committed position (so within the epoch no sample is skipped or seen twice), the
writers that only rank 0 may use learn who rank 0 is now, the tracker follows rank 0 into the
job's run, and rank 0 says where training stands.
"""

from __future__ import annotations

from typing import Callable

from hvd_runtime import watchdog
from hvd_runtime.config import ConfigError
from hvd_runtime.rank_context import RankContext


def elastic_reset_callback(ctx: RankContext, elastic, batches, writers, extra=lambda: "", tracker=None):
    """The callback to register on an elastic state.

    `elastic` holds the committed TrainState fields; `extra()` adds to rank 0's announcement;
    `tracker` (a HandoverTracker) starts logging on a new rank 0.
    """
    def on_reset() -> None:
        for b in batches:
            b.reshard(ctx.rank, ctx.size)
        for writer in writers:
            writer.is_writer = ctx.is_root
        if tracker is not None:  # the run's world_size param is the first size; each reset logs the new one
            tracker.follow(ctx.rank, ctx.size, elastic.run_id)
            tracker.log_metrics({"world_size": ctx.size}, step=elastic.step)
        if ctx.is_root:
            print(f"elastic reset: {ctx.size} rank(s) now; continuing from the last commit: epoch {elastic.epoch}, "
                  f"step {elastic.step}, {elastic.samples_in_epoch} samples into the epoch{extra()}", flush=True)

    return on_reset


def follow_resets(elastic, ctx: RankContext, batches, writers, tracker, broadcast_object: Callable,
                  extra=lambda: "") -> None:
    """What run_elastic attaches in either framework: the reset callback and, with a tracker, the
    run id handed to every rank at each commit."""
    elastic.register_reset_callbacks([elastic_reset_callback(ctx, elastic, batches, writers, extra, tracker)])
    if tracker is not None:
        share_run_id_at_commit(elastic, ctx, tracker, broadcast_object)


def share_run_id_at_commit(elastic, ctx: RankContext, tracker, broadcast_object: Callable) -> None:
    """Make every commit first give every rank rank 0's tracking run id.

    Only rank 0's tracker knows the run id, and rank 0 may be the rank that is lost; whoever is
    rank 0 after the reset continues the run by the id restored from the last commit. One small
    broadcast per commit, asked of every rank alike (a commit is a step every rank takes), so a
    rank that joined later takes part too; it never waits for the run to open.
    """
    commit = elastic.commit

    def commit_with_run_id() -> None:
        mine = (tracker.opened_run_id() or elastic.run_id) if ctx.is_root else None
        elastic.run_id = broadcast_object(mine, root_rank=0, name="tracking_run_id")
        commit()

    elastic.commit = commit_with_run_id


def sync_now(elastic) -> None:
    """The elastic state's first sync, at start-up: every rank gets rank 0's state (ElasticStart),
    or stops with rank 0's reason why its checkpoint does not fit. The sync that hvd.elastic.run
    does first is then skipped, so every rank, a later joiner too, syncs exactly once per start."""
    elastic.sync()
    if elastic.refusal:
        raise ConfigError(elastic.refusal)
    synced = elastic.sync

    def skip_once() -> None:
        elastic.sync = synced     # every reset after this syncs for real

    elastic.sync = skip_once


def allowing_resets(fit: Callable) -> Callable:
    """`fit`, giving what follows a failure inside it (Horovod's shutdown, its wait for hosts, the
    new rendezvous, the restore) the hang watchdog's longer allowance, not a step's."""
    def attempt(state):
        try:
            return fit(state)
        except BaseException:
            watchdog.beat("elastic reset", allowance=True)
            raise

    return attempt
