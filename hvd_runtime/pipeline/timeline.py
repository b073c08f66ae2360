"""Pipeline timelines: what each stage did per micro-batch, and when, turned into a picture.

Each rank records forward, backward (or its input and weight halves), send and recv spans with a
`TimelineRecorder`; the executor gathers every rank's records to rank 0, which writes one
`timeline.json` into the run dir (rank 0 is the only writer, as everywhere else). Idle gaps are derived when saving. Then:

    tl = load_timeline(run_dir)
    measured_bubble(tl)            # idle share of the schedule, to set beside schedule_bubble(name, p, m)
    replayed_bubble(tl)            # the same schedule with this run's compute times and free messages
    plot_timeline(tl, "timeline.png")

Times are wall-clock seconds (`time.time()`), comparable across the ranks of one host and, with
synchronised clocks, roughly across hosts. Framework-free; matplotlib is imported only to draw.
"""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hvd_runtime.pipeline.schedule import COMPUTE as COMPUTE_OPS
from hvd_runtime.pipeline.schedule import build_schedule, simulate

FILE = "timeline.json"
KINDS = ("forward", "backward", "backward_input", "backward_weight", "send", "recv", "idle")
COMPUTE = ("forward", "backward", "backward_input", "backward_weight")
RELEASES = ("backward", "backward_weight")   # after these a micro-batch's activations are free
COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "backward_input": "#DD8452", "backward_weight": "#55A868",
           "send": "#8C8C8C", "recv": "#C7C7C7", "idle": "#FFFFFF"}


@dataclass
class TimelineRecorder:
    """Spans of one rank, tagged with the step they belong to. Disabled, it records nothing.

    `keep_steps` (0: all) bounds memory by keeping only the last that many steps begun with
    `begin_step`. The last, not the first: a run's first steps share the cores with its start-up
    (rank 0 imports MLflow and opens its store on a background thread while training starts),
    which slows their compute and inflates their bubble (docs/pipeline.md).
    """

    rank: int
    stage: int
    replica: int = 0
    enabled: bool = True
    step: int = 0
    events: list = field(default_factory=list)
    keep_steps: int = 0

    def begin_step(self, step: int) -> None:
        """Tag what follows with `step`; forget the steps that fall out of the last `keep_steps`."""
        self.step = step
        if self.keep_steps and self.events and self.events[0]["step"] <= step - self.keep_steps:
            self.events = [e for e in self.events if e["step"] > step - self.keep_steps]

    def add(self, kind: str, micro_batch: int, start: float, end: float, chunk: int = 0) -> None:
        if self.enabled:
            event = {"step": self.step, "kind": kind, "mb": micro_batch, "start": start, "end": end}
            if chunk:   # interleaved schedules: the rank's chunk, drawn beside the micro-batch
                event["chunk"] = chunk
            self.events.append(event)

    def span(self, kind: str, micro_batch: int, chunk: int = 0):
        """One action on one micro-batch, timed."""
        return self.spans(kind, [micro_batch], chunk)

    @contextmanager
    def spans(self, kind: str, micro_batches: list[int], chunk: int = 0):
        """One pass over several micro-batches (a batched weight backward), recorded as a span
        each: the pass's time split evenly between them, in order. The sum is what was measured;
        how one pass divides between its micro-batches is not, and the picture shows equal boxes."""
        start = time.time()
        try:
            yield
        finally:
            end = time.time()
            share = (end - start) / max(len(micro_batches), 1)
            for j, i in enumerate(micro_batches):
                last = j == len(micro_batches) - 1
                self.add(kind, i, start + j * share, end if last else start + (j + 1) * share, chunk)

    def record(self) -> dict:
        return {"rank": self.rank, "stage": self.stage, "replica": self.replica, "events": list(self.events)}


@dataclass
class Timeline:
    """Every rank's events plus what the run was: stages, replicas, micro_batches, schedule."""

    meta: dict
    ranks: list[dict]

    @property
    def steps(self) -> list[int]:
        return sorted({e["step"] for r in self.ranks for e in r["events"]})

    def step_events(self, step: int) -> list[tuple[dict, list[dict]]]:
        return [(r, [e for e in r["events"] if e["step"] == step]) for r in self.ranks]


