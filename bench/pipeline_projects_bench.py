"""The generated pipeline projects at their defaults: their bubble against theory, and their timelines.

    python bench/pipeline_projects_bench.py               # 2 rounds, both frameworks
    python bench/pipeline_projects_bench.py --rounds 1

`hvdgen new --strategy pipeline` for torch and for TensorFlow, each trained as its README says
(`horovodrun -np 2 -H localhost:2 --gloo python train.py`: the digits MLP, 2 stages, 1F1B, 4
micro-batches, 20 epochs, tracked in the project's own MLflow store), afresh every round, the
frameworks in turned order. Each run prints its bubble, measured over its last 20 steps, beside
the theory and the replay, and a line on what the gap is made of (timeline.explain_bubble); this
collects them into docs/benchmarks-pipeline-projects.md and keeps each framework's last timeline
as docs/pipeline-project-timeline[-tensorflow].png.
"""

from __future__ import annotations

import os
import re
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from project_runs import BIN, FRAMEWORKS, bench_arguments, readme_run

BUBBLE = re.compile(r"pipeline bubble: measured ([\d.]+), theory ([\d.]+), replayed ([\d.]+) ")
EXPLAINED = re.compile(r"pipeline bubble: ((?:[\d.]+ above theory|the bubble is within).*)")


def picture_name(framework: str) -> str:
    return "pipeline-project-timeline.png" if framework == "torch" else f"pipeline-project-timeline-{framework}.png"


def train(project: Path) -> dict:
    """One run of the project's README line, from scratch; its bubble lines, parsed."""
    proc, _ = readme_run(project)
    bubble, explained = BUBBLE.search(proc.stdout), EXPLAINED.search(proc.stdout)
    if not bubble or not explained:
        raise RuntimeError(f"the README line in {project} printed no bubble:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    measured, theory, replayed = map(float, bubble.groups())
    return {"measured": measured, "theory": theory, "replayed": replayed, "explained": explained.group(1).strip()}


def report(runs: dict[str, list[dict]], rounds: int, load: tuple[float, float]) -> str:
    med = statistics.median
    rows = []
    for framework, results in runs.items():
        def by_round(key: str) -> str:
            return ", ".join(f"{r[key]:.2f}" for r in results)

        ratio = med(r["measured"] / r["theory"] for r in results)
        rows.append(f"| {framework} | {by_round('measured')} | {results[0]['theory']:.2f} | {by_round('replayed')} | "
                    f"{ratio:.2f} |")
    lines = [
        "# The generated pipeline projects at their defaults",
        "",
        f"`python bench/pipeline_projects_bench.py` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} "
        f"({rounds} round{'s' if rounds > 1 else ''}, 1-minute load average {load[0]:.1f} before, {load[1]:.1f} "
        "after). Each framework's project as `hvdgen new --strategy pipeline` writes it (digits MLP, hidden 128 "
        "and 64, batch 32, 2 stages cut by time, 1F1B, 4 micro-batches of 8 rows, 20 epochs, tracked), trained "
        "from scratch with its README's line `horovodrun -np 2 -H localhost:2 --gloo python train.py`. The "
        "bubble is measured over the run's last 20 steps (the first share the cores with the run's start-up); "
        "*replayed* is the same steps' compute on the schedule with free messages.",
        "",
        "| framework | bubble measured, by round | theory | replayed, by round | measured / theory (median) |",
        "| --- | ---: | ---: | ---: | ---: |",
        *rows,
        "",
        "What each project's last run said about the gap (`pipeline bubble:` at the end of its output):",
        "",
        *[f"- {framework}: {results[-1]['explained']}" for framework, results in runs.items()],
        "",
        "A micro-batch of this MLP computes for a fraction of a millisecond (torch) or a couple of "
        "milliseconds (TensorFlow's per-call overhead) per stage, about what a hand-off between the stages "
        "costs on this machine: the projects are a pipeline's wiring at a size that trains in seconds, not a "
        "workload that needs one. [pipeline.md](pipeline.md) has the same engine on a model big enough for it.",
        "",
        *[f"![{framework} pipeline project, last step](" + picture_name(framework) + ")\n" for framework in runs],
    ]
    return "\n".join(lines)


def main() -> None:
    args = bench_arguments(__doc__)
    load_before = os.getloadavg()[0]
    runs: dict[str, list[dict]] = {framework: [] for framework in FRAMEWORKS}
    with tempfile.TemporaryDirectory() as tmp:
        projects = {}
        for framework in FRAMEWORKS:
            subprocess.run([str(BIN / "hvdgen"), "new", f"pp_{framework}", "--framework", framework,
                            "--strategy", "pipeline", "--output", tmp], check=True, capture_output=True)
            projects[framework] = Path(tmp) / f"pp_{framework}"
        for r in range(args.rounds):
            for framework in (FRAMEWORKS if r % 2 == 0 else FRAMEWORKS[::-1]):
                runs[framework].append(train(projects[framework]))
                got = runs[framework][-1]
                print(f"round {r + 1} {framework}: bubble {got['measured']:.2f}, theory {got['theory']:.2f}, "
                      f"replayed {got['replayed']:.2f}", flush=True)
                if r == args.rounds - 1:
                    shutil.copy(projects[framework] / "runs" / "latest" / "timeline.png",
                                args.docs / picture_name(framework))
    out = args.docs / "benchmarks-pipeline-projects.md"
    out.write_text(report(runs, args.rounds, (load_before, os.getloadavg()[0])))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
