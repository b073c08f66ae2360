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

1F1B with batched weight gradients (`1f1b-batched-w`) splits the backward the same way but puts
the weight backwards off and runs them in batches: a layer's weight gradient for many micro-batches
becomes one matrix product over all their rows instead of one thin product each, each writing the
whole weight-sized gradient again (the cost that makes small micro-batches slow). The first stage
runs one batch while it would wait for its drain's gradients, the rest at the end; every other
stage runs all of them at the end of the step. The previous stage still waits only for input
gradients. Counted in units (forward, input and weight backward one each, as if unbatched) two
stages idle as little as ZB-H1, (p-1)/(3m+p-1) from m = 2 on; more stages idle more than ZB-H1 and
less than 1F1B, and batching makes the weight units cheaper than that count. A stage holds its
micro-batches until their weight pass, up to m as GPipe does, though only what the weight products
need (each layer's input and its output's gradient), not the whole graph.

Interleaved 1F1B (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU
Clusters", 2021; Megatron-LM's virtual pipeline) gives each of the p ranks v chunks of the model
instead of one contiguous stage: the model is cut into p x v virtual stages, and rank r holds
virtual stages r, r + p, r + 2p, ... A micro-batch travels round the ring of ranks v times, the
last rank's chunk c handing on to the first rank's chunk c + 1. Each action then names its
`chunk`. The fill and drain cost a chunk's time, 1/v of a stage's, so the bubble is divided by v:
(p-1)/(vm+p-1), for v times as many messages and more activations on the first ranks.
It needs m to be a multiple of p (micro-batches go round in groups of p); a smaller batch, an
epoch's last, runs the chunks one after the other, GPipe-like, which any m allows.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from hvd_runtime.config import INTERLEAVED


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
    chunk: int = 0      # interleaved schedules: which of the rank's chunks (virtual stage chunk x p + rank)

    def __str__(self) -> str:
        at = f"@{self.chunk}" if self.chunk else ""
        return f"{self.op.value}({self.micro_batch}{at})"


def _check(stages: int, micro_batches: int, chunks: int = 1) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be a positive integer, got {stages!r} (e.g. 2)")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be a positive integer, got {micro_batches!r} (e.g. 4)")
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r} (e.g. 2)")


def _forward(stage: int, stages: int, i: int, chunk: int = 0, chunks: int = 1) -> list[Action]:
    virtual = chunk * stages + stage
    acts = [Action(Op.RECV_ACT, i, chunk)] if virtual > 0 else []
    acts.append(Action(Op.FORWARD, i, chunk))
    if virtual < stages * chunks - 1:
        acts.append(Action(Op.SEND_ACT, i, chunk))
    return acts


def _backward(stage: int, stages: int, i: int, op: Op = Op.BACKWARD, chunk: int = 0, chunks: int = 1) -> list[Action]:
    virtual = chunk * stages + stage
    acts = [Action(Op.RECV_GRAD, i, chunk)] if virtual < stages * chunks - 1 else []
    acts.append(Action(op, i, chunk))
    if virtual > 0:
        acts.append(Action(Op.SEND_GRAD, i, chunk))
    return acts


def gpipe_stage(stage: int, stages: int, micro_batches: int, chunks: int = 1) -> list[Action]:
    """Fill, then drain: every forward first, then every backward, in micro-batch order.

    With chunks: each chunk's forwards in chunk order, then each chunk's backwards in reverse.
    Any m works and the fill and drain are a whole stage long, as GPipe's; it is also the
    forward order of an interleaved pipeline's evaluation.
    """
    _check(stages, micro_batches, chunks)
    acts: list[Action] = []
    for c in range(chunks):
        for i in range(micro_batches):
            acts += _forward(stage, stages, i, c, chunks)
    for c in reversed(range(chunks)):
        for i in range(micro_batches):
            acts += _backward(stage, stages, i, Op.BACKWARD, c, chunks)
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


