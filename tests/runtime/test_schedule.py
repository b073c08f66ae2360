"""Pipeline schedules: complete, deadlock-free, and matching the textbook bubble and memory."""

import itertools

import pytest

from hvd_runtime.config import SCHEDULE_NAMES
from hvd_runtime.pipeline.schedule import (SCHEDULES, Action, Op, build_schedule, bubble_fraction, gpipe_stage, one_f_one_b_stage,
                                           peak_in_flight, schedule_bubble, simulate, simulated_bubble,
                                           theory_peak_in_flight, zero_bubble_h1_stage, one_f_one_b_batched_w_stage)

CASES = list(itertools.product(["gpipe", "1f1b"], [1, 2, 3, 4], [1, 2, 3, 4, 8]))
ZB_CASES = list(itertools.product(["zb-h1"], [1, 2, 3, 4, 8], [1, 2, 3, 4, 8, 16]))
BW_CASES = list(itertools.product(["1f1b-batched-w"], [1, 2, 3, 4, 8], [1, 2, 3, 4, 8, 16]))
# what each schedule computes per micro-batch, in the order it must
COMPUTE_ORDER = {"gpipe": [Op.FORWARD, Op.BACKWARD], "1f1b": [Op.FORWARD, Op.BACKWARD],
                 "zb-h1": [Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT],
                 "1f1b-batched-w": [Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT]}


@pytest.mark.parametrize("name,p,m", CASES + ZB_CASES + BW_CASES)
def test_every_micro_batch_runs_forward_then_backward_once_per_stage(name, p, m):
    for s, acts in enumerate(build_schedule(name, p, m)):
        for op in Op:
            runs = sorted(a.micro_batch for a in acts if a.op is op)
            if op in COMPUTE_ORDER[name]:
                assert runs == list(range(m)), (s, op)
            elif op in (Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT):
                assert not runs, (s, op)
        for i in range(m):
            positions = [acts.index(Action(op, i)) for op in COMPUTE_ORDER[name]]
            assert positions == sorted(positions), (s, i)
        # the first stage reads the data, the last computes the loss: neither talks past the ends
        if s == 0:
            assert not any(a.op in (Op.RECV_ACT, Op.SEND_GRAD) for a in acts)
        if s == p - 1:
            assert not any(a.op in (Op.SEND_ACT, Op.RECV_GRAD) for a in acts)


@pytest.mark.parametrize("name,p,m", CASES)
def test_schedules_run_without_deadlock_and_hit_the_theoretical_bubble(name, p, m):
    for tf, tb in [(1.0, 1.0), (1.0, 2.0)]:
        slots = simulate(build_schedule(name, p, m), tf, tb)
        makespan = max(sl.end for row in slots for sl in row)
        assert makespan == pytest.approx((m + p - 1) * (tf + tb))
        assert simulated_bubble(slots) == pytest.approx(bubble_fraction(p, m))


@pytest.mark.parametrize("name,p,m", ZB_CASES)
def test_zero_bubble_runs_without_deadlock_and_idles_a_third_of_one_f_one_b(name, p, m):
    """Same work as 1F1B (a backward is its input half plus its weight half), a third of its idle time.

    From m = p on the idle time is exactly p-1 units, against 1F1B's 3(p-1); with fewer
    micro-batches than stages there is less weight work to put off, but still less idle time.
    """
    zero = simulate(build_schedule(name, p, m), 1.0, 1.0, 1.0)
    one = simulate(build_schedule("1f1b", p, m), 1.0, 1.0, 1.0)    # its backward: both halves, 2 units
    zero_span, one_span = (max(sl.end for row in slots for sl in row) for slots in (zero, one))
    assert one_span == pytest.approx(3 * m + 3 * (p - 1))
    if m >= p:
        assert zero_span == pytest.approx(3 * m + (p - 1))
        assert simulated_bubble(zero) == pytest.approx((p - 1) / (3 * m + p - 1))
    assert simulated_bubble(zero) == pytest.approx(schedule_bubble(name, p, m))
    assert simulated_bubble(zero) < simulated_bubble(one) or p == 1
    # weight halves that take longer than input halves: still complete, still ahead of 1F1B
    slow_weights = simulate(build_schedule(name, p, m), 1.0, 0.5, 1.5)
    assert simulated_bubble(slow_weights) <= simulated_bubble(simulate(build_schedule("1f1b", p, m), 1.0, 0.5, 1.5))


