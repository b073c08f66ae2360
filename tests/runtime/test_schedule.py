"""Pipeline schedules: complete, deadlock-free, and matching the textbook bubble and memory."""

import itertools

import pytest

from hvd_runtime.pipeline.schedule import (Action, Op, build_schedule, bubble_fraction, gpipe_stage, one_f_one_b_stage,
                                  peak_in_flight, simulate, simulated_bubble, theory_peak_in_flight)

CASES = list(itertools.product(["gpipe", "1f1b"], [1, 2, 3, 4], [1, 2, 3, 4, 8]))


@pytest.mark.parametrize("name,p,m", CASES)
def test_every_micro_batch_runs_forward_then_backward_once_per_stage(name, p, m):
    for s, acts in enumerate(build_schedule(name, p, m)):
        fwd = [a.micro_batch for a in acts if a.op is Op.FORWARD]
        bwd = [a.micro_batch for a in acts if a.op is Op.BACKWARD]
        assert sorted(fwd) == list(range(m)) and sorted(bwd) == list(range(m))
        for i in range(m):
            assert acts.index(Action(Op.FORWARD, i)) < acts.index(Action(Op.BACKWARD, i))
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


@pytest.mark.parametrize("name,p,m", CASES)
def test_peak_activations_in_flight(name, p, m):
    peaks = [peak_in_flight(acts) for acts in build_schedule(name, p, m)]
    assert max(peaks) == theory_peak_in_flight(name, p, m)
    if name == "1f1b":
        assert peaks == [min(p - s, m) for s in range(p)]
    else:
        assert peaks == [m] * p


def test_one_f_one_b_two_stages_four_micro_batches_reads_like_the_diagram():
    f, b = Op.FORWARD, Op.BACKWARD
    first = [(a.op, a.micro_batch) for a in one_f_one_b_stage(0, 2, 4) if a.op in (f, b)]
    last = [(a.op, a.micro_batch) for a in one_f_one_b_stage(1, 2, 4) if a.op in (f, b)]
    assert first == [(f, 0), (f, 1), (b, 0), (f, 2), (b, 1), (f, 3), (b, 2), (b, 3)]
    assert last == [(f, 0), (b, 0), (f, 1), (b, 1), (f, 2), (b, 2), (f, 3), (b, 3)]


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
    with pytest.raises(ValueError, match="unknown schedule 'zigzag'.*gpipe, 1f1b"):
        build_schedule("zigzag", 2, 4)
    with pytest.raises(ValueError, match="micro_batches must be a positive integer, got 0"):
        build_schedule("gpipe", 2, 0)
