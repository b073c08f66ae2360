"""Timelines: saved by one writer, idle derived, bubble measured, drawn, and shown by the CLI."""

import json
from types import SimpleNamespace

import pytest
from click.testing import CliRunner

from hvd_runtime.pipeline import timeline
from hvd_runtime.pipeline.schedule import Op, build_schedule, bubble_fraction, schedule_bubble, simulate
from hvd_runtime.pipeline.timeline import (TimelineRecorder, explain_bubble, load_timeline, measured_bubble, peak_in_flight,
                                           plot_timeline, replayed_bubble, save_timeline, stage_compute_ms, step_bubble,
                                           step_replayed_bubble)
from hvdgen.cli import main

KIND = {Op.FORWARD: "forward", Op.BACKWARD: "backward", Op.SEND_ACT: "send", Op.SEND_GRAD: "send",
        Op.RECV_ACT: "recv", Op.RECV_GRAD: "recv", Op.BACKWARD_INPUT: "backward_input",
        Op.BACKWARD_WEIGHT: "backward_weight"}


def simulated_records(name, p, m, steps=2, tb=2.0, chunks=1, replicas=1, slower=None, latency=0.0, last_m=None):
    """Per-rank records of a run played by the simulator: each step starts where the previous ended, times in ms.

    A whole backward takes tb; a split backward's halves take half of it each. `slower`: {stage:
    factor} for stages whose compute takes longer; `latency`: ms between a send and its receive;
    `last_m`: the micro-batches of the last step (an epoch's short last batch). Rank r is stage
    r % p of replica r // p; replica k computes (1 + k / 10) times slower, so replicas differ."""
    recs = [TimelineRecorder(rank=r, stage=r % p, replica=r // p) for r in range(p * replicas)]
    t0 = 1000.0
    for step in range(steps):
        mb = last_m if last_m and step == steps - 1 else m
        end = 0.0
        for k in range(replicas):
            def took(stage, action):
                base = {Op.FORWARD: 1.0, Op.BACKWARD: tb}.get(action.op, tb / 2)
                return base / chunks * (slower or {}).get(stage, 1.0) * (1 + k / 10)

            slots = simulate(build_schedule(name, p, mb, chunks), durations=took, latency=latency)
            for s, row in enumerate(slots):
                rec = recs[k * p + s]
                rec.step = step
                for sl in row:
                    rec.add(KIND[sl.action.op], sl.action.micro_batch, t0 + sl.start / 1e3, t0 + sl.end / 1e3,
                            sl.action.chunk)
            end = max(end, max(sl.end for row in slots for sl in row))
        t0 += end / 1e3 + 0.001
    return [r.record() for r in recs]


@pytest.mark.parametrize("name", ["gpipe", "1f1b", "zb-h1"])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_measured_bubble_of_an_ideal_run_matches_theory(tmp_path, name, m):
    meta = {"schedule": name, "stages": 2, "replicas": 1, "micro_batches": m}
    save_timeline(tmp_path, simulated_records(name, 2, m), meta)
    tl = load_timeline(tmp_path)
    assert tl.meta == meta and tl.steps == [0, 1]
    assert measured_bubble(tl) == pytest.approx(schedule_bubble(name, 2, m), rel=1e-6)
    if name != "zb-h1":
        assert schedule_bubble(name, 2, m) == bubble_fraction(2, m)


SHAPES = [("gpipe", 2, 4, 1), ("1f1b", 2, 8, 1), ("1f1b", 3, 4, 1), ("zb-h1", 3, 6, 1), ("1f1b-batched-w", 2, 4, 1),
          ("interleaved-1f1b", 2, 4, 2), ("interleaved-1f1b", 3, 3, 2)]


@pytest.mark.parametrize("name, p, m, chunks", SHAPES)
@pytest.mark.parametrize("replicas", [1, 2])
def test_replayed_bubble_tells_message_cost_from_unequal_stages(tmp_path, name, p, m, chunks, replicas):
    """The replay keeps each action's measured time and makes messages free: it equals the measured
    bubble where messages were free, whatever the stages cost, and stays there when they are not."""
    def bubbles(**run):
        meta = {"schedule": name, "stages": p, "replicas": replicas, "micro_batches": m, "chunks": chunks}
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        save_timeline(folder, simulated_records(name, p, m, steps=3, chunks=chunks, replicas=replicas, **run), meta)
        tl = load_timeline(folder)
        return measured_bubble(tl), replayed_bubble(tl)

    measured, replayed = bubbles()
    assert replayed == pytest.approx(measured, rel=1e-9)
    if replicas == 1:   # unit costs (a split backward's halves one unit each): the theory's own case
        assert measured == pytest.approx(schedule_bubble(name, p, m, chunks), rel=1e-6)
    slow_link, replayed_slow_link = bubbles(latency=0.4)       # each message 0.4 of a forward late
    assert slow_link > measured + 0.02
    assert replayed_slow_link == pytest.approx(replayed, rel=1e-9)    # the same compute: the same replay
    unequal, replayed_unequal = bubbles(slower={p - 1: 1.5})   # the last stage's compute 1.5 times the others'
    assert replayed_unequal == pytest.approx(unequal, rel=1e-9) and unequal > measured + 0.02
    both, replayed_both = bubbles(slower={p - 1: 1.5}, latency=0.4)
    assert replayed_both == pytest.approx(unequal, rel=1e-9) and both > unequal + 1e-3


@pytest.mark.parametrize("name, chunks, replicas", [("1f1b", 1, 1), ("interleaved-1f1b", 2, 1), ("1f1b", 1, 2)])
def test_explain_bubble_names_the_larger_part_of_the_gap_and_its_knob(tmp_path, name, chunks, replicas):
    """Unequal stages point at the cut and name the slowest stage; slow messages point at the rows per
    micro-batch; an ideal run is within 10% of theory. Each stage's compute per micro-batch is its
    forward and backward over every chunk (1 + 2 ms in these runs; replica k is (1 + k/10) slower)."""
    def explained(**run):
        meta = {"schedule": name, "stages": 2, "replicas": replicas, "micro_batches": 4, "chunks": chunks}
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        save_timeline(folder, simulated_records(name, 2, 4, steps=3, chunks=chunks, replicas=replicas, **run), meta)
        tl = load_timeline(folder)
        theory = schedule_bubble(name, 2, 4, chunks)
        return stage_compute_ms(tl), explain_bubble(tl, measured_bubble(tl), replayed_bubble(tl), theory)

    replica_mean = sum(1 + k / 10 for k in range(replicas)) / replicas
    per_stage, text = explained()
    assert per_stage == pytest.approx({0: 3.0 * replica_mean, 1: 3.0 * replica_mean}, rel=1e-6)
    if replicas == 1:
        assert text.startswith("the bubble is within 10% of theory"), text
    else:   # the slower replica sets the pace, with stages alike: no cut to blame
        assert "the stages compute alike on the whole" in text and "sets the pace" not in text, text

    per_stage, text = explained(slower={1: 2.0})
    assert per_stage == pytest.approx({0: 3.0 * replica_mean, 1: 6.0 * replica_mean}, rel=1e-6)
    assert "uneven compute" in text and "messages" not in text, text
    assert "stage 1 sets the pace: move blocks off it (parallel.partition)" in text, text
    assert f"a micro-batch computes stage 0 {3.0 * replica_mean:.3g} ms, stage 1 {6.0 * replica_mean:.3g} ms" in text

    per_stage, text = explained(latency=1.5)
    assert per_stage == pytest.approx({0: 3.0 * replica_mean, 1: 3.0 * replica_mean}, rel=1e-6)
    assert "messages and the work between actions" in text, text
    assert ("uneven compute" in text) == (replicas > 1), text   # the replicas' own speeds, as above
    assert "more rows per micro-batch" in text, text
    gap = float(text.split(" above theory")[0])
    assert gap > 0.05


def test_stage_compute_is_per_micro_batch_over_the_steps_asked(tmp_path):
    """By default the steps measured_bubble takes (all but the first); `hvdgen timeline --step` asks for one."""
    recs = [TimelineRecorder(rank=r, stage=r) for r in range(2)]
    for step, scale in ((0, 5.0), (1, 1.0), (2, 3.0)):     # ms per forward; a backward twice that
        for rec in recs:
            rec.begin_step(step)
            for mb in range(2):
                start = 100.0 * step + 10.0 * mb
                rec.add("forward", mb, start / 1e3, (start + scale) / 1e3)
                rec.add("backward", mb, (start + scale) / 1e3, (start + 3 * scale) / 1e3)
    save_timeline(tmp_path, [r.record() for r in recs], {"schedule": "1f1b", "stages": 2, "replicas": 1,
                                                         "micro_batches": 2})
    tl = load_timeline(tmp_path)
    assert stage_compute_ms(tl) == pytest.approx({0: 6.0, 1: 6.0})          # steps 1 and 2: 3 ms and 9 ms
    assert stage_compute_ms(tl, [2]) == pytest.approx({0: 9.0, 1: 9.0})
    assert "stage 0 9 ms, stage 1 9 ms" in explain_bubble(tl, 0.5, 0.2, 0.1, steps=[2])


def test_replay_plays_a_short_last_batch_with_its_own_micro_batches(tmp_path):
    """An epoch's last batch may hold fewer micro-batches than configured; the replay counts what ran."""
    save_timeline(tmp_path, simulated_records("1f1b", 2, 4, steps=3, last_m=2),
                  {"schedule": "1f1b", "stages": 2, "replicas": 1, "micro_batches": 4, "chunks": 1})
    tl = load_timeline(tmp_path)
    assert step_replayed_bubble(tl, 2) == pytest.approx(step_bubble(tl, 2), rel=1e-9)
    assert step_bubble(tl, 2) == pytest.approx(bubble_fraction(2, 2), rel=1e-6)
    assert step_replayed_bubble(tl, 1) == pytest.approx(bubble_fraction(2, 4), rel=1e-6)


def test_idle_fills_every_gap_so_each_row_covers_the_step(tmp_path):
    save_timeline(tmp_path, simulated_records("gpipe", 3, 4, steps=1), {"stages": 3, "micro_batches": 4})
    tl = load_timeline(tmp_path)
    span = step_span = None
    for rank, events in tl.step_events(0):
        total = sum(e["end"] - e["start"] for e in events)
        step_span = max(e["end"] for e in events) - min(e["start"] for e in events)
        span = span or step_span
        assert step_span == pytest.approx(span)
        assert total == pytest.approx(span)       # no overlap, no hole
        idle = [e for e in events if e["kind"] == "idle"]
        assert idle or rank["stage"] == 0
    # the last stage waits (p-1) forwards before micro-batch 0 arrives
    last = [e for r, evs in tl.step_events(0) if r["stage"] == 2 for e in evs]
    assert last[0]["kind"] == "idle" and last[0]["mb"] == 0
    assert last[0]["end"] - last[0]["start"] == pytest.approx(2e-3, rel=0.05)


@pytest.mark.parametrize("name,m,peaks", [("gpipe", 4, {0: 4, 1: 4, 2: 4}), ("1f1b", 4, {0: 3, 1: 2, 2: 1}),
                                          ("1f1b", 2, {0: 2, 1: 2, 2: 1}), ("zb-h1", 4, {0: 3, 1: 3, 2: 3})])
def test_peak_in_flight_read_from_the_events(tmp_path, name, m, peaks):
    save_timeline(tmp_path, simulated_records(name, 3, m, steps=1), {"schedule": name, "stages": 3, "micro_batches": m})
    assert peak_in_flight(load_timeline(tmp_path), 0) == peaks


def test_recorder_spans_and_disabled_recorder(monkeypatch):
    clock = iter([10.0, 10.25, 11.0, 11.5, 12.0, 12.5])     # read once when a span opens, once when it closes
    monkeypatch.setattr(timeline, "time", SimpleNamespace(time=lambda: next(clock)))   # this module's clock only
    rec = TimelineRecorder(rank=0, stage=0)
    rec.step = 4
    with rec.span("forward", 3):
        pass
    assert rec.events == [{"step": 4, "kind": "forward", "mb": 3, "start": 10.0, "end": 10.25}]
    with pytest.raises(RuntimeError), rec.span("backward", 3):    # a failing op still closes its span
        raise RuntimeError("boom")
    assert rec.events[-1] == {"step": 4, "kind": "backward", "mb": 3, "start": 11.0, "end": 11.5}
    off = TimelineRecorder(rank=0, stage=0, enabled=False)
    with off.span("forward", 0):
        pass
    assert off.events == []


def test_recorder_keeps_the_last_steps_past_the_start_up():
    """keep_steps bounds memory to the last steps begun, not the first: those share the cores with the run's start-up."""
    rec = TimelineRecorder(rank=0, stage=0, keep_steps=3)
    for step in range(7):
        rec.begin_step(step)
        for kind in ("forward", "backward"):
            rec.add(kind, 0, float(step), step + 0.5)
        assert sorted({e["step"] for e in rec.events}) == list(range(max(0, step - 2), step + 1))
    assert len(rec.events) == 6 and rec.step == 6
    everything = TimelineRecorder(rank=0, stage=0)   # keep_steps 0: every step
    for step in range(7):
        everything.begin_step(step)
        everything.add("forward", 0, float(step), step + 0.5)
    assert [e["step"] for e in everything.events] == list(range(7))


def test_plot_writes_a_png(tmp_path):
    save_timeline(tmp_path, simulated_records("1f1b", 2, 4), {"schedule": "1f1b", "stages": 2, "micro_batches": 4})
    out = plot_timeline(load_timeline(tmp_path), tmp_path / "t.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_cli_prints_measured_and_theory_and_writes_png(tmp_path):
    save_timeline(tmp_path, simulated_records("1f1b", 2, 4, steps=3), {"schedule": "1f1b", "stages": 2,
                                                                         "replicas": 1, "micro_batches": 4})
    result = CliRunner().invoke(main, ["timeline", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "1f1b: 2 stages x 1 replicas, 4 micro-batches, 3 steps recorded" in result.output
    measured = float(result.output.split("measured bubble ")[1].split()[0])
    assert measured == pytest.approx(0.2, abs=0.01)
    assert "theory   bubble 0.200 = (p-1)/(m+p-1)" in result.output
    assert "replayed bubble 0.200: this run's compute times on the schedule, messages free" in result.output
    assert "the bubble is within 10% of theory (0.20): the schedule runs as designed" in result.output
    assert "micro-batches in flight, step 2: stage 0: 2, stage 1: 1 (theory: at most 2)" in result.output
    assert (tmp_path / "timeline.png").exists()
    result = CliRunner().invoke(main, ["timeline", str(tmp_path), "--step", "1", "-o", str(tmp_path / "s1.png")])
    assert result.exit_code == 0 and "(step 1)" in result.output and (tmp_path / "s1.png").exists()


def test_cli_errors_are_one_line(tmp_path):
    result = CliRunner().invoke(main, ["timeline", str(tmp_path)])
    assert result.exit_code == 1 and "Error: no timeline at" in result.output
    save_timeline(tmp_path, simulated_records("gpipe", 2, 2), {"stages": 2, "micro_batches": 2})
    result = CliRunner().invoke(main, ["timeline", str(tmp_path), "--step", "9"])
    assert result.exit_code == 1 and "--step 9 was not recorded: recorded steps are 0..1" in result.output
    (tmp_path / "timeline.json").write_text(json.dumps({"something": "else"}))
    result = CliRunner().invoke(main, ["timeline", str(tmp_path)])
    assert result.exit_code == 1 and "is not a timeline file" in result.output



def test_cli_on_a_run_that_trained_no_step_says_so_in_one_line_and_draws_nothing(tmp_path):
    """A job restarted after its last epoch saves an empty timeline (what `make train` twice leaves)."""
    save_timeline(tmp_path, [{"rank": r, "stage": r, "replica": 0, "events": []} for r in range(2)],
                  {"schedule": "1f1b", "stages": 2, "micro_batches": 4})
    before = sorted(tmp_path.iterdir())
    for extra in ([], ["--step", "0"]):
        result = CliRunner().invoke(main, ["timeline", str(tmp_path), *extra])
        assert result.exit_code == 1, result.output
        assert result.output.startswith("Error: ") and len(result.output.strip().splitlines()) == 1
        assert "recorded no training step (did the run resume after its last epoch?)" in result.output
    assert sorted(tmp_path.iterdir()) == before


def test_cli_on_a_schedule_it_does_not_know_draws_and_says_it_cannot_replay(tmp_path):
    """A timeline of a schedule this hvdgen lacks (a newer hvdgen's): the theory falls back to
    1F1B's as before, and the replay, which needs the real schedule, says so in one line."""
    save_timeline(tmp_path, simulated_records("1f1b", 2, 4), {"schedule": "weird", "stages": 2, "micro_batches": 4})
    result = CliRunner().invoke(main, ["timeline", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "replayed bubble: not for schedule 'weird', which this hvdgen cannot play (it knows gpipe, " in result.output
    assert "replayed bubble 0" not in result.output and (tmp_path / "timeline.png").exists()


def test_step_bubble_of_a_missing_step(tmp_path):
    save_timeline(tmp_path, simulated_records("gpipe", 2, 2, steps=1), {})
    with pytest.raises(ValueError, match="no events in step 5"):
        step_bubble(load_timeline(tmp_path), 5)


@pytest.mark.parametrize("p,m,theory", [(2, 4, "0.077 = (p-1)/(3m+p-1)"),
                                        (3, 2, "0.333 = the schedule on ideal hardware")])
def test_cli_shows_the_zero_bubble_theory(tmp_path, p, m, theory):
    save_timeline(tmp_path, simulated_records("zb-h1", p, m), {"schedule": "zb-h1", "stages": p, "micro_batches": m})
    result = CliRunner().invoke(main, ["timeline", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert f"theory   bubble {theory}" in result.output
    measured = float(result.output.split("measured bubble ")[1].split()[0])
    assert measured == pytest.approx(float(theory.split()[0]), abs=0.001)
    held = ", ".join(f"stage {s}: {min(p, m)}" for s in range(p))
    assert f"micro-batches in flight, step 1: {held} (theory: at most {min(p, m)})" in result.output