@pytest.mark.parametrize("name,p,m", BW_CASES)
def test_batched_weight_gradients_run_without_deadlock_and_idle_less_than_one_f_one_b(name, p, m):
    """Input halves in 1F1B's order; weight halves in at most two runs on the first stage (before its
    drain, at the end) and one run at the end elsewhere. Counted in units as if unbatched, two
    stages idle exactly as ZB-H1 does; any number idle less than 1F1B."""
    batched = simulate(build_schedule(name, p, m), 1.0, 1.0, 1.0)
    assert simulated_bubble(batched) == pytest.approx(schedule_bubble(name, p, m))
    one = simulated_bubble(simulate(build_schedule("1f1b", p, m), 1.0, 1.0, 1.0))
    assert simulated_bubble(batched) < one or p == 1
    if p == 2 and m >= 2:
        assert simulated_bubble(batched) == pytest.approx((p - 1) / (3 * m + p - 1))
    for s, acts in enumerate(build_schedule(name, p, m)):
        ops = [a.op for a in acts]
        runs = sum(1 for k, op in enumerate(ops) if op is Op.BACKWARD_WEIGHT and (k == 0 or ops[k - 1] is not op))
        assert ops[-1] is Op.BACKWARD_WEIGHT
        assert runs == (2 if s == 0 and 1 < p <= m else 1), (s, ops)


@pytest.mark.parametrize("name,p,m", CASES + ZB_CASES + BW_CASES)
def test_peak_activations_in_flight(name, p, m):
    peaks = [peak_in_flight(acts) for acts in build_schedule(name, p, m)]
    assert max(peaks) == theory_peak_in_flight(name, p, m)
    assert peaks == [theory_peak_in_flight(name, p, m, s) for s in range(p)]
    if name == "1f1b":
        assert peaks == [min(p - s, m) for s in range(p)]
    elif name == "zb-h1":   # 1F1B's first stage, on every stage
        assert peaks == [min(p, m)] * p
    else:
        assert peaks == [m] * p


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)


def computes(stage_schedule, stage: int, stages: int = 2, micro_batches: int = 4) -> list[tuple[Op, int]]:
    """A stage's compute actions in order, as (op, micro-batch): its sends and receives left out."""
    return [(a.op, a.micro_batch) for a in stage_schedule(stage, stages, micro_batches) if a.op in COMPUTE]


def test_one_f_one_b_two_stages_four_micro_batches_reads_like_the_diagram():
    f, b = Op.FORWARD, Op.BACKWARD
    first, last = computes(one_f_one_b_stage, 0), computes(one_f_one_b_stage, 1)
    assert first == [(f, 0), (f, 1), (b, 0), (f, 2), (b, 1), (f, 3), (b, 2), (b, 3)]
    assert last == [(f, 0), (b, 0), (f, 1), (b, 1), (f, 2), (b, 2), (f, 3), (b, 3)]


def test_zero_bubble_two_stages_four_micro_batches_reads_like_the_paper():
    """Stage 0 runs each weight half right after its input half; the last stage one micro-batch late."""
    f, b, w = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    first, last = computes(zero_bubble_h1_stage, 0), computes(zero_bubble_h1_stage, 1)
    assert first == [(f, 0), (f, 1), (b, 0), (w, 0), (f, 2), (b, 1), (w, 1), (f, 3), (b, 2), (w, 2), (b, 3), (w, 3)]
    assert last == [(f, 0), (b, 0), (f, 1), (b, 1), (w, 0), (f, 2), (b, 2), (w, 1), (f, 3), (b, 3), (w, 2), (w, 3)]


def test_batched_weight_gradients_two_stages_four_micro_batches():
    f, b, w = Op.FORWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT
    first, last = computes(one_f_one_b_batched_w_stage, 0), computes(one_f_one_b_batched_w_stage, 1)
    # stage 0 runs the weights of micro-batches 0-2 while stage 1 works on micro-batch 3
    assert first == [(f, 0), (f, 1), (b, 0), (f, 2), (b, 1), (f, 3), (b, 2), (w, 0), (w, 1), (w, 2), (b, 3), (w, 3)]
    assert last == [(f, 0), (b, 0), (f, 1), (b, 1), (f, 2), (b, 2), (f, 3), (b, 3), (w, 0), (w, 1), (w, 2), (w, 3)]


def test_gpipe_fills_then_drains():
    ops = [a.op for a in gpipe_stage(0, 2, 3) if a.op in (Op.FORWARD, Op.BACKWARD)]
    assert ops == [Op.FORWARD] * 3 + [Op.BACKWARD] * 3


def test_simulate_reports_a_deadlock():
    # both stages wait for each other's message first
    bad = [[Action(Op.RECV_GRAD, 0), Action(Op.FORWARD, 0), Action(Op.SEND_ACT, 0), Action(Op.BACKWARD, 0)],
           [Action(Op.RECV_ACT, 0), Action(Op.FORWARD, 0), Action(Op.BACKWARD, 0), Action(Op.SEND_GRAD, 0)]]
    with pytest.raises(RuntimeError, match="deadlocks: stage 0 at recv_grad"):
        simulate(bad)


def test_bubble_formula_and_errors():
    assert bubble_fraction(2, 1) == pytest.approx(0.5)
    assert bubble_fraction(2, 8) == pytest.approx(1 / 9)
    assert bubble_fraction(1, 5) == 0.0
    with pytest.raises(ValueError, match="unknown schedule .zigzag.*gpipe, 1f1b, zb-h1, interleaved-1f1b, 1f1b-batched-w"):
        build_schedule("zigzag", 2, 4)
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'"):
        schedule_bubble("zigzag", 2, 4)
    assert schedule_bubble("1f1b", 2, 8) == schedule_bubble("gpipe", 2, 8) == pytest.approx(1 / 9)
    assert schedule_bubble("zb-h1", 2, 8) == pytest.approx(1 / 25)
    with pytest.raises(ValueError, match="micro_batches must be a positive integer, got 0"):
        build_schedule("gpipe", 2, 0)


