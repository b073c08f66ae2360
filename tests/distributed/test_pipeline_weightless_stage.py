"""A pipeline stage without weights (the generated MLP's flatten, alone in stage 0 at --stages 4)
trains in step with the others: no backward through it, an optimizer step with nothing to
update, nothing to average over its replicas. Checked against the whole model in one process,
for each framework (2 stages x 2 replicas: the flatten alone in stage 0, replicated)."""

import json
import sys
from pathlib import Path

import pytest

from helpers import bench_links, run_horovod
from helpers.pipeline_checks import check_against_reference

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_weight_free_first_stage_with_replicas_matches_single_process(tmp_path):
    out = tmp_path / "result.json"
    run_horovod(4, [sys.executable, str(SCRIPTS / "pipeline_step.py"), "--stages", "2", "--schedule", "1f1b",
                    "--micro-batches", "2", "--flatten-first", "--partition", "1", "--out", str(out)],
                cwd=tmp_path, env=bench_links(), timeout=280)
    results = json.loads(out.read_text())
    check_against_reference(results, 4, 2, "1f1b", 2, [str(i) for i in range(8)])
    first = [r for r in results if r["stage"] == 0]
    assert all(r["blocks"] == ["0"] and r["update_err"] == {} for r in first), "stage 0 holds only the flatten"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tf_weight_free_first_stage_with_replicas_matches_single_process(tmp_path):
    pytest.importorskip("tensorflow")
    out = tmp_path / "result.json"
    run_horovod(4, [sys.executable, str(SCRIPTS / "tf_pipeline_step.py"), "--stages", "2", "--schedule", "1f1b",
                    "--micro-batches", "2", "--flatten-first", "--partition", "b0", "--out", str(out)],
                cwd=tmp_path, env=bench_links(), timeout=280)
    results = json.loads(out.read_text())
    check_against_reference(results, 4, 2, "1f1b", 2, ["flat", *(f"b{i}" for i in range(7))])
    first = [r for r in results if r["stage"] == 0]
    assert all(r["blocks"] == ["flat"] and r["update_err"] == {} for r in first), "stage 0 holds only the flatten"
