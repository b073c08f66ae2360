"""The judgement of a tensor-parallel step against its single-process reference, for either framework.

The step scripts (tests/distributed/scripts/*tp_step.py) write one JSON record per rank: its place
in its tensor group, the relative error of its outputs and of each parameter's gradient against
the reference's slice, the share of the split layers' weights it holds, and any reference
parameter it could not compare.
"""

import pytest

from hvd_runtime.config import ModelConfig
from hvd_runtime.parallel.tensor_groups import TensorGroup, TensorParallelError

TOL = 1e-5  # relative, fp32


def check_tp_reports(reports: list[dict], np_: int, tp: int, even: bool = True) -> None:
    """even: every split divides by tp, so each rank holds exactly 1/tp (an odd vocabulary does not)."""
    assert sorted(r["rank"] for r in reports) == list(range(np_))
    assert [r["tp_rank"] for r in sorted(reports, key=lambda r: r["rank"])] == [i % tp for i in range(np_)]
    for r in reports:
        assert r["uncompared"] == [], f"parameters of the whole model with no split counterpart: {r['uncompared']}"
        worst = max(r["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] < TOL, f"rank {r['rank']}: {worst[0]} off by {worst[1]:.2e} (relative): {r['errors']}"
        assert r["split_share"] == pytest.approx(1 / tp) if even else abs(r["split_share"] - 1 / tp) < 0.05


def check_apply_tp_refusals(apply_tp, build_model, plain_model) -> None:
    """A model without transformer blocks, heads that do not divide, dropout: one line each."""
    group = TensorGroup(rank=0, size=2, process_set=None)
    with pytest.raises(TensorParallelError, match=r"^Sequential has no transformer blocks to split .*tensor "
                                                  r"parallelism splits the gpt model; use --strategy data"):
        apply_tp(plain_model, group)
    with pytest.raises(TensorParallelError, match=r"^model.heads 3 do not split over tp 2: choose a tp that divides 3$"):
        apply_tp(build_model(ModelConfig(width=12, heads=3, layers=1, context=4), (4,), 16), group)
    with pytest.raises(TensorParallelError, match=r"^model.dropout 0.1 with tensor parallelism: .*set model.dropout 0$"):
        apply_tp(build_model(ModelConfig(width=8, heads=2, layers=1, context=4, dropout=0.1), (4,), 16), group)


def check_edited_block_refusals(apply_tp, build_model, block_of, add_dropout) -> None:
    """apply_tp reads the head count from the block itself: a Block whose `heads` was changed or
    removed since the config was written, or whose qkv no longer holds 3 x heads, is refused in
    one line; so is one whose dropout layer drops though its config says 0. `block_of(model)`: the
    block of the built model to edit; `add_dropout(block, rate)`: give it a dropout layer at `rate`."""
    group = TensorGroup(rank=0, size=2, process_set=None)

    def edited(edit):
        model = build_model(ModelConfig(width=12, heads=2, layers=2, context=4), (4,), 16)
        edit(block_of(model))
        return model

    with pytest.raises(TensorParallelError, match=r"^model.heads 3 do not split over tp 2: choose a tp that divides 3$"):
        apply_tp(edited(lambda block: setattr(block, "heads", 3)), group)
    with pytest.raises(TensorParallelError, match=r"^model.py's block .+ has no head count: .*keep `self.heads` in Block$"):
        apply_tp(edited(lambda block: delattr(block, "heads")), group)
    with pytest.raises(TensorParallelError, match=r"^model.py's block .+: its qkv layer's 36 (features|units) are not "
                                                  r"3 x 5 heads of one width: "):
        apply_tp(edited(lambda block: setattr(block, "heads", 5)), group)
    with pytest.raises(TensorParallelError, match=r"^model.dropout 0.2 with tensor parallelism: .*set model.dropout 0$"):
        apply_tp(edited(lambda block: add_dropout(block, 0.2)), group)


def load_generated_model(project, name: str):
    """A generated project's model.py, by its path: a `model` module of another project may already be imported."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, project / "model.py")
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    return generated
