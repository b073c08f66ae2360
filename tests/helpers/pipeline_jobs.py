"""Many pipeline cases, few horovodrun jobs: the cases that share a grid run in one job.

A step-script job's start-up (every rank importing its framework, starting Horovod, opening the
pipeline's links: 16 CPU-s for two torch ranks) costs as much as a small case. The step scripts
take `--cases FILE` (a JSON list of cases, each a dict of flags over the command line's), run
on one init_pipeline, whose arguments (-np, stages, link, tp, chunks) are the grid. A test asks
for its case's results; the first case asked for of a grid runs that grid's job, with all of
its cases, and the rest read theirs. The model-split step scripts have no grid (every case runs
on two workers): `model_split_job` runs all of a file's cases in one job.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path

from helpers import bench_links, run_horovod

Grid = tuple[int, int, str, int, int]   # -np, stages, p2p link, tp, chunks


def grid_jobs(root: Path, script: Path, job_cases: dict[str, tuple[Grid, dict]],
              projects: dict[str, Path | None]) -> Callable[[str], tuple[list[dict], Path | None]]:
    """results(case id) -> (every rank's results, the case's run folder or None).

    job_cases: case id -> (its grid, its flags); a flag `model` names a generated project in
    `projects`, `run_dir: True` asks for a run folder (the timeline). A failed job fails every
    one of its cases, without running again.
    """
    done: dict[Grid, dict | Exception] = {}

    def run(job: Grid) -> dict:
        np_, stages, p2p, tp, chunks = job
        folder = root / f"job{len(done)}"
        folder.mkdir()
        ids = [what for what, (j, _) in job_cases.items() if j == job]
        cases = _write_cases(folder, [job_cases[what][1] for what in ids], projects)
        run_horovod(np_, [sys.executable, str(script), "--stages", str(stages), "--p2p", p2p, "--tp", str(tp),
                          "--chunks", str(chunks), "--cases", str(folder / "cases.json")],
                    cwd=folder, env=bench_links(), timeout=_job_timeout(cases))
        return {what: (json.loads(Path(case["out"]).read_text()), case.get("run_dir") and Path(case["run_dir"]))
                for what, case in zip(ids, cases)}

    def results(what: str) -> tuple[list[dict], Path | None]:
        job = job_cases[what][0]
        if job not in done:
            try:
                done[job] = run(job)
            except Exception as failed:
                done[job] = failed
        if isinstance(done[job], Exception):
            raise done[job]
        return done[job][what]

    return results


def model_split_job(folder: Path, script: Path, rows: list[tuple], projects: dict[str, Path | None]) -> dict[str, list[dict]]:
    """Every row (model, clip norm, steps, id) of a model-split table run in one `horovodrun -np 2`
    job of `script`, 3 micro-batches each; each case's results, every rank's, by id."""
    ids = [row[-1] for row in rows]
    cases = _write_cases(folder, [{"model": model, "clip_norm": clip, "steps": steps}
                                  for model, clip, steps, _ in rows], projects)
    run_horovod(2, [sys.executable, str(script), "--micro-batches", "3", "--cases", str(folder / "cases.json")],
                cwd=folder, timeout=_job_timeout(cases))
    return {what: json.loads(Path(case["out"]).read_text()) for what, case in zip(ids, cases)}


def _job_timeout(cases: list) -> int:
    """A job's start-up (ranks, rendezvous, links) plus a single case's own limit per case."""
    return 120 + 150 * len(cases)


def _write_cases(folder: Path, flag_sets: list[dict], projects: dict[str, Path | None]) -> list[dict]:
    """Each flag set as a case, written to folder/cases.json: its own results file, a flag `model`'s
    project from `projects` (none for the tests' own MLP), a run folder where `run_dir` is True."""
    cases = []
    for k, flags in enumerate(flag_sets):
        case = {**flags, "out": str(folder / f"case{k}.json")}
        if flags.get("run_dir"):
            case["run_dir"] = str(folder / f"run{k}")
        if "model" in case:
            case["project"] = projects[case["model"]] and str(projects[case["model"]])
        cases.append(case)
    (folder / "cases.json").write_text(json.dumps(cases, indent=1))
    return cases
