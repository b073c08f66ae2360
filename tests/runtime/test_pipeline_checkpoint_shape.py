"""A pipeline checkpoint names the shape it was written by: stages, and chunks a stage."""

import pytest

from hvd_runtime.parallel.dims import ParallelDims
from hvd_runtime.pipeline.checkpoint import own_stage
from hvd_runtime.pipeline.grid import PipelineRank


def rank(stage: int, chunks: int = 1) -> PipelineRank:
    return PipelineRank(dims=ParallelDims(world=2, pp=2), rank=stage, chunks=chunks)


def payload(chunks: int | None) -> dict:
    parts = {s: {"stage": s, "replica": 0, "model": {"w": s}, "optimizer": None} for s in range(2)}
    if chunks is not None:
        for part in parts.values():
            part["chunks"] = chunks
    return {"stages": parts}


def test_a_stage_takes_its_part_of_a_checkpoint_of_its_own_shape():
    assert own_stage(payload(2), rank(1, chunks=2), "ckpt")["model"] == {"w": 1}
    assert own_stage(payload(None), rank(0), "ckpt")["model"] == {"w": 0}   # written before chunks were saved


@pytest.mark.parametrize("saved, now, said", [
    (2, 1, "ckpt was written by a pipeline of 2 chunks a stage (interleaved-1f1b), this one has one chunk a stage"),
    (None, 3, "ckpt was written by a pipeline of one chunk a stage, this one has 3 chunks a stage (interleaved-1f1b)"),
])
def test_a_checkpoint_of_other_chunks_is_refused_saying_how_to_resume(saved, now, said):
    with pytest.raises(ValueError) as refused:
        own_stage(payload(saved), rank(0, chunks=now), "ckpt")
    message = str(refused.value)
    assert message.startswith(said) and "resume with the parallel.schedule and parallel.chunks" in message
    assert "\n" not in message