def one_f_one_b_batched_w_stage(stage: int, stages: int, micro_batches: int) -> list[Action]:
    """1F1B's order of forwards and input backwards, the weight backwards put off and run in batches.

    Every stage but the first runs all its weight backwards at the end of the step. The first
    stage, which no stage waits on once its forwards are out, runs the ones it has (every
    micro-batch whose input backward is done) while it would wait for its drain's gradients,
    then the rest at the end. Consecutive weight backwards are one batched pass in the engines
    (PipelineEngineBase._run).
    """
    acts = [Action(Op.BACKWARD_INPUT, a.micro_batch) if a.op is Op.BACKWARD else a
            for a in one_f_one_b_stage(stage, stages, micro_batches)]
    warmup = min(stages - 1 - stage, micro_batches)
    early = micro_batches - warmup if stage == 0 and warmup else 0
    if early:   # the drain starts by waiting for micro-batch `early`'s gradient
        drain = acts.index(Action(Op.RECV_GRAD, early))
        acts[drain:drain] = [Action(Op.BACKWARD_WEIGHT, i) for i in range(early)]
    return acts + [Action(Op.BACKWARD_WEIGHT, i) for i in range(early, micro_batches)]


def interleaved_1f1b_stage(stage: int, stages: int, micro_batches: int, chunks: int = 2) -> list[Action]:
    """1F1B over the rank's `chunks` chunks in Megatron's order: micro-batches go round in groups of p.

    The k-th forward of a rank is micro-batch (k // pv) p + k % p on chunk (k % pv) // p; its k-th
    backward the same micro-batch, chunks counted from the last. Rank r warms up with
    2 (p-1-r) + (v-1) p forwards: enough for the first backward's gradient to come back round
    the ring. With m not a multiple of p the groups do not fill: the chunks then run one after
    the other (gpipe_stage with chunks).
    """
    _check(stages, micro_batches, chunks)
    p, v, m = stages, chunks, micro_batches
    if v < 2:
        raise ValueError(f"interleaved-1f1b needs at least 2 chunks per rank, got {v} (with 1, use 1f1b)")
    if m % p:
        return gpipe_stage(stage, p, m, v)
    total = m * v

    def micro_batch(k: int) -> int:
        return (k // (p * v)) * p + k % p

    def chunk(k: int) -> int:
        return (k % (p * v)) // p

    def forward(k: int) -> list[Action]:
        return _forward(stage, p, micro_batch(k), chunk(k), v)

    def backward(k: int) -> list[Action]:
        return _backward(stage, p, micro_batch(k), Op.BACKWARD, v - 1 - chunk(k), v)

    warmup = min(total, 2 * (p - 1 - stage) + (v - 1) * p)
    acts: list[Action] = []
    for k in range(warmup):
        acts += forward(k)
    for k in range(total - warmup):
        acts += forward(warmup + k)
        acts += backward(k)
    for k in range(total - warmup, total):
        acts += backward(k)
    return acts


# Each of hvd_runtime.config.SCHEDULE_NAMES, built (tests/runtime/test_schedule.py holds the two alike).
SCHEDULES: dict[str, Callable[..., list[Action]]] = {
    "gpipe": gpipe_stage,
    "1f1b": one_f_one_b_stage,
    "zb-h1": zero_bubble_h1_stage,
    "interleaved-1f1b": interleaved_1f1b_stage,
    "1f1b-batched-w": one_f_one_b_batched_w_stage,
}
SPLIT_BACKWARD = ("zb-h1", "1f1b-batched-w")   # schedules whose engine runs input and weight gradients apart
# Why those run on PyTorch only: said by the generator and by the TensorFlow engine at start-up.
# (hvdgen.catalog offers TensorFlow projects the others only; hvd_runtime.config takes every name.)
SPLIT_BACKWARD_TORCH_ONLY = ("runs on PyTorch only: Keras layers inside a block have no hook to catch their outputs, "
                             "so TensorFlow's weight half would redo each block's backward")


def _check_name(name: str) -> None:
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}: choose one of {', '.join(SCHEDULES)} (e.g. '1f1b')")


