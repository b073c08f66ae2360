"""`hvdgen timeline RUN_DIR`: the measured pipeline bubble beside the theory, and the picture.

Imports nothing heavy until it runs: matplotlib loads only to draw.
"""

from __future__ import annotations

from pathlib import Path

import click

from hvdgen.errors import HvdgenError


@click.command("timeline")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--step", type=int, default=None, help="Step to draw (default: the last recorded).")
@click.option("--out", "-o", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="PNG to write (default: RUN_DIR/timeline.png).")
def timeline_cmd(run_dir: Path, step: int | None, out: Path | None) -> None:
    """Draw a pipeline run's timeline and print its measured bubble against the schedule's theory
    and against the schedule replayed with the run's own compute times."""
    from hvd_runtime.config import INTERLEAVED
    from hvd_runtime.pipeline.schedule import SCHEDULES, SPLIT_BACKWARD, schedule_bubble, theory_peak_in_flight
    from hvd_runtime.pipeline.timeline import (explain_bubble, load_timeline, measured_bubble, peak_in_flight,
                                               plot_timeline, replayed_bubble, step_bubble, step_replayed_bubble)

    try:
        tl = load_timeline(run_dir)
    except (FileNotFoundError, ValueError) as e:
        raise HvdgenError(str(e)) from None
    if not tl.steps:   # a run that resumed after its last epoch trains, and records, nothing
        raise HvdgenError(f"{run_dir} recorded no training step (did the run resume after its last epoch?): "
                          "train further, e.g. --train.epochs with a higher number, then draw it again")
    if step is not None and step not in tl.steps:
        raise HvdgenError(f"--step {step} was not recorded: recorded steps are {tl.steps[0]}..{tl.steps[-1]}")
    meta = tl.meta
    p, m = int(meta.get("stages", 1)), int(meta.get("micro_batches", 1))
    click.echo(f"{meta.get('schedule', '?')}: {p} stages x {meta.get('replicas', 1)} replicas, "
               f"{m} micro-batches, {len(tl.steps)} steps recorded")
    shown = step_bubble(tl, step) if step is not None else measured_bubble(tl)
    which = f"step {step}" if step is not None else "mean over steps after the first"
    click.echo(f"measured bubble {shown:.3f} ({which})")
    name = meta.get("schedule") if meta.get("schedule") in SCHEDULES else "1f1b"
    v = int(meta.get("chunks", 1))
    if name in INTERLEAVED:
        formula = (f"(p-1)/(vm+p-1), v = {v} chunks" if m % p == 0
                   else "its chunk-by-chunk fallback (m not a multiple of p) on ideal hardware")
    elif name not in SPLIT_BACKWARD:
        formula = "(p-1)/(m+p-1)"
    elif name == "zb-h1" and m >= p:
        formula = "(p-1)/(3m+p-1)"
    else:
        formula = ("the schedule on ideal hardware, weight halves one unit each" if name == "zb-h1" else
                   "the schedule on ideal hardware, weight halves one unit each as if not batched")
    theory_bubble = schedule_bubble(name, p, m, v)
    click.echo(f"theory   bubble {theory_bubble:.3f} = {formula}")
    if meta.get("schedule", "1f1b") in SCHEDULES:
        replayed = step_replayed_bubble(tl, step) if step is not None else replayed_bubble(tl)
        click.echo(f"replayed bubble {replayed:.3f}: this run's compute times on the schedule, messages free; "
                   "above it, messages and the work between actions; between it and theory, uneven compute")
        click.echo(explain_bubble(tl, shown, replayed, theory_bubble, steps=None if step is None else [step]))
    else:   # a schedule this hvdgen does not know (a newer one's file): it cannot be played again
        click.echo(f"replayed bubble: not for schedule {meta['schedule']!r}, which this hvdgen cannot play "
                   f"(it knows {', '.join(SCHEDULES)})")
    shown_step = step if step is not None else tl.steps[-1]
    peaks = peak_in_flight(tl, shown_step)
    stages = {r["rank"]: r["stage"] for r in tl.ranks}
    held = ", ".join(f"stage {stages[r]}: {n}" for r, n in sorted(peaks.items(), key=lambda kv: (stages[kv[0]], kv[0])))
    theory = (f" (theory: at most {theory_peak_in_flight(meta['schedule'], p, m, chunks=v)})"
              if meta.get("schedule") in SCHEDULES else "")
    click.echo(f"micro-batches in flight, step {shown_step}: {held}{theory}")
    png = plot_timeline(tl, out or run_dir / "timeline.png", step)
    click.echo(f"wrote {png}")
