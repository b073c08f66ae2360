"""Partitioning blocks into stages: optimal balance, user overrides, one-line errors."""

import itertools
import random

import pytest

from hvd_runtime.pipeline.checkpoint import partition_to_resume
from hvd_runtime.pipeline.partition import PartitionError, partition, plan_on_rank0, plan_partition


def brute_force_best(costs, stages):
    n = len(costs)
    best = float("inf")
    for cuts in itertools.combinations(range(1, n), stages - 1):
        edges = [0, *cuts, n]
        best = min(best, max(sum(costs[a:b]) for a, b in zip(edges, edges[1:])))
    return best


@pytest.mark.parametrize("seed", range(30))
def test_balanced_split_is_optimal_contiguous_and_complete(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 9)
    stages = rng.randint(1, n)
    costs = [rng.choice([0, 1, 5, 10, 100, rng.random()]) for _ in range(n)]
    plan = partition([f"b{i}" for i in range(n)], costs, stages)
    assert plan.stages == stages
    assert plan.bounds[0][0] == 0 and plan.bounds[-1][1] == n
    assert all(a < b for a, b in plan.bounds)                                  # non-empty
    assert all(b == c for (_, b), (c, _) in zip(plan.bounds, plan.bounds[1:]))  # contiguous
    assert max(plan.stage_costs()) == pytest.approx(brute_force_best(costs, stages))


def test_balance_by_parameter_count_of_a_typical_mlp():
    names = ["fc1", "relu1", "fc2", "relu2", "fc3", "relu3", "head"]
    params = [8320, 0, 8256, 0, 8256, 0, 650]
    plan = partition(names, params, 2)
    assert plan.bounds == ((0, 3), (3, 7))
    assert plan.stage_names(1) == ["relu2", "fc3", "relu3", "head"]
    assert plan.imbalance() == pytest.approx(16576 / ((16576 + 8906) / 2))
    assert "stage 0: fc1..fc2 (3 blocks, cost 16576)" in plan.describe()
    assert "stage 1: head (1 block, cost 650)" in partition(names, params, 2, starts=["head"]).describe()


def test_the_log_line_names_what_the_costs_count():
    """plan_partition says whether it balanced seconds or parameters, so a `time` run that resumed
    at its checkpoint's cut (planned from stage starts, hence parameter counts) does not print
    parameter counts as if they were timings."""
    names, params, seconds = ["fc1", "fc2", "head"], [8320, 8256, 650], [0.0012, 0.0011, 0.0004]
    by_time = plan_partition(names, 2, "time", lambda: params, lambda: seconds)
    assert by_time.unit == "s" and by_time.describe() == "stage 0: fc1 (1 block, 1.2 ms); stage 1: fc2..head (2 blocks, 1.5 ms)"
    by_params = plan_partition(names, 2, "params", lambda: params)
    assert by_params.describe() == "stage 0: fc1 (1 block, 8,320 parameters); stage 1: fc2..head (2 blocks, 8,906 parameters)"
    slow = plan_partition(names, 2, "time", lambda: params, lambda: [1.23456, 0.5, 0.0001])
    assert slow.describe() == "stage 0: fc1 (1 block, 1,235 ms); stage 1: fc2..head (2 blocks, 500 ms)"
    resumed = plan_partition(names, 2, ["head"], lambda: params, lambda: pytest.fail("a given cut is not timed"))
    assert resumed.describe().endswith("stage 1: head (1 block, 650 parameters)")


def test_override_by_names_and_by_indices_agree():
    names = ["a", "b", "c", "d", "e"]
    by_name = partition(names, [1, 1, 1, 1, 1], 3, starts=["b", "e"])
    by_index = partition(names, [1, 1, 1, 1, 1], 3, starts=[1, 4])
    assert by_name.bounds == by_index.bounds == ((0, 1), (1, 4), (4, 5))


@pytest.mark.parametrize("kwargs,message", [
    (dict(stages=4), "cannot split 3 blocks into 4 stages: every stage needs a block; use stages <= 3"),
    (dict(stages=0), "stages must be a positive integer, got 0"),
    (dict(stages=2, starts=["z"]), "stage start 'z' is not a block: blocks are a, b, c"),
    (dict(stages=2, starts=[0]), "stage start 0 is out of range: stage starts must be 1..2"),
    (dict(stages=3, starts=["c", "b"]), "stage starts must be distinct blocks in model order"),
    (dict(stages=3, starts=["b"]), "stage starts need 2 block(s), where stages 1..2 start, got 1"),
    (dict(stages=2, starts=[1.5]), "stage starts are block names or indices, got 1.5"),
])
def test_errors_are_one_line_and_name_the_bad_value(kwargs, message):
    with pytest.raises(PartitionError) as err:
        partition(["a", "b", "c"], [1, 2, 3], **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_mismatched_costs_and_duplicate_names():
    with pytest.raises(PartitionError, match="got 2 block names but 3 costs"):
        partition(["a", "b"], [1, 2, 3], 2)
    with pytest.raises(PartitionError, match="block names must be unique"):
        partition(["a", "a"], [1, 2], 2)


def test_only_rank0_plans_and_every_rank_takes_its_plan_or_its_refusal():
    """plan_on_rank0 over a two-rank "broadcast" that hands every rank what rank 0 sent."""
    names, costs = ["a", "b", "c", "d"], [1.0, 1.0, 1.0, 3.0]
    calls, sent = [], []

    def broadcast_from(rank):
        def broadcast(obj):
            if rank == 0:
                sent.append(obj)
            return sent[0]
        return broadcast

    def plan():
        calls.append(1)
        return partition(names, costs, 2)
    got = [plan_on_rank0(plan, rank, broadcast_from(rank)) for rank in (0, 1)]
    assert len(calls) == 1, "only rank 0 plans"
    assert got[0] == got[1] and got[1].bounds == ((0, 3), (3, 4))

    sent.clear()

    def refused():
        return partition(names, costs, 5)
    for rank in (0, 1):    # rank 1 raises rank 0's refusal instead of waiting for a plan
        with pytest.raises(PartitionError, match="cannot split 4 blocks into 5 stages"):
            plan_on_rank0(refused if rank == 0 else plan, rank, broadcast_from(rank))
    assert len(calls) == 1


def test_time_resumes_at_the_checkpoints_cut_and_nothing_else_does():
    """`time` would time afresh and may cut elsewhere, which changes a model-split's rounding:
    a resumed run cuts where its newest checkpoint did, when that cut these blocks as many ways."""
    names = ["embed", "block0", "block1", "head"]
    saved = {"names": names, "bounds": [[0, 3], [3, 4]]}
    asked = []

    def newest():
        asked.append(True)
        return saved

    assert partition_to_resume("time", names, 2, newest) == ["head"]
    assert partition_to_resume("time", names, 2, lambda: None) == "time"           # a fresh start times
    assert partition_to_resume("time", names, 3, newest) == "time"                 # another number of stages
    assert partition_to_resume("time", ["embed", "block0", "head"], 2, newest) == "time"   # another model
    asked.clear()
    assert partition_to_resume("params", names, 2, newest) == "params" and not asked   # never read but for time
    assert partition_to_resume(["block1"], names, 2, newest) == ["block1"] and not asked
    plan = plan_partition(names, 2, partition_to_resume("time", names, 2, newest), lambda: [1.0] * 4, None)
    assert plan.cut() == saved