def build_schedule(name: str, stages: int, micro_batches: int, chunks: int = 1) -> list[list[Action]]:
    """Every stage's action list for the schedule called `name` ("gpipe", "1f1b", "zb-h1",
    "interleaved-1f1b" or "1f1b-batched-w"); `chunks` per rank for interleaved-1f1b (and gpipe,
    which runs them in turn)."""
    _check_name(name)
    _check(stages, micro_batches, chunks)
    if name in INTERLEAVED or (name == "gpipe" and chunks > 1):
        return [SCHEDULES[name](s, stages, micro_batches, chunks) for s in range(stages)]
    if chunks != 1:
        raise ValueError(f"schedule {name!r} runs one chunk per rank, got {chunks}: use interleaved-1f1b")
    return [SCHEDULES[name](s, stages, micro_batches) for s in range(stages)]


def bubble_fraction(stages: int, micro_batches: int) -> float:
    """Idle share of a GPipe or 1F1B step with equal stages and free communication: (p-1)/(m+p-1)."""
    _check(stages, micro_batches)
    return (stages - 1) / (micro_batches + stages - 1)


def schedule_bubble(name: str, stages: int, micro_batches: int, chunks: int = 1) -> float:
    """Idle share of a step of schedule `name` with equal stages and free communication.

    GPipe and 1F1B: (p-1)/(m+p-1). ZB-H1, with forward, input backward and weight backward one
    unit each: from m = p on, p-1 idle units against 3m busy ones on each stage, (p-1)/(3m+p-1);
    with fewer micro-batches than stages there is not enough weight work to put off, and the
    answer is the schedule played on ideal hardware. Interleaved 1F1B with v chunks:
    (p-1)/(vm+p-1) where m is a multiple of p; otherwise its chunk-by-chunk fallback played on
    ideal hardware. 1F1B with batched weight gradients: played on ideal hardware with unit
    costs, the weight units counted as if unbatched (batching makes them cheaper in practice).
    """
    _check_name(name)
    _check(stages, micro_batches, chunks)
    if name in INTERLEAVED:
        if micro_batches % stages == 0:
            return (stages - 1) / (chunks * micro_batches + stages - 1)
        return simulated_bubble(simulate(build_schedule(name, stages, micro_batches, chunks)))
    if name not in SPLIT_BACKWARD:
        return bubble_fraction(stages, micro_batches)
    if name == "zb-h1" and micro_batches >= stages:
        return (stages - 1) / (3 * micro_batches + stages - 1)
    return simulated_bubble(simulate(build_schedule(name, stages, micro_batches), 1.0, 1.0, 1.0))


def peak_in_flight(actions: Sequence[Action]) -> int:
    """Most micro-batches whose forward ran but whose backward has not: activations held.

    With chunks, each (micro-batch, chunk) counts once: a chunk holds 1/v of a stage's activations.
    """
    live = peak = 0
    for a in actions:
        if a.op is Op.FORWARD:
            live += 1
            peak = max(peak, live)
        elif a.op in RELEASES:
            live -= 1
    return peak


def theory_peak_in_flight(name: str, stages: int, micro_batches: int, stage: int = 0, chunks: int = 1) -> int:
    """Micro-batches stage `stage` holds at most: GPipe all m; 1F1B p - stage; ZB-H1 p on every stage;
    1F1B with batched weight gradients all m (each until its weight pass: every forward comes first).

    Interleaved 1F1B: its warm-up plus one, 2 (p-1-stage) + (v-1) p + 1 micro-batch chunks, each
    1/v of a stage's activations (m a multiple of p; else GPipe's mv). The first stage (the
    default) holds the most in each schedule: that is the job's peak.
    """
    _check(stages, micro_batches, chunks)
    if name in ("gpipe", "1f1b-batched-w") or (name in INTERLEAVED and micro_batches % stages):
        return micro_batches * chunks
    if name in INTERLEAVED:
        return min(2 * (stages - 1 - stage) + (chunks - 1) * stages + 1, micro_batches * chunks)
    return min(stages - (stage if name == "1f1b" else 0), micro_batches)


