"""Tensor parallelism on Horovod process sets (hvd_runtime.torch.tensor_parallel), PyTorch.

Real `horovodrun --gloo` jobs, each rank comparing one step of the split MLP with the unsplit one
in its own process (tests/distributed/scripts/tp_step.py); and the layout's arithmetic and
refusals, which need no Horovod.
"""

import json
import sys
from pathlib import Path

import pytest
from torch import nn

from helpers import run_horovod
from hvd_runtime.parallel.tensor_groups import TensorLayout, TensorParallelError
from hvd_runtime.torch.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorGroup

SCRIPT = Path(__file__).parent / "scripts" / "tp_step.py"
TOL = 1e-5  # relative, fp32


def test_layout_keeps_tensor_groups_consecutive_and_lists_every_process_set():
    layout = TensorLayout(world=8, tp=2)
    assert layout.dp == 4 and layout.tp_ranks(5) == [4, 5] and layout.tp_rank(5) == 1
    assert layout.dp_ranks(5) == [1, 3, 5, 7]
    assert layout.process_set_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 2, 4, 6], [1, 3, 5, 7]]
    # tp = world: one group, the global set; no replicas to average over
    assert TensorLayout(world=2, tp=2).process_set_ranks() == []


def test_sizes_that_do_not_split_are_refused_in_one_line():
    with pytest.raises(TensorParallelError) as err:
        TensorLayout(world=3, tp=2)
    assert str(err.value) == ("world size 3 (horovodrun -np) is not tp 2 x replicas: "
                              "use -np 2, 4, 6... or a tp that divides 3")
    group = TensorGroup(rank=0, size=3, process_set=None)
    with pytest.raises(TensorParallelError, match=r"^column-parallel Linear\(in_features=4, out_features=8, "
                                                  r"bias=True\) has 8 features, which do not split over tp 3: "
                                                  r"choose a tp that divides 8$"):
        ColumnParallelLinear(nn.Linear(4, 8), group)
    with pytest.raises(TensorParallelError, match=r"has 4 features, which do not split over tp 3"):
        RowParallelLinear(nn.Linear(4, 6), group)


@pytest.mark.parametrize("np_, tp", [(2, 2), (4, 2)], ids=["tp2", "tp2xdp2"])
def test_split_mlp_step_matches_the_unsplit_model(tmp_path, np_, tp):
    """Outputs, the input's gradient and every parameter's gradient equal the unsplit model's
    (their slice of it) within 1e-5 relative; each rank holds 1/tp of the split weights."""
    out = tmp_path / "r.json"
    run_horovod(np_, [sys.executable, str(SCRIPT), "--tp", str(tp), "--out", str(out)], timeout=300)
    reports = json.loads(out.read_text())
    assert sorted(r["rank"] for r in reports) == list(range(np_))
    assert [r["tp_rank"] for r in sorted(reports, key=lambda r: r["rank"])] == [i % tp for i in range(np_)]
    for r in reports:
        worst = max(r["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] < TOL, f"rank {r['rank']}: {worst[0]} off by {worst[1]:.2e} (relative): {r['errors']}"
        for split, whole in zip(r["split_params"], r["whole_params"]):
            assert split[0] * split[1] * tp == whole[0] * whole[1], (split, whole)
