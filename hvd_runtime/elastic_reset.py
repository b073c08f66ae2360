"""What every elastic job does after a reset, whatever the framework.

The survivors have restored the last commit and renumbered themselves: each re-shards the data
from the committed position (so within the epoch no sample is skipped or seen twice), the
writers that only rank 0 may use learn who rank 0 is now, and rank 0 says where training stands.
"""

from __future__ import annotations

from hvd_runtime.rank_context import RankContext


def elastic_reset_callback(ctx: RankContext, elastic, batches, writers, extra=lambda: ""):
    """The callback to register on an elastic state.

    `elastic` holds the committed TrainState fields; `extra()` adds to rank 0's announcement.
    """
    def on_reset() -> None:
        for b in batches:
            b.reshard(ctx.rank, ctx.size)
        for writer in writers:
            writer.is_writer = ctx.is_root
        if ctx.is_root:
            print(f"elastic reset: {ctx.size} rank(s) now; continuing from the last commit: epoch {elastic.epoch}, "
                  f"step {elastic.step}, {elastic.samples_in_epoch} samples into the epoch{extra()}", flush=True)

    return on_reset