@dataclass(frozen=True)
class Slot:
    """One simulated action on one stage: what ran, and when."""
    stage: int
    action: Action
    start: float
    end: float


def simulate(schedule: Sequence[Sequence[Action]], forward_time: float = 1.0,
             backward_time: float = 1.0, weight_time: float = 0.0,
             durations: Callable[[int, Action], float] | None = None, latency: float = 0.0) -> list[list[Slot]]:
    """Play a schedule on ideal hardware: compute takes fixed time, messages are free.

    Times are a whole stage's: an input backward takes `backward_time`, a weight backward
    `weight_time`, and a whole backward both; with v chunks per rank, a chunk's action 1/v of that.
    `durations(stage, action)`, where given, is each compute action's own time instead (a measured
    run's, to replay it: hvd_runtime.pipeline.timeline.replayed_bubble). `latency` delays every
    message by that much between its send and the earliest receive.

    Sends are non-blocking; a receive waits for its matching send. Messages from one rank to
    another of one kind (activations, gradients) arrive in the order sent, as on the pipeline's
    links, so a receive must take the oldest. Raises RuntimeError naming the stuck stages if the
    schedule deadlocks, a receive has no matching send or would take a message out of order, so
    a schedule that simulates is one an executor can run.
    """
    p = len(schedule)
    chunks = 1 + max((a.chunk for row in schedule for a in row), default=0)
    pos = [0] * p
    clock = [0.0] * p
    channels: dict[tuple[str, int, int], list[tuple[int, int, float]]] = {}   # (kind, from, to) -> [(chunk, mb, time)]
    out: list[list[Slot]] = [[] for _ in range(p)]
    cost = {Op.FORWARD: forward_time, Op.BACKWARD: backward_time + weight_time,
            Op.BACKWARD_INPUT: backward_time, Op.BACKWARD_WEIGHT: weight_time}
    while any(pos[s] < len(schedule[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                start = clock[s]
                virtual = a.chunk * p + s
                if a.op is Op.RECV_ACT or a.op is Op.RECV_GRAD:
                    kind, source = ("act", virtual - 1) if a.op is Op.RECV_ACT else ("grad", virtual + 1)
                    queue = channels.get((kind, source % p, s))
                    if not queue:
                        break
                    chunk, mb, sent_at = queue[0]
                    if (chunk, mb) != (a.chunk, a.micro_batch):
                        raise RuntimeError(f"stage {s} at {a} would receive {kind} of micro-batch {mb} for chunk "
                                           f"{chunk} first: its messages from stage {source % p} are out of order")
                    queue.pop(0)
                    start = max(start, sent_at + latency)
                    end = start
                elif a.op in COMPUTE:
                    end = start + (durations(s, a) if durations is not None else cost[a.op] / chunks)
                else:
                    kind, dest = ("act", virtual + 1) if a.op is Op.SEND_ACT else ("grad", virtual - 1)
                    if not 0 <= dest < p * chunks:
                        raise RuntimeError(f"stage {s} sends {a} to missing stage {dest}")
                    channels.setdefault((kind, s, dest % p), []).append((dest // p, a.micro_batch, start))
                    end = start
                out[s].append(Slot(s, a, start, end))
                clock[s] = end
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = [f"stage {s} at {schedule[s][pos[s]]}" for s in range(p) if pos[s] < len(schedule[s])]
            raise RuntimeError("schedule deadlocks: " + "; ".join(stuck))
    left = sorted((key, msg[:2]) for key, queue in channels.items() for msg in queue)
    if left:
        raise RuntimeError(f"messages sent but never received: {left}")
    return out


def simulated_bubble(slots: Sequence[Sequence[Slot]]) -> float:
    """1 - compute time / (stages x makespan) of a simulated (or measured) step."""
    start = min(sl.start for row in slots for sl in row)
    end = max(sl.end for row in slots for sl in row)
    busy = sum(sl.end - sl.start for row in slots for sl in row if sl.action.op in COMPUTE)
    return 1.0 - busy / (len(slots) * (end - start))
