"""Pipeline benchmark: measured bubble vs the schedule's theory, activations in flight, speed-up over one process.

    python bench/pipeline_bench.py            # writes docs/benchmarks-pipeline.md and docs/pipeline-timeline.png

The driver launches `horovodrun -np 2 --gloo` running this file with --worker: a 2-stage pipeline
of the model, one thread per rank, for GPipe, 1F1B, zero-bubble ZB-H1, interleaved 1F1B (2 chunks a
rank) at m = 1, 2, 4, 8 (the schedules one after the other at each m, so they see the same load; interleaved
at even m only, its groups of p); before each pipeline step,
rank 0 times one step of the unsplit model alone (one thread) as the baseline. Then 1F1B, ZB-H1 and
interleaved 1F1B once more at m = 8 on a batch 16 times larger, so that each micro-batch is tall
enough for a matrix product to run at full speed on one thread (the report gives that speed by rows).
Synthetic data; the model is a stack of
equal Linear+ReLU blocks, so the two stages are balanced. Numbers are wall-clock on a shared
machine: read them as shapes, not as constants.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import machine_speed

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

INPUTS, WIDTH, BLOCKS, BATCH, CLASSES = 64, 1024, 8, 256, 10
MICRO_BATCHES = [1, 2, 4, 8]
SCHEDULES = ["gpipe", "1f1b", "zb-h1", "interleaved-1f1b", "1f1b-batched-w"]
CHUNKS = 2   # interleaved-1f1b: the model's chunks per rank
# The same model with micro-batches tall enough to run a one-thread matrix product at the speed the
# whole batch gets (ROWS_PROBED below shows where that starts on this machine): at batch 256 and
# m = 8 each micro-batch has 32 rows, and on matrix units that need tall matrices the pipeline then
# loses to one process through its micro-batches, whatever the schedule.
FULL_BATCH, FULL_MICRO_BATCHES = 4096, 8
FULL_SCHEDULES = ["1f1b", "zb-h1", "interleaved-1f1b"]
ROWS_PROBED = [32, 64, 128, 256, 512, 1024]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    layers = [nn.Linear(INPUTS, WIDTH), nn.ReLU()]   # the stem
    for _ in range(BLOCKS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers[:-1], nn.Linear(WIDTH, CLASSES))


def batch(step: int, size: int = BATCH):
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, INPUTS, generator=g), torch.randint(0, CLASSES, (size,), generator=g)


def runs(steps: int, full_steps: int) -> list[tuple[str, int, int, int]]:
    """(schedule, micro-batches, batch, timed steps) in the order they run: the schedules one
    after the other at each m, so they see the same load; interleaved at even m only (its groups
    of p); then the tall micro-batches."""
    small = [(schedule, m, BATCH, steps) for m in MICRO_BATCHES for schedule in SCHEDULES
             if not (schedule == "interleaved-1f1b" and m % 2)]
    return small + [(schedule, FULL_MICRO_BATCHES, FULL_BATCH, full_steps) for schedule in FULL_SCHEDULES
                    if full_steps > 0]


def matmul_speed(rows: int) -> float:
    """GFLOP/s of one block's forward and backward (Linear(WIDTH, WIDTH), one thread) on `rows` rows:
    fastest of a few, as machine_speed takes its figures."""
    torch.set_num_threads(1)
    block = nn.Linear(WIDTH, WIDTH)
    x = torch.randn(rows, WIDTH, requires_grad=True)
    return 6 * rows * WIDTH * WIDTH / machine_speed.best_seconds(lambda: block(x).sum().backward(), 8) / 1e9


class Baseline:
    """The unsplit model in one process, one thread: one training step at a time."""

    def __init__(self):
        self.model = make_model()
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01)

    def step(self, x, y) -> float:
        start = time.perf_counter()
        self.opt.zero_grad()
        F.cross_entropy(self.model(x), y).backward()
        self.opt.step()
        return time.perf_counter() - start


def worker(steps: int, full_steps: int, out: Path, p2p: str) -> None:
    import horovod.torch as hvd

    from hvd_runtime.pipeline.timeline import COMPUTE, load_timeline, step_bubble, step_replayed_bubble
    from hvd_runtime.torch.pipeline import PipelineEngine, build_stage, init_pipeline
    from p2p_links import links

    # a ring, for the interleaved schedule
    _, ring = init_pipeline(stages=2, threads_per_rank=1, chunks=CHUNKS, links=links(p2p))
    line = dataclasses.replace(ring, chunks=1)   # the other schedules: one chunk a rank, the same links
    base = Baseline() if hvd.rank() == 0 else None
    rows = []
    for schedule, m, size, timed in runs(steps, full_steps):
        dims = ring if schedule == "interleaved-1f1b" else line
        stage = build_stage(make_model(), dims)
        engine = PipelineEngine(stage, dims, loss_fn=F.cross_entropy, schedule=schedule, micro_batches=m,
                                optimizer=torch.optim.SGD(stage.parameters(), lr=0.01), timeline=True,
                                timeline_steps=timed + 2)   # every step: the two warm-up steps are dropped below
        times, base_times, peaks = [], [], []
        for step in range(timed + 2):
            x, y = batch(step, size)
            # baseline and pipeline steps alternate, so both see the same load on a shared machine;
            # rank 0 runs the baseline alone while the other ranks wait
            if base is not None:
                base_times.append(base.step(x, y))
            hvd.barrier()
            start = time.perf_counter()
            engine.train_batch(x, y, True, step)   # as the epoch loop calls it: no collective in the step
            times.append(time.perf_counter() - start)
            peaks.append(engine.peak_in_flight)
        run = Path(out).parent / f"run-{schedule}-{m}-{size}"
        engine.save_timeline(run)
        all_peaks = hvd.allgather_object(max(peaks), name=f"peaks.{schedule}.{m}.{size}")
        if hvd.rank() == 0:
            tl = load_timeline(run)
            bubbles = [step_bubble(tl, s) for s in tl.steps[2:]]
            replays = [step_replayed_bubble(tl, s) for s in tl.steps[2:]]
            spans = [max(e["end"] for _, evs in tl.step_events(s) for e in evs)
                     - min(e["start"] for _, evs in tl.step_events(s) for e in evs) for s in tl.steps[2:]]
            busy = [sum(e["end"] - e["start"] for r, evs in tl.step_events(s) for e in evs
                        if e["kind"] in COMPUTE and r["stage"] == 0) for s in tl.steps[2:]]
            ratios = [b / t for b, t in zip(base_times[2:], times[2:])]
            rows.append({"schedule": schedule, "m": m, "batch": size, "step_s": min(times[2:]),
                         "base_s": min(base_times[2:]),
                         "speedup": statistics.median(ratios), "speedup_best": min(base_times[2:]) / min(times[2:]),
                         "bubble": statistics.median(bubbles), "bubble_best": min(bubbles),
                         "replayed": statistics.median(replays),
                         "peaks": all_peaks, "run": str(run), "steps": timed, "span_s": min(spans),
                         "stage0_compute_s": min(busy)})
    if hvd.rank() == 0:
        Path(out).write_text(json.dumps(rows, indent=1))


def write_report(all_rows: list[dict], load: tuple[float, float], pngs: tuple[str, ...], p2p: str, speed: str,
                 probe: dict[int, float]) -> str:
    from hvd_runtime.pipeline.schedule import schedule_bubble, theory_peak_in_flight

    def theory(r: dict) -> float:
        return schedule_bubble(r["schedule"], 2, r["m"], CHUNKS if r["schedule"] == "interleaved-1f1b" else 1)

    order = SCHEDULES.index
    rows = sorted((r for r in all_rows if r["batch"] == BATCH), key=lambda r: (order(r["schedule"]), r["m"]))
    full = sorted((r for r in all_rows if r["batch"] == FULL_BATCH), key=lambda r: order(r["schedule"]))

    lines = [
        "# Pipeline benchmark",
        "",
        f"Generated by `python bench/pipeline_bench.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{os.cpu_count()} cores shared with other jobs (1-minute load average {load[0]:.1f} before, "
        f"{load[1]:.1f} after); {speed}.",
        f"Model: a Linear({INPUTS}, {WIDTH}) stem, then {BLOCKS} Linear({WIDTH}, {WIDTH}) blocks with ReLU, "
        f"batch {BATCH}, synthetic data, fp32, 2 stages balanced by parameter count (stem and {BLOCKS // 2} blocks, "
        f"{BLOCKS // 2} blocks and the classifier: equal compute, as every block on both stages computes its input "
        "gradient), `horovodrun -np 2 --gloo`, one thread per rank, "
        f"the {p2p} link between the stages (`--p2p`), two warm-up steps dropped. The one-process baseline (the whole model, one "
        "thread, same batch) alternates step by step with the pipeline, so both see the same load. Other jobs "
        "keep the cores busy, so each number is given twice: *best* (the least disturbed step: fastest "
        "step of each, the smallest bubble), which estimates a quiet machine, and *median* (median of "
        "per-step bubbles and of per-step speed-ups), which is what this machine gave. The ideal speed-up of "
        "2 balanced stages with free messages is 2 x (1 - bubble). Theory: (p-1)/(m+p-1) for GPipe and 1F1B; "
        "(p-1)/(3m+p-1) for ZB-H1 from m = p on (forward, input and weight backward one unit each), below "
        f"that the schedule played on ideal hardware; (p-1)/(vm+p-1) for interleaved 1F1B with v = {CHUNKS} "
        "chunks a rank (its peak counts micro-batch chunks, each half a stage's activations); for 1F1B with "
        "batched weight gradients the schedule played on ideal hardware with the weight halves counted one unit "
        "per micro-batch, as if not batched: batching them makes them cheaper, so its measured step can beat its "
        "'ideal'. *Replayed* (median over steps): each step played again by the schedule simulator with its own "
        "forward and backward times and free messages (hvd_runtime.pipeline.timeline.replayed_bubble); the "
        "measured bubble above it is the price of the messages and of the work between actions, the replay "
        "above theory that of the compute itself (unequal stages, micro-batches slower than their share of the batch).",
        "",
        "| schedule | m | bubble, best / median | theory | replayed | peak micro-batches in flight (stage 0, 1) "
        "| theory max | fastest step, 1 process / pipeline | speed-up, best / median | ideal |",
        "| --- | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        v = CHUNKS if r["schedule"] == "interleaved-1f1b" else 1
        bubble = theory(r)
        lines.append(f"| {r['schedule']} | {r['m']} | {r['bubble_best']:.3f} / {r['bubble']:.3f} | {bubble:.3f} | {r['replayed']:.3f} | "
                     f"{', '.join(map(str, r['peaks']))} | {theory_peak_in_flight(r['schedule'], 2, r['m'], chunks=v)} | "
                     f"{r['base_s'] * 1e3:.0f} / {r['step_s'] * 1e3:.0f} ms | "
                     f"{r['speedup_best']:.2f}x / {r['speedup']:.2f}x | {2 * (1 - bubble):.2f}x |")
    lines += [
        "",
        "Where a pipeline step goes (fastest steps): the schedule's span from first to last event, the "
        "compute of stage 0 within it, and the rest of the step (the optimizer; the step is timed as the epoch loop "
        "calls it, `train_batch`, which has no collective).",
        "",
        "| schedule | m | step | schedule span | stage 0 compute | rest |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(f"| {r['schedule']} | {r['m']} | {r['step_s'] * 1e3:.0f} ms | {r['span_s'] * 1e3:.0f} ms | "
                     f"{r['stage0_compute_s'] * 1e3:.0f} ms | {(r['step_s'] - r['span_s']) * 1e3:.0f} ms |")
    best = max(rows, key=lambda r: r["speedup_best"])
    lines += [
        "",
        f"Best at batch {BATCH}: {best['schedule']} at m={best['m']}, **{best['speedup_best']:.2f}x** over one process "
        f"(fastest steps; median of per-step ratios {best['speedup']:.2f}x){tall_speedups(full)}.",
        "",
        "Timelines of the last step at m=4 (`hvdgen timeline`), 1F1B, ZB-H1, interleaved 1F1B "
        "(boxes labelled micro-batch@chunk), then 1F1B with batched weight gradients (the one weight pass "
        "at the end drawn as equal boxes, one per micro-batch):",
        "",
        f"![1F1B, 2 stages, 4 micro-batches]({pngs[0]})",
        "",
        f"![ZB-H1, 2 stages, 4 micro-batches]({pngs[1]})",
        "",
        f"![Interleaved 1F1B, 2 stages x 2 chunks, 4 micro-batches]({pngs[2]})",
        "",
        f"![1F1B with batched weight gradients, 2 stages, 4 micro-batches]({pngs[3]})",
        "",
    ]
    if full:
        lines += full_report(full, probe, theory)
    return "\n".join(lines)


def tall_speedups(rows: list[dict]) -> str:
    """The range of the speed-ups on tall micro-batches, for the line that gives the best at batch BATCH."""
    if not rows:
        return ""
    values = [r[key] for r in rows for key in ("speedup_best", "speedup")]
    return f"; on {FULL_BATCH // FULL_MICRO_BATCHES}-row micro-batches, below, {min(values):.2f}-{max(values):.2f}x"


def full_report(rows: list[dict], probe: dict[int, float], theory) -> list[str]:
    """The section on micro-batches tall enough for the matrix units: same model, a bigger batch."""
    rows_per_mb = FULL_BATCH // FULL_MICRO_BATCHES
    lines = [
        f"## Micro-batches of {rows_per_mb} rows",
        "",
        "One block's forward and backward (Linear({0}, {0}), one thread) ran at ".format(WIDTH)
        + ", ".join(f"{n} rows {gflops:.0f}" for n, gflops in probe.items())
        + " GFLOP/s on this machine (fastest of 8 each, measured before the pipeline started). "
        f"At batch {BATCH} and m = 8 a micro-batch has {BATCH // 8} rows, so each stage multiplies "
        "slower per sample than one process does on the whole batch, and the table above measures "
        "that as much as the schedule. Here the same model and link run batch "
        f"{FULL_BATCH} at m = {FULL_MICRO_BATCHES} ({rows_per_mb} rows a micro-batch), the "
        f"one-process baseline alternating step by step on the same batch of {FULL_BATCH} rows, "
        f"{rows[0]['steps']} timed steps each after two warm-up steps.",
        "",
        "| schedule | m | bubble, best / median | theory | replayed | measured / theory (median) "
        "| fastest step, 1 process / pipeline | speed-up, best / median | ideal |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        bubble = theory(r)
        lines.append(f"| {r['schedule']} | {r['m']} | {r['bubble_best']:.3f} / {r['bubble']:.3f} | {bubble:.3f} | "
                     f"{r['replayed']:.3f} | {r['bubble'] / bubble:.2f} | "
                     f"{r['base_s'] * 1e3:.0f} / {r['step_s'] * 1e3:.0f} ms | "
                     f"{r['speedup_best']:.2f}x / {r['speedup']:.2f}x | {2 * (1 - bubble):.2f}x |")
    lines.append("")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true", help="(internal) run as one horovodrun rank")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--full-steps", type=int, default=6,
                    help=f"timed steps of each schedule at batch {FULL_BATCH} (0: leave them out)")
    ap.add_argument("--p2p", default="socket", help="the link between stages: socket (the default of generated "
                    "projects), torch, alltoall or broadcast (bench/p2p_links.py)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--docs", type=Path, default=REPO / "docs")
    args = ap.parse_args()
    if args.worker:
        worker(args.steps, args.full_steps, args.out, args.p2p)
        return
    args.docs.mkdir(parents=True, exist_ok=True)   # a report folder elsewhere may not exist yet
    load_before, speed = os.getloadavg()[0], machine_speed.described()
    probe = {rows: matmul_speed(rows) for rows in ROWS_PROBED} if args.full_steps else {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        horovodrun = Path(sys.executable).with_name("horovodrun")
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
        subprocess.run([str(horovodrun), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable, __file__,
                        "--worker", "--steps", str(args.steps), "--full-steps", str(args.full_steps),
                        "--p2p", args.p2p, "--out", str(out)], check=True, env=env)
        rows = json.loads(out.read_text())
        from hvd_runtime.pipeline.timeline import load_timeline, plot_timeline

        pngs = ("pipeline-timeline.png", "pipeline-timeline-zb-h1.png", "pipeline-timeline-interleaved.png",
                "pipeline-timeline-batched-w.png")
        for schedule, png in zip(("1f1b", "zb-h1", "interleaved-1f1b", "1f1b-batched-w"), pngs):
            run = next(r["run"] for r in rows if r["schedule"] == schedule and r["m"] == 4 and r["batch"] == BATCH)
            plot_timeline(load_timeline(run), args.docs / png)
    report = write_report(rows, (load_before, os.getloadavg()[0]), pngs, args.p2p, speed, probe)
    (args.docs / "benchmarks-pipeline.md").write_text(report)
    print(report)


if __name__ == "__main__":
    main()
