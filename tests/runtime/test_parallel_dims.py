"""The rank grid every strategy shares (hvd_runtime.parallel.dims), and what each strategy starts it with (layout).

Pure arithmetic: no Horovod, no framework (layout.start is handed init functions that record their arguments).
"""

import pytest

from hvd_runtime.parallel.dims import Coords, ParallelConfigError, ParallelDims


def test_tensor_groups_are_innermost_then_stages_then_replicas():
    dims = ParallelDims(world=8, tp=2, pp=2)
    assert dims.dp == 2 and dims.describe() == "8 ranks = 2 stages x tp 2 x 2 replicas"
    assert [tuple(dims.coords(r)) for r in range(8)] == [
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1)]
    assert all(dims.rank_of(*dims.coords(r)) == r for r in range(8))
    assert dims.coords(5) == Coords(dp=1, pp=0, tp=1)
    assert dims.tp_ranks(5) == [4, 5]          # same replica and stage: one host
    assert dims.pp_ranks(5) == [5, 7]          # the stages rank 5's activations flow through
    assert dims.dp_ranks(5) == [1, 5]          # the ranks holding rank 5's parameters


def test_every_process_set_is_listed_once_tp_then_dp_then_pairs():
    dims = ParallelDims(world=8, tp=2, pp=2)
    assert dims.process_set_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 4], [1, 5], [2, 6], [3, 7]]
    assert dims.process_set_ranks(pairs=True)[8:] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_a_pipeline_alone_keeps_its_stages_consecutive():
    dims = ParallelDims(world=6, pp=3)
    assert dims.dp == 2 and dims.describe() == "6 ranks = 3 stages x 2 replicas"
    assert [(c.pp, c.dp) for c in map(dims.coords, range(6))] == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1)]
    assert dims.dp_ranks(4) == [1, 4]
    assert dims.process_set_ranks() == [[0, 3], [1, 4], [2, 5]]
    assert dims.process_set_ranks(pairs=True)[3:] == [[0, 1], [1, 2], [3, 4], [4, 5]]


def test_tensor_parallel_alone_groups_consecutive_ranks():
    dims = ParallelDims(world=8, tp=2)
    assert dims.dp == 4 and dims.tp_ranks(5) == [4, 5] and dims.coords(5).tp == 1
    assert dims.dp_ranks(5) == [1, 3, 5, 7]
    assert dims.process_set_ranks() == [[0, 1], [2, 3], [4, 5], [6, 7], [0, 2, 4, 6], [1, 3, 5, 7]]


@pytest.mark.parametrize("world, tp, pp, staggered", [
    (4, 2, 2, True), (8, 2, 2, True), (4, 2, 1, False), (4, 1, 4, False), (2, 1, 1, False)])
def test_only_a_pipeline_of_tensor_parallel_stages_reduces_on_some_ranks_at_a_time(world, tp, pp, staggered):
    """Its idle loops must wake often (hvd_runtime.scaling.set_cycle_time's staggered)."""
    assert ParallelDims(world, tp=tp, pp=pp).staggered is staggered


def test_groups_of_one_and_the_whole_world_need_no_set_of_their_own():
    assert ParallelDims(world=2, tp=2).process_set_ranks() == []           # one group: the global set
    assert ParallelDims(world=2, pp=2).process_set_ranks(pairs=True) == []  # the only pair is the world
    assert ParallelDims(world=3).process_set_ranks() == []                 # plain data parallel
    assert ParallelDims(world=3).describe() == "3 ranks = 3 replicas"


@pytest.mark.parametrize("world, tp, pp, line", [
    (3, 2, 1, "world size 3 (horovodrun -np) is not tp 2 x replicas: use -np 2, 4, 6... or a tp that divides 3"),
    (3, 1, 2, "world size 3 (horovodrun -np) is not stages 2 x replicas: use -np 2, 4, 6... "
              "or a --stages that divides 3"),
    (6, 2, 2, "world size 6 (horovodrun -np) is not tp 2 x stages 2 x replicas: use -np 4, 8, 12... "
              "or tp and --stages whose product divides 6"),
    (2, 0, 1, "tp must be a positive integer, got 0 (e.g. 2)"),
    (2, 1, "2", "stages must be a positive integer, got '2' (e.g. 2)"),
])
def test_a_world_that_does_not_fit_is_refused_in_one_line_naming_np_and_the_factors(world, tp, pp, line):
    with pytest.raises(ParallelConfigError) as err:
        ParallelDims(world=world, tp=tp, pp=pp)
    assert str(err.value) == line


@pytest.mark.parametrize("vocab, tp, rows", [(16, 2, [(0, 8), (8, 16)]), (17, 2, [(0, 9), (9, 17)]),
                                             (50257, 4, [(0, 12565), (12565, 25129), (25129, 37693), (37693, 50257)])])
def test_a_vocabulary_splits_into_consecutive_rows_unequal_by_at_most_one(vocab, tp, rows):
    from hvd_runtime.parallel.tensor_groups import VocabularyShare, vocab_range

    assert [(r.start, r.stop) for r in (vocab_range(vocab, tp, i) for i in range(tp))] == rows
    assert VocabularyShare.of(None, vocab).rows == slice(0, vocab)


def test_a_vocabulary_smaller_than_tp_is_refused_in_one_line():
    from hvd_runtime.parallel.tensor_groups import TensorParallelError, vocab_range

    with pytest.raises(TensorParallelError, match=r"^a vocabulary of 3 tokens does not split over tp 4: "
                                                  r"choose a tp of at most 3$"):
        vocab_range(3, 4, 0)


@pytest.mark.parametrize("strategy, started", [
    ("data", ("init_horovod", {})),
    ("model-split", ("init_horovod", {"devices_per_rank": 3})),
    ("tensor", ("init_horovod", {"tp": 2})),
    ("pipeline", ("init_pipeline", {"stages": 3, "tp": 2, "chunks": 1})),
])
def test_each_strategy_starts_horovod_as_cfg_parallel_lays_it_out(strategy, started):
    """layout.start: the call and the layout each strategy starts Horovod with, seed, threads and
    cycle time always from cfg; the interleaved schedule's chunks from parallel.chunks."""
    from hvd_runtime.config import RunConfig
    from hvd_runtime.parallel.layout import start

    cfg = RunConfig()
    cfg.seed, cfg.parallel.stages, cfg.parallel.tp = 7, 3, 2
    cfg.horovod.threads_per_rank, cfg.horovod.cycle_time_ms = 2, 1.5
    calls = []

    def init_horovod(**kwargs):
        calls.append(("init_horovod", kwargs))
        return "ctx"

    def init_pipeline(stages, **kwargs):
        calls.append(("init_pipeline", {"stages": stages, **kwargs}))
        return "ctx", "dims"

    assert start(cfg, strategy, init_horovod, init_pipeline) == "ctx"
    common = {"seed": 7, "threads_per_rank": 2, "cycle_time_ms": 1.5}
    assert calls == [(started[0], {**started[1], **common})]
    if strategy == "pipeline":
        cfg.parallel.schedule, cfg.parallel.chunks = "interleaved-1f1b", 2
        start(cfg, strategy, init_horovod, init_pipeline)
        assert calls[-1][1]["chunks"] == 2


def test_an_unknown_strategy_is_refused_in_one_line():
    from hvd_runtime.config import ConfigError, RunConfig
    from hvd_runtime.parallel.layout import start

    with pytest.raises(ConfigError, match=r"^unknown strategy 'zero': choose one of data, model-split, tensor, pipeline$"):
        start(RunConfig(), "zero", None, None)