def with_idle(ranks: list[dict]) -> list[dict]:
    """Add `idle` events for the gaps on each rank within each step's span (across all ranks).

    A gap is charged to the micro-batch of the event that ends it: what the stage was waiting for.
    """
    out = []
    steps = sorted({e["step"] for r in ranks for e in r["events"] if e["kind"] != "idle"})
    spans = {}
    for s in steps:
        evs = [e for r in ranks for e in r["events"] if e["step"] == s and e["kind"] != "idle"]
        spans[s] = (min(e["start"] for e in evs), max(e["end"] for e in evs))
    for r in ranks:
        events = []
        for s in steps:
            own = sorted((e for e in r["events"] if e["step"] == s and e["kind"] != "idle"), key=lambda e: e["start"])
            t = spans[s][0]
            for e in own:
                if e["start"] > t:
                    events.append({"step": s, "kind": "idle", "mb": e["mb"], "start": t, "end": e["start"]})
                events.append(e)
                t = max(t, e["end"])
            if spans[s][1] > t:
                events.append({"step": s, "kind": "idle", "mb": -1, "start": t, "end": spans[s][1]})
        out.append({**r, "events": events})
    return out


def save_timeline(run_dir: str | Path, ranks: list[dict], meta: dict) -> Path:
    """Write every rank's records as one JSON file (call on one rank only)."""
    path = Path(run_dir) / FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    ranks = sorted(ranks, key=lambda r: r["rank"])
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"version": 1, "meta": meta, "ranks": with_idle(ranks)}))
    tmp.replace(path)
    return path


def load_timeline(run_dir: str | Path) -> Timeline:
    """Read `timeline.json` from a run dir (or a path to the file itself)."""
    path = Path(run_dir)
    if path.is_dir():
        path = path / FILE
    if not path.exists():
        raise FileNotFoundError(f"no timeline at {path}: train with timeline recording on "
                                f"(PipelineEngine(..., timeline=True)) and save_timeline(run_dir)")
    data = json.loads(path.read_text())
    if data.get("version") != 1 or "ranks" not in data:
        raise ValueError(f"{path} is not a timeline file (version 1 with 'ranks')")
    return Timeline(meta=data.get("meta", {}), ranks=data["ranks"])


def step_bubble(tl: Timeline, step: int) -> float:
    """1 - compute time / (ranks x span of the step): the share of stage-time spent not computing."""
    spans = [(e["start"], e["end"]) for _, evs in tl.step_events(step) for e in evs if e["kind"] != "idle"]
    if not spans:
        raise ValueError(f"no events in step {step}: steps are {tl.steps}")
    span = max(b for _, b in spans) - min(a for a, _ in spans)
    busy = sum(e["end"] - e["start"] for _, evs in tl.step_events(step) for e in evs if e["kind"] in COMPUTE)
    return 1.0 - busy / (len(tl.ranks) * span) if span > 0 else 0.0


def measured_steps(tl: Timeline, skip_first: bool = True) -> list[int]:
    """The recorded steps the bubbles average over; the first is skipped (warm-up) when there are others."""
    return tl.steps[1:] if skip_first and len(tl.steps) > 1 else tl.steps


def _mean_over_steps(tl: Timeline, per_step, skip_first: bool) -> float:
    """Mean of `per_step(tl, step)` over measured_steps."""
    steps = measured_steps(tl, skip_first)
    return sum(per_step(tl, s) for s in steps) / len(steps)


def measured_bubble(tl: Timeline, skip_first: bool = True) -> float:
    """Mean bubble over the recorded steps; the first is skipped (warm-up) when there are others."""
    return _mean_over_steps(tl, step_bubble, skip_first)


