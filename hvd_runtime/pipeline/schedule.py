"""Pipeline schedules as pure Python: which stage does what, in which order.

A schedule is computed once, framework-free, and executed by the pipeline engines.
For p stages and m micro-batches, `build_schedule(name, p, m)` returns one list of `Action`s per
stage. An executor walks its own stage's list top to bottom:

    RECV_ACT i          receive the input activation of micro-batch i from the previous stage
    FORWARD i           run this stage on micro-batch i (the last stage also computes the loss)
    SEND_ACT i          send the output activation of micro-batch i to the next stage
    RECV_GRAD i         receive the gradient of this stage's output for micro-batch i
    BACKWARD i          back-propagate micro-batch i through this stage: input and weight gradients
    BACKWARD_INPUT i    (zero-bubble) only the gradient of this stage's input, what the previous stage waits for
    BACKWARD_WEIGHT i   (zero-bubble) the weights' gradients of micro-batch i, whenever the stage would idle
    SEND_GRAD i         send the gradient of this stage's input to the previous stage

Sends are meant to be non-blocking (posted, waited for at the end of the step) and receives
blocking; under that rule every schedule here is deadlock-free, which `simulate` checks.

Theory, when forward and backward cost the same on every stage: GPipe and 1F1B leave the same
idle fraction, the bubble (p-1)/(m+p-1). They differ in memory: GPipe keeps all m micro-batches'
activations alive until the drain starts; 1F1B starts back-propagating as soon as the pipeline is
full, so stage s never holds more than p - s micro-batches.

ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023) splits each backward in two. The
chain from the loss back to the first stage then carries only input gradients, and each stage
puts off its weight gradients to fill what would be idle time at the end of the step: stage s
runs 1F1B's forwards and input backwards, with its weight backwards s micro-batches behind.
With forward, input backward and weight backward each costing one unit, the idle time falls
from 1F1B's 3(p-1) units to p-1, for the memory of 1F1B's first stage: p micro-batches on every stage.
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
    BACKWARD_INPUT = "backward_input"
    BACKWARD_WEIGHT = "backward_weight"
    SEND_GRAD = "send_grad"


COMPUTE = (Op.FORWARD, Op.BACKWARD, Op.BACKWARD_INPUT, Op.BACKWARD_WEIGHT)
RELEASES = (Op.BACKWARD, Op.BACKWARD_WEIGHT)   # the action after which a micro-batch's activations are free


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


def _backward(stage: int, stages: int, i: int, op: Op = Op.BACKWARD) -> list[Action]:
    acts = [Action(Op.RECV_GRAD, i)] if stage < stages - 1 else []
    acts.append(Action(op, i))
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


def zero_bubble_h1_stage(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """1F1B's order of forwards and input backwards; each weight backward `stage` micro-batches late.

    The last stage, which 1F1B leaves idle longest at the end of a step, puts off the most weight
    work to fill that time; the first stage, on the critical path, puts off none. A stage holds a
    micro-batch's activations until its weight backward: warm-up (p-1-s) + 1 + s = p at most.
    """
    _check(stages, micro_batches)
    warmup = min(stages - 1 - stage, micro_batches)
    acts: list[Action] = []
    late: list[int] = []    # micro-batches whose weight backward is still to run, oldest first

    def backward(i: int) -> None:
        acts.extend(_backward(stage, stages, i, Op.BACKWARD_INPUT))
        late.append(i)
        if len(late) > stage:
            acts.append(Action(Op.BACKWARD_WEIGHT, late.pop(0)))

    for i in range(warmup):
        acts += _forward(stage, stages, i)
    for j in range(micro_batches - warmup):
        acts += _forward(stage, stages, warmup + j)
        backward(j)
    for i in range(micro_batches - warmup, micro_batches):
        backward(i)
    acts += [Action(Op.BACKWARD_WEIGHT, i) for i in late]
    return acts


SCHEDULES: dict[str, Callable[[int, int, int], list[Action]]] = {
    "gpipe": gpipe_stage,
    "1f1b": one_f_one_b_stage,
    "zb-h1": zero_bubble_h1_stage,
}
SPLIT_BACKWARD = ("zb-h1",)   # schedules whose engine runs input and weight gradients apart
# Why those run on PyTorch only: said by the generator and by the TensorFlow engine at start-up.
# (hvdgen.catalog offers TensorFlow projects the others only; hvd_runtime.config takes every name.)
SPLIT_BACKWARD_TORCH_ONLY = ("runs on PyTorch only: Keras layers inside a block have no hook to catch their outputs, "
                             "so TensorFlow's weight half would redo each block's backward")


def _check_name(name: str) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)} (e.g. '1f1b')")


def build_schedule(name: str, stages: int, micro_batches: int) -> list[list[Action]]:
    """Every stage's action list for the schedule called `name` ("gpipe", "1f1b" or "zb-h1")."""
    _check_name(name)
    return [SCHEDULES[name](s, stages, micro_batches) for s in range(stages)]


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe or 1F1B step with equal stages and free communication: (p-1)/(m+p-1)."""
    _check(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def schedule_bubble(name: str, stages: int, micro_batches: int) -> float:
    """Idle share of a step of schedule `name` with equal stages and free communication.

    GPipe and 1F1B: (p-1)/(m+p-1). ZB-H1, with forward, input backward and weight backward one
    unit each: from m = p on, p-1 idle units against 3m busy ones on each stage, (p-1)/(3m+p-1);
    with fewer micro-batches than stages there is not enough weight work to put off, and the
    answer is the schedule played on ideal hardware.
    """
    _check_name(name)
    _check(stages, micro_batches)
    if name not in SPLIT_BACKWARD:
        return bubble_fraction(stages, micro_batches)
    if micro_batches >= stages:
        return (stages - 1) / (3 * micro_batches + stages - 1)
    return simulated_bubble(simulate(build_schedule(name, stages, micro_batches), 1.0, 1.0, 1.0))


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward ran but whose backward has not: activations held."""
    live = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op in RELEASES:
            live -= 1
    return peak


def theory_peak_in_flight(name: str, stages: int, micro_batches: int, stage: int = 0) -> int:
    """Micro-batches stage `stage` holds at most: GPipe all m; 1F1B p - stage; ZB-H1 p on every stage.

    The first stage (the default) holds the most in each schedule: that is the job's peak.
    """
    _check(stages, micro_batches)
    if name == "gpipe":
        return micro_batches
    return min(stages - (stage if name == "1f1b" else 0), micro_batches)


@dataclass(frozen=True)
class Slot:
    """One simulated action on one stage: what ran, and when."""
    stage: int
    action: Action
    start: float
    end: float


def simulate(schedule: Sequence[Sequence[Action]], forward_time: float = 1.0,
             backward_time: float = 1.0, weight_time: float = 0.0) -> list[list[Slot]]:
    """Play a schedule on ideal hardware: compute takes fixed time, messages are free.

    An input backward takes `backward_time`, a weight backward `weight_time`, and a whole
    backward both.

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
                elif a.op in COMPUTE:
                    end = start + {Op.FORWARD: forward_time, Op.BACKWARD: backward_time + weight_time,
                                   Op.BACKWARD_INPUT: backward_time, Op.BACKWARD_WEIGHT: weight_time}[a.op]
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
