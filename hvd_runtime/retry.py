"""Start a failed training job again, from its newest checkpoint, until it finishes or stops moving.

    python -m hvd_runtime.retry --max-restarts 3 -- horovodrun -np 4 -H localhost:4 --gloo python train.py

A rank that crashes, is killed or hangs (the watchdog ends it) ends the whole horovodrun job, and
a job that is not elastic has nothing to go on with. A generated train.py resumes exactly from its
newest checkpoint (model, optimizer, the position in the epoch, every rank's random state), so the
same command started again continues the run, in the same MLflow run; this launcher does that,
as torchrun's `--max-restarts` and Kubernetes' `backoffLimit` do.

Progress is the newest checkpoint's step. The checkpoint folder is the job's `checkpoint.dir`:
the config.yaml beside the command's first `*.py` that has one, with the command's overrides
after it (`--checkpoint-dir` names it instead, for a command of another shape). The restarts
allowed, `--max-restarts`, are counted since the newest checkpoint last moved: a long run that
fails now and then goes on as long as each attempt gets further, while a job that fails again
before its next checkpoint (a crash loop: a bug, a bad node, a value that always diverges) is
given up on after that many restarts, with one line, and the launcher exits with the job's last
status. Between attempts it waits `--backoff-s`, doubled with each restart that has not moved the
step, 60 s at most. A job started with `--checkpoint.resume false` starts over once: its restarts
resume what it wrote.

SIGINT, SIGTERM and SIGUSR1 sent to the launcher go to the job (SIGUSR1 as SIGTERM, which
horovodrun hands to every rank), and the launcher restarts nothing after them: it waits for the
job and exits with its status. The job stays in the launcher's process group, so a terminal's
Ctrl-C reaches both.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

import click

from hvd_runtime.checkpoint import newest_step
from hvd_runtime.config import ConfigError, load_config

__all__ = ["Retry", "job_checkpoints", "main"]

MAX_WAIT_S = 60.0
FORWARDED = {signal.SIGINT: signal.SIGINT, signal.SIGTERM: signal.SIGTERM, signal.SIGUSR1: signal.SIGTERM}


def job_checkpoints(command: Sequence[str]) -> tuple[Path, bool] | None:
    """(checkpoint.dir, checkpoint.resume) of the job `command` runs, from the config.yaml beside its
    first script that has one and the overrides after it; None for a command without one."""
    for i, arg in enumerate(command):
        config = Path(arg).with_name("config.yaml")
        if arg.endswith(".py") and config.is_file():
            cfg = load_config(config, list(command[i + 1:]))
            return Path(cfg.checkpoint.dir), cfg.checkpoint.resume
    return None


class Retry:
    """Runs `command` until it exits 0, a signal stops it, or `max_restarts` restarts in a row
    leave `progress()` (the newest checkpoint's step, None before the first) where it was."""

    def __init__(self, command: Sequence[str], max_restarts: int, backoff_s: float,
                 progress: Callable[[], int | None], restart_args: Sequence[str] = (),
                 say: Callable[[str], None] = lambda line: print(line, file=sys.stderr, flush=True)):
        self.command, self.restart_args = list(command), list(restart_args)
        self.max_restarts, self.backoff_s = max_restarts, backoff_s
        self.progress, self.say = progress, say
        self.stopped_by: int | None = None
        self._job: subprocess.Popen | None = None

    def run(self) -> int:
        restarts = 0          # since the step last moved
        attempt = 1
        for sig in FORWARDED:
            signal.signal(sig, self._forward)
        while True:
            before = self.progress()
            code = self._attempt(self.command if attempt == 1 else self.command + self.restart_args)
            if code == 0 or self.stopped_by is not None:
                return code
            step = self.progress()
            if step is not None and (before is None or step > before):
                restarts = 0
            where = f"newest checkpoint at step {step}" if step is not None else "no checkpoint yet"
            if restarts >= self.max_restarts:
                if self.max_restarts:
                    self.say(f"retry: giving up: {restarts} restarts in a row did not move the newest checkpoint "
                             f"({where}; --max-restarts {self.max_restarts}); exit status {code}, the last failure's")
                return code
            wait = min(self.backoff_s * 2 ** restarts, MAX_WAIT_S)
            restarts += 1
            attempt += 1
            self.say(f"retry: the job exited with status {code} ({where}); "
                     f"restart {restarts} of {self.max_restarts} in {wait:g} s")
            if not self._waited(wait):   # a signal during the wait: nothing more to start
                return code

    def _attempt(self, command: list[str]) -> int:
        self._job = subprocess.Popen(command)
        try:
            code = self._job.wait()
            return 128 - code if code < 0 else code   # ended by signal n: the shell's 128 + n
        finally:
            self._job = None

    def _waited(self, seconds: float) -> bool:
        end = time.monotonic() + seconds
        while self.stopped_by is None and (left := end - time.monotonic()) > 0:
            time.sleep(min(left, 0.1))
        return self.stopped_by is None

    def _forward(self, signum, frame) -> None:
        self.stopped_by = signum
        job = self._job
        if job is not None and job.poll() is None:
            job.send_signal(FORWARDED[signum])


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--max-restarts", type=click.IntRange(min=0), default=3, show_default=True,
              help="Restarts in a row that do not move the newest checkpoint, before giving up.")
@click.option("--backoff-s", type=click.FloatRange(min=0), default=2.0, show_default=True,
              help="Seconds before the first restart; doubled with each one that has not moved the step.")
@click.option("--checkpoint-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The job's checkpoint folder (default: checkpoint.dir of the config.yaml beside its script).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def main(max_restarts: int, backoff_s: float, checkpoint_dir: Path | None, command: tuple[str, ...]) -> None:
    """Run COMMAND (after --), and again from its newest checkpoint when it fails."""
    restart_args: list[str] = []
    if checkpoint_dir is None:
        try:
            found = job_checkpoints(command)
        except ConfigError as exc:   # the job would stop with it at every attempt
            sys.exit(f"config error: {exc}")
        if found is None:
            raise click.UsageError("no script in the command has a config.yaml beside it: "
                                   "name the job's checkpoint folder with --checkpoint-dir")
        checkpoint_dir, resumes = found
        if not resumes:
            restart_args = ["--checkpoint.resume", "true"]
    retry = Retry(command, max_restarts, backoff_s, lambda: newest_step(checkpoint_dir), restart_args)
    sys.exit(retry.run())


if __name__ == "__main__":
    main(prog_name=f"{Path(sys.executable).name} -m hvd_runtime.retry")