def step_replayed_bubble(tl: Timeline, step: int) -> float:
    """The bubble of `step` replayed: its schedule played with the step's own compute times and free messages.

    Each compute action takes what it took in the step, each starts as soon as its stage is free
    and its input has been sent (schedule.simulate), so the replay's span is the least these
    compute times allow in this order and the measured span can only be longer. What separates
    the two is the price of the messages (sends, the link's delivery, the wait for a late rank)
    and of the work between actions. What separates the replay from `schedule_bubble` is the
    compute itself: stages of unequal cost (the cut), the last stage's loss, micro-batches of
    unequal size. Replicas replay apart, over the step's longest replay, as step_bubble counts them.
    """
    meta = tl.meta
    stages, chunks = int(meta.get("stages", 1)), int(meta.get("chunks", 1))
    replicas: dict[int, dict[int, list[dict]]] = {}
    for rank, events in tl.step_events(step):
        replicas.setdefault(rank.get("replica", 0), {})[rank["stage"]] = events
    busy, spans = 0.0, []
    for by_stage in replicas.values():
        took: dict[tuple, float] = {}
        for stage, events in by_stage.items():
            for e in events:
                if e["kind"] in COMPUTE:
                    key = (stage, e["kind"], e["mb"], e.get("chunk", 0))
                    took[key] = took.get(key, 0.0) + e["end"] - e["start"]
        # an epoch's last batch may have fewer micro-batches than configured: count what ran
        m = len({mb for (_, kind, mb, _) in took if kind == "forward"})
        if not m:
            continue
        slots = simulate(build_schedule(meta.get("schedule", "1f1b"), stages, m, chunks),
                         durations=lambda s, a: took.get((s, a.op.value, a.micro_batch, a.chunk), 0.0))
        busy += sum(sl.end - sl.start for row in slots for sl in row if sl.action.op in COMPUTE_OPS)
        spans.append(max((sl.end for row in slots for sl in row), default=0.0))
    span = max(spans, default=0.0)
    return 1.0 - busy / (len(tl.ranks) * span) if span > 0 else 0.0


def replayed_bubble(tl: Timeline, skip_first: bool = True) -> float:
    """Mean replayed bubble over the recorded steps (step_replayed_bubble), skipping the first as measured_bubble does."""
    return _mean_over_steps(tl, step_replayed_bubble, skip_first)


def stage_compute_ms(tl: Timeline, steps: list[int] | None = None) -> dict[int, float]:
    """Per stage: the milliseconds of compute one micro-batch costs it (forward and backward, every
    chunk), averaged over replicas and `steps` (default: measured_steps, as the bubbles take them)."""
    if steps is None:
        steps = measured_steps(tl)
    busy: dict[int, float] = {}
    micro_batches: dict[int, int] = {}
    for step in steps:
        for rank, events in tl.step_events(step):
            stage = rank["stage"]
            busy[stage] = busy.get(stage, 0.0) + sum(e["end"] - e["start"] for e in events if e["kind"] in COMPUTE)
            micro_batches[stage] = micro_batches.get(stage, 0) + len({e["mb"] for e in events if e["kind"] == "forward"})
    return {stage: 1e3 * busy[stage] / micro_batches[stage] for stage in sorted(busy) if micro_batches[stage]}


# Below this, a part of the gap to theory is not worth naming (bubbles are shares of the step).
NEGLIGIBLE_BUBBLE = 0.01
# A stage this much slower per micro-batch than the fastest is what a different cut would fix.
UNEVEN_STAGES = 1.05