INTERLEAVED_CASES = list(itertools.product([2, 3, 4], [2, 3], [1, 2, 3, 4, 5, 6, 8, 12]))


@pytest.mark.parametrize("p,v,m", INTERLEAVED_CASES)
def test_interleaved_runs_every_chunk_of_every_micro_batch_once_and_talks_round_the_ring(p, v, m):
    for s, acts in enumerate(build_schedule("interleaved-1f1b", p, m, v)):
        for c in range(v):
            virtual = c * p + s
            for op in (Op.FORWARD, Op.BACKWARD):
                assert sorted(a.micro_batch for a in acts if a.op is op and a.chunk == c) == list(range(m)), (s, c, op)
            for i in range(m):
                assert acts.index(Action(Op.FORWARD, i, c)) < acts.index(Action(Op.BACKWARD, i, c))
            ops = {a.op for a in acts if a.chunk == c}
            # only the model's first chunk reads the data and only its last computes the loss
            assert (Op.RECV_ACT in ops, Op.SEND_GRAD in ops) == (virtual > 0, virtual > 0), (s, c)
            assert (Op.SEND_ACT in ops, Op.RECV_GRAD in ops) == ((virtual < p * v - 1),) * 2, (s, c)


@pytest.mark.parametrize("p,v,m", INTERLEAVED_CASES)
def test_interleaved_runs_without_deadlock_in_order_and_divides_the_bubble_by_v(p, v, m):
    """On ideal hardware (a chunk costs 1/v of a stage) the bubble is (p-1)/(vm+p-1) when m is a
    multiple of p: 1F1B's divided by about v. Otherwise the chunk-by-chunk fallback still runs."""
    slots = simulate(build_schedule("interleaved-1f1b", p, m, v), 1.0, 2.0)
    bubble = simulated_bubble(slots)
    assert bubble == pytest.approx(schedule_bubble("interleaved-1f1b", p, m, v))
    if m % p == 0:
        assert bubble == pytest.approx((p - 1) / (v * m + p - 1))
        assert bubble < bubble_fraction(p, m)
        makespan = max(sl.end for row in slots for sl in row)
        assert makespan == pytest.approx((m + (p - 1) / v) * 3.0)
    peaks = [peak_in_flight(acts) for acts in build_schedule("interleaved-1f1b", p, m, v)]
    assert peaks == [theory_peak_in_flight("interleaved-1f1b", p, m, s, v) for s in range(p)]


def test_interleaved_two_ranks_two_chunks_reads_like_megatron():
    """Micro-batches go round in groups of p: rank 0 warms up with (v-1)p + 2(p-1) = 4 forwards."""
    def order(rank):
        return [str(a) for a in build_schedule("interleaved-1f1b", 2, 4, 2)[rank] if a.op in (Op.FORWARD, Op.BACKWARD)]
    assert order(0) == ["forward(0)", "forward(1)", "forward(0@1)", "forward(1@1)", "forward(2)", "backward(0@1)",
                        "forward(3)", "backward(1@1)", "forward(2@1)", "backward(0)", "forward(3@1)", "backward(1)",
                        "backward(2@1)", "backward(3@1)", "backward(2)", "backward(3)"]
    assert order(1)[:4] == ["forward(0)", "forward(1)", "forward(0@1)", "backward(0@1)"]


def test_simulate_reports_messages_taken_out_of_order():
    """The links deliver one kind of message from one rank in the order sent; a schedule that reads
    micro-batch 1 before 0 would get the wrong tensor there, and the simulator says so."""
    swapped = [_ for _ in build_schedule("1f1b", 2, 2)]
    last = [a for a in swapped[1]]
    first_recv, second_recv = (k for k, a in enumerate(last) if a.op is Op.RECV_ACT)
    last[first_recv], last[second_recv] = last[second_recv], last[first_recv]
    with pytest.raises(RuntimeError, match="out of order"):
        simulate([swapped[0], last])


def test_interleaved_refusals():
    with pytest.raises(ValueError, match="interleaved-1f1b needs at least 2 chunks per rank, got 1"):
        build_schedule("interleaved-1f1b", 2, 4, 1)
    with pytest.raises(ValueError, match="schedule '1f1b' runs one chunk per rank, got 2: use interleaved-1f1b"):
        build_schedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="chunks must be a positive integer, got 0"):
        build_schedule("gpipe", 2, 4, 0)


def test_every_schedule_the_config_takes_is_built():
    """hvd_runtime.config names the schedules (it imports nothing of the pipeline); this module builds them."""
    assert tuple(SCHEDULES) == SCHEDULE_NAMES
