"""RunLog: rank 0's config and metrics files, written by whichever rank is the writer now."""

import json

import yaml

from hvd_runtime.config import load_config
from hvd_runtime.runlog import RunLog


def test_a_rank_that_becomes_the_writer_writes_the_runs_config_first(tmp_path, capsys):
    """An elastic job's new rank 0 (told by its reset callback) keeps a whole run folder."""
    config = load_config(overrides=["train.epochs=3"])
    log = RunLog(tmp_path / "run", config, is_writer=False)
    log.epoch(1, 10, {"loss": 1.0})
    assert not (tmp_path / "run").exists() and capsys.readouterr().out == ""
    log.is_writer = True
    log.epoch(2, 20, {"loss": 0.5})
    assert yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]["epochs"] == 3
    assert [json.loads(line)["epoch"] for line in log.metrics_path.read_text().splitlines()] == [2]
    assert "epoch   2  step     20  loss 0.5000" in capsys.readouterr().out
