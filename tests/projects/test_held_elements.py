"""No rank of a generated GPT project allocates a parameter it does not hold, at any layout (torch and TF).

Under real horovodrun, a pipeline of 2 stages, the same pipeline with each stage split over tp 2,
and the tensor strategy at tp 2 train an epoch each. On every rank the parameter elements made
at start-up (counted as each real nn.Parameter is made, or each Keras variable given a value:
tests/projects/scripts/count_held_elements.py, count_held_variables.py) are exactly the elements
of the parameters the rank trains, and its optimizer holds state for those alone, each of a
parameter's size. Across the ranks the held tensors are the whole model's: each one held whole
by one stage, or by every rank of its tp group, or split so that the group's slices add up to it.

With `partition: time` rank 0 also makes a real copy of each block in turn, to time it, and nothing
more: one block at a time, never the whole model at once (the 2-stage pipeline is cut so).

At the checkpoint ending the epoch no rank allocates a tensor to write it, and the ranks' shards
hold every parameter and its Adam moments exactly once, each rank writing from what it holds.

The model starts the same at every layout (each tensor drawn from the seed and its name): the
2-stage pipeline and 2 stages x tp 2 train the same epoch to 1e-5, as do tp 2 and the whole model
(tp 1, one rank), each reading the same batches.
"""

import json
import sys
from math import prod
from pathlib import Path

import pytest

from helpers import importing, run_horovod
from test_tensor_projects import generate

SCRIPTS = Path(__file__).resolve().parent / "scripts"
pytestmark = pytest.mark.slow
FRAMEWORKS = ["torch", "tensorflow"]
COUNTER = {"torch": "count_held_elements.py", "tensorflow": "count_held_variables.py"}
# The optimizer state a parameter has in a checkpoint: torch AdamW's moments, Keras AdamW's
MOMENTS = {"torch": ("exp_avg", "exp_avg_sq"), "tensorflow": ("momentum", "velocity")}

ONE_EPOCH = ["--train.epochs", "1"]


def counted(framework: str, np_: int, project: Path, ranks: Path, *overrides: str) -> tuple[dict, dict]:
    """held.json of a run (every rank's record, the unsplit shapes) and its epoch's metrics."""
    run_horovod(np_, [sys.executable, str(SCRIPTS / COUNTER[framework]), str(project), str(ranks), *overrides],
                cwd=project, env={"TF_CPP_MIN_LOG_LEVEL": "2"} | importing(project), timeout=400)
    [epoch] = [json.loads(line) for line in (ranks / "rank0" / "runs" / "latest" / "metrics.jsonl").read_text()
               .splitlines()]
    return json.loads((ranks / "held.json").read_text()), epoch


def check_each_rank_made_only_what_it_holds(report: dict, tp: int, framework: str, timed: bool = False) -> None:
    """`timed`: rank 0 timed every block (`partition: time`), each once, besides what it holds."""
    unsplit = report["unsplit"]
    total = sum(prod(shape) for shape in unsplit.values())
    holders: dict[str, list[int]] = {name: [] for name in unsplit}
    for r in report["ranks"]:
        held = sum(prod(shape) for shape in r["held"].values())
        made = held + (total if timed and r["rank"] == 0 else 0)
        assert r["at_start_up"] == made, f"rank {r['rank']} made {r['at_start_up']} parameter elements, holds {held}"
        assert set(r["optimizer_state"]) == set(r["held"]), f"rank {r['rank']}: optimizer state for other tensors"
        for name, sizes in r["optimizer_state"].items():
            assert sizes and all(s == prod(r["held"][name]) for s in sizes), f"rank {r['rank']} {name}: {sizes}"
        if len(report["ranks"]) > 1:
            assert held < total, f"rank {r['rank']} holds the whole model ({held} of {total} elements)"
        for name, shape in r["held"].items():
            assert name in unsplit, f"rank {r['rank']} holds {name}, which the whole model has not"
            holders[name].append(prod(shape))
    for name, sizes in holders.items():
        whole = prod(unsplit[name])
        assert sizes, f"no rank holds {name}"
        assert sizes == [whole] * len(sizes) and len(sizes) in (1, tp) or sum(sizes) == whole and len(sizes) == tp, \
            f"{name} ({whole} elements) held as {sizes}"
    check_each_rank_wrote_only_what_it_holds(report, framework)


def check_each_rank_wrote_only_what_it_holds(report: dict, framework: str) -> None:
    """At a checkpoint no rank allocates a tensor (no gather, no copy), and the shards together
    hold every parameter and its optimizer moments exactly once, each rank's part of what it holds."""
    written: dict[str, int] = {}
    for r in report["ranks"]:
        assert r["at_checkpoint"] and set(r["at_checkpoint"]) == {0}, \
            f"rank {r['rank']} allocated {r['at_checkpoint']} elements to write its checkpoints"
        for key, shape in r["shard"].items():
            kind, rest = key.split("/", 1)
            name = rest if kind == "model" else rest.rsplit("/", 1)[0]
            if name in r["held"] and shape:   # a parameter or a moment of one (buffers and step counts aside)
                assert shape == r["held"][name], f"rank {r['rank']} wrote {key} as {shape}, holds {r['held'][name]}"
                written[key] = written.get(key, 0) + prod(shape)
    for name, shape in report["unsplit"].items():
        for key in (f"model/{name}", *(f"optimizer/{name}/{moment}" for moment in MOMENTS[framework])):
            assert written.get(key) == prod(shape), f"{key}: {written.get(key)} elements written, {prod(shape)} held"


def same_epoch(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    for key in ("train_loss", "train_accuracy", "val_loss"):
        assert a[key] == pytest.approx(b[key], rel=1e-5), key


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_pipeline_stages_and_their_slices_make_only_what_they_hold(tmp_path, framework):
    """pp 2 with its blocks timed on rank 0, and pp 2 x tp 2 cut at block 2: the same epoch."""
    project, args = generate(tmp_path, framework, "--strategy", "pipeline", "--stages", "2", "--tp", "2")
    args += ONE_EPOCH
    pp, pp_epoch = counted(framework, 2, project, tmp_path / "pp2", *args, "--parallel.partition", "time",
                           "--parallel.tp", "1")
    check_each_rank_made_only_what_it_holds(pp, tp=1, framework=framework, timed=True)
    names = [set(r["held"]) for r in pp["ranks"]]
    assert not names[0] & names[1], "two stages hold the same tensor"
    pptp, pptp_epoch = counted(framework, 4, project, tmp_path / "pp2tp2", *args, "--parallel.partition", "2")
    check_each_rank_made_only_what_it_holds(pptp, tp=2, framework=framework)
    same_epoch(pptp_epoch, pp_epoch)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_tensor_parallel_ranks_make_only_their_slices(tmp_path, framework):
    project, args = generate(tmp_path, framework, "--strategy", "tensor")
    args += ONE_EPOCH
    tp, tp_epoch = counted(framework, 2, project, tmp_path / "tp2", *args)
    check_each_rank_made_only_what_it_holds(tp, tp=2, framework=framework)
    assert any(len(shape) == 2 and shape != tp["unsplit"][name] for name, shape in tp["ranks"][0]["held"].items())
    unsplit, unsplit_epoch = counted(framework, 1, project, tmp_path / "tp1", *args, "--parallel.tp", "1")
    check_each_rank_made_only_what_it_holds(unsplit, tp=1, framework=framework)
    same_epoch(tp_epoch, unsplit_epoch)
