"""What a pipeline stage does each step, whatever the framework: walk the schedule, talk to neighbours.

`PipelineEngineBase` runs this rank's list of schedule actions (hvd_runtime.pipeline.schedule): receive an
activation, forward a micro-batch, send it on; receive its gradient, backward, send the input's
gradient back. It records the timeline, counts micro-batches in flight, and reports the loss and
metrics once, sample-weighted over the last stage's dp replicas, to every rank.

A framework subclass supplies the tensor work: `_forward`, `_backward`, splitting a batch into
micro-batches, zeroing and applying gradients, and a sum-allreduce of a float64 vector. Its
`hvd` is horovod.torch or horovod.tensorflow; their object collectives are the same.

An engine is a step of hvd_runtime.loop (`train_batch`, `evaluate`, `sum_over_ranks`): a
pipeline trains in the same epoch loop as every other strategy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hvd_runtime.nonfinite import Guard
from hvd_runtime.pipeline.grid import PipelineConfigError, PipelineRank, micro_batch_sizes
from hvd_runtime.config import INTERLEAVED, interleaved_misfit
from hvd_runtime.pipeline.schedule import Op, build_schedule, schedule_bubble
from hvd_runtime.pipeline.timeline import (TimelineRecorder, explain_bubble, load_timeline, measured_bubble, plot_timeline,
                                           replayed_bubble, save_timeline)


class PipelineEngineBase:
    """Runs one stage's part of the schedule each step; subclasses do the tensor work."""

    batches_per_update = 1   # a step's micro-batches are accumulated inside the engine

    def __init__(self, hvd, place: PipelineRank, schedule: str, micro_batches: int, metrics_fn=None,
                 timeline: bool = False, timeline_steps: int = 20, guard: Guard | None = None):
        """`guard` (hvd_runtime.nonfinite): each update checked by the whole model's gradient norm."""
        self.hvd, self.place, self.metrics_fn = hvd, place, metrics_fn
        self.guard = guard
        self.checks = guard is not None and guard.checks
        self.step_number = 0   # the loop's step being trained, which a skipped update is named by
        self.schedule, self.micro_batches, self.chunks = schedule, micro_batches, place.chunks
        if (schedule in INTERLEAVED) != (place.chunks > 1):
            raise PipelineConfigError(f"schedule {schedule} with {place.chunks} chunks per rank: interleaved-1f1b needs "
                                      "init_pipeline(..., chunks=2 or more), every other schedule chunks=1")
        misfit = interleaved_misfit(schedule, place.stages, micro_batches)
        if misfit:
            raise PipelineConfigError(misfit)
        self._schedules: dict[int, tuple[list, list]] = {}
        self._actions_for(micro_batches)   # built up front: a schedule that cannot be made fails at start-up
        # the last timeline_steps training steps: bounded memory, and past the run's start-up
        self.recorder = TimelineRecorder(place.rank, place.stage, place.replica, enabled=timeline, keep_steps=timeline_steps)
        self.steps = 0
        self.peak_in_flight = 0     # most micro-batches holding activations at once, last step
        self._act_shapes: dict[tuple, tuple] = {}  # (chunk, micro-batch size) -> (shape, dtype) seen on the way in
        self._act_sent: set[tuple] = set()          # (chunk, micro-batch size) whose shape the next stage knows
        self._metric_names: list[str] | None = None
        self._names_synced = False
        # this stage's regularisation terms in the step's loss (a framework scalar; 0.0 where none):
        # Keras adds its layers' terms to the loss, and a stage's layers are on this rank only
        self.penalty = 0.0

    def _actions_for(self, m: int) -> tuple[list, list]:
        """This stage's training and forward-only actions for a batch of m micro-batches.

        m is below `micro_batches` only for a batch with fewer samples than that (an epoch's or a
        validation shard's last one): every stage of a replica sees the same batch, so all agree.
        """
        if m not in self._schedules:
            train = build_schedule(self.schedule, self.place.stages, m, self.chunks)[self.place.stage]
            forward = [a for a in build_schedule("gpipe", self.place.stages, m, self.chunks)[self.place.stage]
                       if a.op in (Op.RECV_ACT, Op.FORWARD, Op.SEND_ACT)]
            self._schedules[m] = (train, forward)
        return self._schedules[m]

    def _is_first(self, chunk: int) -> bool:
        """Does this chunk begin the model (it reads the inputs, receives nothing)?"""
        return self.place.is_first and chunk == 0

    def _is_last(self, chunk: int) -> bool:
        """Does this chunk end the model (it computes the loss, sends nothing on)?"""
        return self.place.is_last and chunk == self.chunks - 1

    def _tag(self, kind: str, i: int, virtual_stage: int) -> str:
        """A message's name: micro-batch i's activation or gradient, going to `virtual_stage`
        (named only with chunks, where one link carries several chunks' messages)."""
        return f"{kind}{i}" if self.chunks == 1 else f"{kind}{i}>{virtual_stage}"

    # -- framework hooks ----------------------------------------------------------------------------
    def _forward(self, c: int, i: int, inp, y, weight: float, train: bool):
        """Run chunk c (the stage, without chunks: c = 0) on micro-batch i; at the model's end also
        the loss. Returns (output, mean loss or None: a framework scalar, not read on the host).

        When training, keep what `_backward(c, i, ...)` needs; the last chunk backpropagates
        `weight x loss` so the micro-batches add up to the whole batch's mean.
        """
        raise NotImplementedError

    def _backward(self, c: int, i: int, grad):
        """Backpropagate micro-batch i through chunk c (grad None at the model's end); return its input's gradient."""
        raise NotImplementedError

    def _backward_input(self, c: int, i: int, grad):
        """Zero-bubble schedules: only micro-batch i's input gradient (returned); keep what
        `_backward_weight(c, i)` needs to add its weights' gradients later."""
        raise NotImplementedError

    def _backward_weight(self, c: int, i: int) -> None:
        """Zero-bubble schedules: add micro-batch i's weight gradients, then free what it kept."""
        raise NotImplementedError

    def _backward_weights(self, c: int, micro_batches: list[int]) -> None:
        """Weight gradients of several micro-batches of chunk c, due one after another: a framework
        may compute them together (a layer's product over all their samples at once)."""
        for i in micro_batches:
            self._backward_weight(c, i)

    def _micro_batches(self, t, sizes: list[int]) -> list:
        raise NotImplementedError

    def _begin_step(self) -> None:
        """Zero gradients before the first backward of a step."""

    def _finish_step(self) -> None:
        """Average this stage's gradients over its dp replicas and apply them."""
        raise NotImplementedError

    def sum_over_ranks(self, values: np.ndarray, name: str) -> np.ndarray:
        """A float64 vector summed over every rank of the job."""
        raise NotImplementedError

    def _before_step(self, step: int) -> None:
        """Set what depends on the job's batch count (a learning rate the optimizer does not keep)."""

    def _set_training(self, train: bool) -> None:
        """Switch train/eval modes where the framework keeps them on the model."""

    @staticmethod
    def _count(t) -> int:
        return int(t.shape[0])

    # -- messages -------------------------------------------------------------------------------
    def _recv_act(self, c: int, i: int, size: int):
        known = self._act_shapes.get((c, size))
        t = self.place.prev.recv(self._tag("act", i, c * self.place.stages + self.place.stage), *(known or (None, None)))
        self._act_shapes[(c, size)] = (tuple(t.shape), t.dtype)
        return t

    def _send_act(self, c: int, i: int, size: int, out) -> None:
        to = c * self.place.stages + self.place.stage + 1
        self.place.next.send(out, self._tag("act", i, to), shape_known=(c, size) in self._act_sent)
        self._act_sent.add((c, size))

    def _wait_sends(self) -> None:
        for link in (self.place.prev, self.place.next):
            if link is not None:
                link.wait_sends()

    # -- one pass over the schedule ---------------------------------------------------------------
    def _run(self, actions, xs, ys, sizes, total: int, train: bool) -> list | None:
        """Walk this stage's actions; return [loss sum, samples, metric sums...] (None off the last stage).

        Everything in flight is keyed by (chunk, micro-batch): without chunks, the chunk is 0. The
        sums stay the framework's values where they are: no host sync per micro-batch.
        """
        place, rec, p = self.place, self.recorder, self.place.stages
        inputs: dict[tuple, object] = {}
        outputs: dict[tuple, object] = {}
        grads: dict[tuple, object] = {}
        in_flight: set[tuple] = set()
        due: list[int] = []   # weight backwards of the current run (consecutive actions of one chunk)
        sums, peak = None, 0
        for k, a in enumerate(actions):
            i, c, op = a.micro_batch, a.chunk, a.op
            key, virtual = (c, i), c * p + place.stage
            if op is Op.RECV_ACT:
                with rec.span("recv", i, c):
                    inputs[key] = self._recv_act(c, i, sizes[i])
            elif op is Op.FORWARD:
                with rec.span("forward", i, c):
                    first, last = self._is_first(c), self._is_last(c)
                    inp = xs[i] if first else inputs.pop(key)
                    y = ys[i] if last else None
                    out, loss = self._forward(c, i, inp, y, sizes[i] / total, train)
                    if last:
                        stats = self._stats(loss, out, y, sizes[i])
                        sums = stats if sums is None else self._add_stats(sums, stats)
                    else:
                        outputs[key] = out
                    if train or not last:
                        in_flight.add(key)
                    peak = max(peak, len(in_flight))
            elif op is Op.SEND_ACT:
                with rec.span("send", i, c):
                    self._send_act(c, i, sizes[i], outputs[key] if train else outputs.pop(key))
                    if not train:
                        in_flight.discard(key)
            elif op is Op.RECV_GRAD:
                with rec.span("recv", i, c):
                    out = outputs.pop(key)
                    grads[key] = place.next.recv(self._tag("grad", i, virtual), tuple(out.shape), out.dtype)
            elif op is Op.BACKWARD:
                with rec.span("backward", i, c):
                    grads[key] = self._backward(c, i, grads.pop(key, None))
                    in_flight.discard(key)
            elif op is Op.BACKWARD_INPUT:
                with rec.span("backward_input", i, c):
                    grads[key] = self._backward_input(c, i, grads.pop(key, None))
            elif op is Op.BACKWARD_WEIGHT:
                due.append(i)
                following = actions[k + 1] if k + 1 < len(actions) else None
                if following is None or following.op is not Op.BACKWARD_WEIGHT or following.chunk != c:
                    # a run of weight backwards goes as one pass (1f1b-batched-w's end of step, ZB-H1's last)
                    with rec.spans("backward_weight", due, c):
                        self._backward_weights(c, due)
                    in_flight.difference_update((c, j) for j in due)
                    due = []
            elif op is Op.SEND_GRAD:
                with rec.span("send", i, c):
                    place.prev.send(grads.pop(key), self._tag("grad", i, virtual - 1), shape_known=True)
        self._wait_sends()
        if train:
            self.peak_in_flight = peak
        return sums

    def _stats(self, loss, out, y, n: int) -> list:
        """[loss x n, n, metric x n...] for one micro-batch: floats or the framework's scalars."""
        values = [loss * n, float(n)]
        if self.metrics_fn is not None:
            metrics = self._metrics(out, y)
            if self._metric_names is None:
                self._metric_names = sorted(metrics)
            values += [metrics[k] * n for k in self._metric_names]
        return values

    @staticmethod
    def _add_stats(sums, more):
        """Two micro-batches' (or batches') sums added, as _stats gives them: a list, element by element."""
        return [a + b for a, b in zip(sums, more)]

    def _metrics(self, out, y) -> dict[str, float]:
        return self.metrics_fn(out, y)

    def _split(self, x, y, batch_size):
        n = batch_size or (self._count(x) if x is not None else self._count(y) if y is not None else None)
        if n is None:
            raise PipelineConfigError("train_step/evaluate need x, y or batch_size= on every stage")
        if self.place.is_first and x is None:
            raise PipelineConfigError(f"stage 0 (rank {self.place.rank}) needs the inputs x")
        if self.place.is_last and y is None:
            raise PipelineConfigError(f"the last stage (rank {self.place.rank}) needs the targets y")
        sizes = micro_batch_sizes(n, min(self.micro_batches, n))  # a short last batch: fewer micro-batches
        xs = self._micro_batches(x, sizes) if x is not None else None
        ys = self._micro_batches(y, sizes) if y is not None else None
        return xs, ys, sizes, n

    def _sync_metric_names(self) -> None:
        """Only the last stage has seen the metrics; every rank needs their names, once (a collective)."""
        if not self._names_synced:
            names = self._metric_names if self.place.is_last else None
            self._metric_names = self.hvd.broadcast_object(names or [], root_rank=self.place.last_stage_root,
                                                           name="pp.metric_names")
            self._names_synced = True

    def _report(self, sums: list | None, name: str, batch: int = 0) -> tuple[float, dict[str, float]]:
        """Sample-weighted means over the last stage's replicas, delivered to every rank.

        Each stage adds its penalty once per sample of its `batch` (training), so the loss is the
        whole model's: the last stage's data loss plus every stage's regularisation terms.
        """
        self._sync_metric_names()
        width = 2 + len(self._metric_names)
        values = np.array([float(v) for v in sums] if sums is not None else np.zeros(width), dtype=np.float64)
        values[0] += float(self.penalty) * batch
        total = self.sum_over_ranks(values, name)
        n = total[1]
        return float(total[0] / n), {k: float(total[2 + j] / n) for j, k in enumerate(self._metric_names)}

    # -- public -------------------------------------------------------------------------------------
    def _train(self, x, y, batch_size: int | None = None) -> tuple[list | None, int]:
        """One optimizer step over the batch; this stage's sums as `_run` returns them, and the batch size."""
        xs, ys, sizes, n = self._split(x, y, batch_size)
        self._set_training(True)
        self.penalty = 0.0
        self._begin_step()
        self.recorder.begin_step(self.steps)
        sums = self._run(self._actions_for(len(sizes))[0], xs, ys, sizes, n, train=True)
        self._finish_step()
        self.steps += 1
        return sums, n

    def train_step(self, x=None, y=None, batch_size: int | None = None) -> tuple[float, dict[str, float]]:
        """One optimizer step over the batch; returns (loss, metrics) averaged over dp, on every rank."""
        sums, n = self._train(x, y, batch_size)
        return self._report(sums, "pp.train_report", batch=n)

    @property
    def reports_loss(self) -> bool:
        """hvd_runtime.loop: only the last stage's batches count; the others add just their penalty."""
        return self.place.is_last

    def train_batch(self, x, y, apply: bool, step: int) -> tuple[object, dict[str, object]]:
        """hvd_runtime.loop's call: one step; this stage's mean loss and metric sums, as they are.

        No collective: the loop sums them over the job at its log points and the epoch's end, so a
        step costs no Horovod cycle beyond its gradients' (and their norm's, to clip or check). The loss is this stage's part of the
        model's: its penalty, plus the data loss on the last stage; the other stages' metrics are zeros.
        """
        self.step_number = step + 1
        self._before_step(step)
        sums, _ = self._train(x, y)
        self._sync_metric_names()
        if sums is None:
            return self.penalty, {key: 0.0 for key in self._metric_names}
        n = sums[1]
        return sums[0] / n + self.penalty, {key: sums[2 + j] for j, key in enumerate(self._metric_names)}

    def evaluate(self, batches) -> tuple[float, dict[str, float]]:
        """Forward-only passes over (x, y) batches; sample-weighted (loss, metrics) over dp, on every rank."""
        self._set_training(False)
        sums, recording = None, self.recorder.enabled
        self.recorder.enabled = False     # the timeline shows training steps only
        try:
            for x, y in batches:
                xs, ys, sizes, n = self._split(x, y, None)
                s = self._run(self._actions_for(len(sizes))[1], xs, ys, sizes, n, train=False)
                if s is not None:   # the last stage
                    sums = s if sums is None else self._add_stats(sums, s)
        finally:
            self.recorder.enabled = recording
        return self._report(sums, "pp.eval_report")

    def save_timeline(self, run_dir) -> None:
        """Gather every rank's timeline to rank 0, which writes run_dir/timeline.json. Call on every rank."""
        records = self.hvd.allgather_object(self.recorder.record(), name="pp.timeline")
        if self.hvd.rank() == 0:
            meta = {"schedule": self.schedule, "stages": self.place.stages, "replicas": self.place.replicas,
                    "micro_batches": self.micro_batches, "chunks": self.chunks}
            save_timeline(run_dir, records, meta)

    def close_timeline(self, run_dir) -> dict | None:
        """Every rank calls: gather the timelines; rank 0 draws them and returns the bubble against theory,
        and replayed: this run's compute times on the schedule with free messages (timeline.replayed_bubble),
        and a line on what makes up the gap to theory and what would shrink it (timeline.explain_bubble).

        None on other ranks, and when this run trained no step (a restart after the last epoch).
        """
        self.save_timeline(run_dir)
        if self.hvd.rank() != 0:
            return None
        timeline = load_timeline(run_dir)
        if not timeline.steps:
            return None
        stages, m = self.place.stages, self.micro_batches
        measured, replayed = measured_bubble(timeline), replayed_bubble(timeline)
        theory = schedule_bubble(self.schedule, stages, m, self.chunks)
        return {"picture": plot_timeline(timeline, Path(run_dir) / "timeline.png"),
                "bubble_measured": measured, "bubble_replayed": replayed, "bubble_theory": theory,
                "explanation": explain_bubble(timeline, measured, replayed, theory)}
