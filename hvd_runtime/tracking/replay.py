"""Send a tracking spool to an MLflow server once it is reachable again.

    python -m hvd_runtime.tracking.replay runs/latest/mlflow-spool --uri http://mlflow.example:5000

Each segment continues its run when that server has the run id, else becomes a new run in the
same experiment (tagged with the original id). A spool that was sent in full moves to the end of
spool.replayed.jsonl, so running the command twice does not log everything twice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import records, settings
from .spool import SPOOL_FILE, read_segments

REPLAYED_FILE = "spool.replayed.jsonl"


def spool_file(path: str | Path) -> Path:
    path = Path(path)
    return path / SPOOL_FILE if path.is_dir() else path


class ReplayStopped(RuntimeError):
    """Sending failed part-way; the spool now holds only what is left, so running again resumes."""


def replay(path: str | Path, uri: str, experiment: str | None = None) -> list[str]:
    """Send every segment of the spool at `path` (file or directory) to `uri`; return the run ids."""
    from .sink import MlflowSink

    file = spool_file(path)
    sink = MlflowSink(uri)
    segments = list(read_segments(file))
    run_ids = []
    for index, (header, items) in enumerate(segments):
        if experiment:
            header = {**header, "experiment": experiment}
        run_id = sink.open_run(header, reopen=False)
        sent = 0
        try:
            for group in records.group(items):
                sink.apply(run_id, group, base=file.parent)
                sent += len(group)
            if header.get("run_id") != run_id and not any(r["kind"] == "end" for r in items):
                # a new run whose job never reported how it ended: do not leave it RUNNING forever
                sink.apply(run_id, [records.end("KILLED")])
        except Exception as exc:
            left = [({**header, "run_id": run_id}, items[sent:]), *segments[index + 1:]]
            _rewrite(file, left)
            raise ReplayStopped(f"{exc} ({sum(len(r) for _, r in left)} records left in {file})") from exc
        run_ids.append(run_id)
    with file.with_name(REPLAYED_FILE).open("a", encoding="utf-8") as done:  # a history, never overwritten
        done.write(file.read_text(encoding="utf-8"))
    file.unlink()
    return run_ids


def _rewrite(file: Path, segments: list[tuple[dict, list[dict]]]) -> None:
    """Replace the spool with `segments`, atomically: a crash here must not lose the spool."""
    tmp = file.with_suffix(".tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for header, items in segments:
            f.writelines(json.dumps(r) + "\n" for r in (header, *items))
    os.replace(tmp, file)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hvd_runtime.tracking.replay", description=__doc__.split("\n")[0])
    parser.add_argument("spool", help="the spool directory (<run_dir>/mlflow-spool) or its spool.jsonl")
    parser.add_argument("--uri", default=os.environ.get("MLFLOW_TRACKING_URI") or settings.embedded_uri(),
                        help="tracking server or store (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")
    parser.add_argument("--experiment", help="log into this experiment instead of the spooled one")
    args = parser.parse_args(argv)
    file = spool_file(args.spool)
    if not file.exists():
        print(f"no spool at {file}: nothing to replay", file=sys.stderr)
        return 1
    try:
        run_ids = replay(file, args.uri, args.experiment)
    except ReplayStopped as exc:
        print(f"replay stopped: {exc}; run the same command again to send the rest", file=sys.stderr)
        return 1
    for run_id in run_ids:
        print(f"replayed into run {run_id} at {args.uri}")
    print(f"done; the spool is kept as {file.with_name(REPLAYED_FILE)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