def explain_bubble(tl: Timeline, measured: float, replayed: float, theory: float,
                   steps: list[int] | None = None) -> str:
    """One line: how far the measured bubble lies above theory, what makes up the gap, what shrinks it.

    Why: the three numbers alone leave the user to work out which knob to turn. The replay splits
    the gap (step_replayed_bubble): between theory and the replay lies uneven compute, unequal
    stages (which a different cut evens) or single actions of unequal length; between the replay
    and the measurement lie the messages and the work between actions, fixed costs per
    micro-batch that more rows per micro-batch outweigh. The larger part names the knob, and each
    stage's compute per micro-batch says how small the micro-batches are. `steps`: the steps the
    bubbles were taken over, when not measured_bubble's (stage_compute_ms).
    """
    gap = measured - theory
    if gap <= max(0.1 * theory, NEGLIGIBLE_BUBBLE):
        return f"the bubble is within 10% of theory ({theory:.2f}): the schedule runs as designed"
    per_stage = stage_compute_ms(tl, steps)
    slowest = max(per_stage, key=per_stage.get) if per_stage else None
    computes = ", ".join(f"stage {stage} {ms:.3g} ms" for stage, ms in per_stage.items())
    stages_part, messages_part = replayed - theory, measured - replayed
    parts = []
    if stages_part > NEGLIGIBLE_BUBBLE:
        parts.append(f"{stages_part:.2f} uneven compute")
    if messages_part > NEGLIGIBLE_BUBBLE:
        parts.append(f"{messages_part:.2f} messages and the work between actions")
    if stages_part >= messages_part and slowest is not None and per_stage[slowest] > UNEVEN_STAGES * min(per_stage.values()):
        advice = (f"stage {slowest} sets the pace: move blocks off it (parallel.partition) or give the model "
                  "more, smaller blocks to cut between")
    elif stages_part >= messages_part:
        advice = ("the stages compute alike on the whole, so the unevenness is in single actions (replicas or "
                  "micro-batches at different speeds, a weight half longer than an input half): the timeline "
                  "picture shows which")
    else:
        advice = ("each hand-off costs about as much whatever the micro-batch's size: more rows per micro-batch "
                  "(a larger train.batch_size, or fewer parallel.micro_batches) outweigh it")
    return (f"{gap:.2f} above theory: {' and '.join(parts) or 'parts below 0.01 each'} (a micro-batch computes "
            f"{computes}); {advice}")


def peak_in_flight(tl: Timeline, step: int) -> dict[int, int]:
    """Per rank: most micro-batches whose forward had run and (weight) backward had not: activations held."""
    peaks = {}
    for rank, events in tl.step_events(step):
        live = peak = 0
        for e in sorted(events, key=lambda e: e["start"]):
            if e["kind"] == "forward":
                live += 1
                peak = max(peak, live)
            elif e["kind"] in RELEASES:
                live -= 1
        peaks[rank["rank"]] = peak
    return peaks


def plot_timeline(tl: Timeline, path: str | Path, step: int | None = None) -> Path:
    """Draw one step as the familiar pipeline picture: a row per stage, a box per micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    step = tl.steps[-1] if step is None else step
    rows = sorted(tl.step_events(step), key=lambda re: (re[0]["replica"], re[0]["stage"]))
    t0 = min(e["start"] for _, evs in rows for e in evs)
    t1 = max(e["end"] for _, evs in rows for e in evs)
    scale = 1e3   # milliseconds
    fig, ax = plt.subplots(figsize=(10, 0.7 * len(rows) + 1.4))
    for y, (rank, evs) in enumerate(rows):
        for e in evs:
            if e["kind"] == "idle":
                continue
            x, w = (e["start"] - t0) * scale, (e["end"] - e["start"]) * scale
            height = 0.8 if e["kind"] in COMPUTE else 0.3
            ax.barh(y, w, left=x, height=height, color=COLOURS[e["kind"]], edgecolor="black", linewidth=0.4)
            if e["kind"] in COMPUTE and w > (t1 - t0) * scale / 80:
                label = f"{e['mb']}@{e['chunk']}" if e.get("chunk") else str(e["mb"])   # micro-batch@chunk
                ax.text(x + w / 2, y, label, ha="center", va="center", fontsize=8, color="white")
    labels = [f"stage {r['stage']}" + (f" / replica {r['replica']}" if tl.meta.get("replicas", 1) > 1 else "")
              for r, _ in rows]
    ax.set_yticks(range(len(rows)), labels)
    ax.invert_yaxis()
    ax.set_xlabel("ms since step start")
    m = tl.meta
    ax.set_title(f"{m.get('schedule', '?')}: {m.get('stages', '?')} stages, {m.get('micro_batches', '?')} "
                 f"micro-batches, step {step}, bubble {step_bubble(tl, step):.2f}")
    drawn = {e["kind"] for _, evs in rows for e in evs}
    shown = [k for k in KINDS if k in drawn and k != "idle"]
    ax.legend(handles=[Patch(facecolor=COLOURS[k], edgecolor="black", label=k.replace("_", " ")) for k in shown],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=len(shown), frameon=False)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
