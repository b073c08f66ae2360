"""Pipeline schedules as pure Python: which stage does what, in which order.

A schedule is computed once, framework-free, and executed by the torch (and later TF) executor.
For p stages and m micro-batches, `gpipe(p, m)` and `one_f_one_b(p, m)` return one list of
`Action`s per stage. An executor walks its own stage's list top to bottom:

    RECV_ACT i   receive the input activation of micro-batch i from the previous stage
    FORWARD i    run this stage on micro-batch i (the last stage also computes the loss)
    SEND_ACT i   send the output activation of micro-batch i to the next stage
    RECV_GRAD i  receive the gradient of this stage's output for micro-batch i
    BACKWARD i   back-propagate micro-batch i through this stage
    SEND_GRAD i  send the gradient of this stage's input to the previous stage

Sends are meant to be non-blocking (posted, waited for at the end of the step) and receives
blocking; under that rule both schedules are deadlock-free, which `simulate` checks.

Theory: both schedules leave the same idle fraction, the bubble (p-1)/(m+p-1) when forward and
backward cost the same on every stage. They differ in memory: GPipe keeps all m micro-batches'
activations alive until the drain starts; 1F1B starts back-propagating as soon as the pipeline is
full, so stage s never holds more than p - s micro-batches.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence


class Op(str, enum.Enum):
    RECV_ACT = "recv_act"
    FORWARD = "forward"
    SEND_ACT = "send_act"
    RECV_GRAD = "recv_grad"
    BACKWARD = "backward"
    SEND_GRAD = "send_grad"


COMPUTE = (Op.FORWARD, Op.BACKWARD)


@dataclass(frozen=True)
class Action:
    op: Op
    micro_batch: int

    def __str__(self) -> str:
        return f"{self.op.value}({self.micro_batch})"


def _check(stages: int, micro_batches: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r} (e.g. 2)")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r} (e.g. 4)")


def _forward(stage: int, stages: int, i: int) -> list[Action]:
    acts = [Action(Op.RECV_ACT, i)] if stage > 0 else []
    acts.append(Action(Op.FORWARD, i))
    if stage < stages - 1:
        acts.append(Action(Op.SEND_ACT, i))
    return acts


def _backward(stage: int, stages: int, i: int) -> list[Action]:
    acts = [Action(Op.RECV_GRAD, i)] if stage < stages - 1 else []
    acts.append(Action(Op.BACKWARD, i))
    if stage > 0:
        acts.append(Action(Op.SEND_GRAD, i))
    return acts


def gpipe_stage(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """Fill, then drain: every forward first, then every backward, in micro-batch order."""
    _check(stages, micro_batches)
    acts: list[Action] = []
    for i in range(micro_batches):
        acts += _forward(stage, stages, i)
    for i in range(micro_batches):
        acts += _backward(stage, stages, i)
    return acts


def one_f_one_b_stage(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """Warm up with p-1-s forwards, then alternate one forward and one backward, then drain."""
    _check(stages, micro_batches)
    warmup = min(stages - 1 - stage, micro_batches)
    acts: list[Action] = []
    for i in range(warmup):
        acts += _forward(stage, stages, i)
    for j in range(micro_batches - warmup):
        acts += _forward(stage, stages, warmup + j)
        acts += _backward(stage, stages, j)
    for i in range(micro_batches - warmup, micro_batches):
        acts += _backward(stage, stages, i)
    return acts


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe_stage,
    "1f1b": one_f_one_b_stage,
}


def build_schedule(name: str, stages: int, micro_batches: int) -> list[list[Action]]:
    """Every stage's action list for the schedule called `name` ("gpipe" or "1f1b")."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)} (e.g. '1f1b')")
    return [SCHEDULES[name](s, stages, micro_batches) for s in range(stages)]


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a step with equal stages and free communication: (p-1)/(m+p-1)."""
    _check(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward ran but whose backward has not: activations held."""
    live = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op is Op.BACKWARD:
            live -= 1
    return peak


def theory_peak_in_flight(name: str, stages: int, micro_batches: int) -> int:
    """GPipe holds all m; 1F1B holds at most p (on the first stage)."""
    _check(stages, micro_batches)
    return micro_batches if name == "gpipe" else min(stages, micro_batches)


@dataclass(frozen=True)
class Slot:
    """One simulated action on one stage: what ran, and when."""
    stage: int
    action: Action
    start: float
    end: float


def simulate(schedule: Sequence[Sequence[Action]], forward_time: float = 1.0,
             backward_time: float = 1.0) -> list[list[Slot]]:
    """Play a schedule on ideal hardware: compute takes fixed time, messages are free.

    Sends are non-blocking; a receive waits for its matching send. Raises RuntimeError naming the
    stuck stages if the schedule deadlocks or a receive has no matching send, so a schedule that
    simulates is one an executor can run.
    """
    p = len(schedule)
    pos = [0] * p
    clock = [0.0] * p
    sent: dict[tuple[str, int, int], float] = {}   # (direction, destination stage, mb) -> time
    out: list[list[Slot]] = [[] for _ in range(p)]
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                start = clock[s]
                if a.op is Op.RECV_ACT or a.op is Op.RECV_GRAD:
                    key = ("act" if a.op is Op.RECV_ACT else "grad", s, a.micro_batch)
                    if key not in sent:
                        break
                    start = max(start, sent.pop(key))
                    end = start
                elif a.op is Op.FORWARD or a.op is Op.BACKWARD:
                    end = start + (forward_time if a.op is Op.FORWARD else backward_time)
                else:
                    dest = s + 1 if a.op is Op.SEND_ACT else s - 1
                    if not 0 <= dest < p:
                        raise RuntimeError(f"stage {s} sends {a} to missing stage {dest}")
                    sent[("act" if a.op is Op.SEND_ACT else "grad", dest, a.micro_batch)] = start
                    end = start
                out[s].append(Slot(s, a, start, end))
                clock[s] = end
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} at {schedule[s][pos[s]]}" for s in range(p) if pos[s] < len(schedule[s])]
            raise RuntimeError("schedule deadlocks: " + "; ".join(stuck))
    if sent:
        raise RuntimeError(f"messages sent but never received: {sorted(sent)}")
    return out


def simulated_bubble(slots: Sequence[Sequence[Slot]]) -> float:
    """1 - compute time / (stages x makespan) of a simulated (or measured) step."""
    start = min(sl.start for row in slots for sl in row)
    end = max(sl.end for row in slots for sl in row)
    busy = sum(sl.end - sl.start for row in slots for sl in row if sl.action.op in COMPUTE)
    return 1.0 - busy / (len(slots) * (end - start))
