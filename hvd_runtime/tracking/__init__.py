"""MLflow tracking for a Horovod job: rank 0 logs one run, every other rank does nothing.

    tracker = start_tracking(config, rank=hvd.rank(), world_size=hvd.size(), framework="torch",
                             strategy="data", project_name="demo", run_id=checkpoint_run_id)
    with tracker:
        tracker.log_metrics({"train/loss": averaged_loss}, step=step)
        ...
        tracker.log_model(model, input_example=batch[:4])

    system = start_system_metrics(config, framework="torch")     # on every rank
    tracker.log_metrics(system.gather(), step=step)              # each epoch: every host's readings

Where it logs: the `tracking_uri` argument > MLFLOW_TRACKING_URI > config `tracking.uri` >
the embedded store sqlite:///mlflow.db in the working directory (no server needed).
Tracking is never a reason for training to fail: calls return at once, a background sender hands
the work to MLflow in a process of its own (remote.py), and if the server fails one warning is
printed and the rest of the run is spooled to <run_dir>/mlflow-spool, which
`python -m hvd_runtime.tracking.replay` sends later.
"""

from __future__ import annotations

import logging

from . import params as run_facts
from . import records, settings
from .sender import Sender
from .spool import Spool
from .handover import HandoverTracker
from .system import SystemMetrics, start_system_metrics
from .tracker import NullTracker, OneWarning, Tracker

log = logging.getLogger("hvd_runtime.tracking")


def start_tracking(config, *, rank: int, world_size: int, framework: str, strategy: str, project_name: str,
                   run_id: str | None = None, tracking_uri: str | None = None, elastic: bool = False):
    """A Tracker on rank 0 (a NullTracker elsewhere, or when config tracking.enabled is false).

    `run_id` is the id stored with a checkpoint: when the server has that run, logging continues
    in it. Never raises: if tracking cannot even start, one warning and a NullTracker.
    elastic: a HandoverTracker on every rank, so that a new rank 0 takes over the run when the
    old one is lost (run_elastic(..., tracker=) tells it when).
    """
    if elastic:
        def start(rank: int, world_size: int, run_id: str | None):
            return start_tracking(config, rank=rank, world_size=world_size, framework=framework, strategy=strategy,
                                  project_name=project_name, run_id=run_id, tracking_uri=tracking_uri)
        return HandoverTracker(start, rank, world_size, run_id)
    if rank != 0 or not settings.enabled(config):
        return NullTracker()
    try:
        uri = settings.resolve_uri(tracking_uri, config)
        settings.apply_http_defaults()
        params = run_facts.run_params(config, world_size=world_size, strategy=strategy, framework=framework)
        header = {"kind": "run", "experiment": settings.experiment_name(config, project_name), "run_id": run_id,
                  "run_name": f"{framework}-{strategy}-np{world_size}", "tags": run_facts.run_tags(params),
                  "start_time": records.now_ms(), "tracking_uri": run_facts.redact(uri)}
        spool_dir = settings.spool_dir(config)
        warn = OneWarning(spool_dir, run_facts.redact(uri))
        sender = Sender(uri, header, records.params(params), Spool(spool_dir, lambda: sender.segment_head()), warn,
                        flavor="pytorch" if framework == "torch" else None)
        sender.start()
        return Tracker(sender, warn, checkpoint_models=settings.checkpoint_models(config))
    except Exception as exc:
        log.warning("MLflow tracking is off for this run: %s", exc)
        return NullTracker()


__all__ = ["start_tracking", "start_system_metrics", "SystemMetrics", "HandoverTracker", "Tracker", "NullTracker"]
