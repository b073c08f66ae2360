"""Tensor parallelism on Horovod process sets (hvd_runtime.tf.tensor_parallel), TensorFlow / Keras 3.

Real `horovodrun --gloo` jobs, each rank comparing the gradient of the generated Keras GPT split
by `apply_tp` with the unsplit one in its own process (tests/distributed/scripts/tf_tp_step.py);
and the refusals, which need no Horovod.
"""

import json
import sys
from pathlib import Path

import keras
import pytest

from helpers import run_horovod
from hvd_runtime.parallel.tensor_groups import TensorGroup, TensorParallelError

SCRIPT = Path(__file__).parent / "scripts" / "tf_tp_step.py"
TOL = 1e-5  # relative, fp32


@pytest.mark.parametrize("np_", [2, 4], ids=["gpt-tp2", "gpt-tp2xdp2"])
def test_split_gpt_gradient_matches_the_unsplit_model(tmp_path, tf_workload_projects, np_):
    """Logits and every variable's gradient equal the unsplit model's (their slice of it) within
    1e-5 relative; each rank holds half of the split layers' kernels."""
    out = tmp_path / "r.json"
    run_horovod(np_, [sys.executable, str(SCRIPT), "--tp", "2", "--project", str(tf_workload_projects["gpt"]),
                      "--out", str(out)], timeout=300)
    reports = json.loads(out.read_text())
    assert sorted(r["rank"] for r in reports) == list(range(np_))
    assert [r["tp_rank"] for r in sorted(reports, key=lambda r: r["rank"])] == [i % 2 for i in range(np_)]
    for r in reports:
        assert r["uncompared"] == [], f"variables of the unsplit model with no split counterpart: {r['uncompared']}"
        worst = max(r["errors"].items(), key=lambda kv: kv[1])
        assert worst[1] < TOL, f"rank {r['rank']}: {worst[0]} off by {worst[1]:.2e} (relative): {r['errors']}"
        assert r["split_share"] == pytest.approx(0.5)


def test_apply_tp_refuses_what_it_cannot_split(tf_workload_projects):
    """A model without transformer blocks, heads that do not divide, dropout: one line each."""
    import importlib.util

    # by its path: a `model` module of the other framework's project may already be imported
    spec = importlib.util.spec_from_file_location("keras_gpt_model_tp", tf_workload_projects["gpt"] / "model.py")
    generated = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(generated)
    build_model = generated.build_model

    from hvd_runtime.config import ModelConfig
    from hvd_runtime.tf.tensor_parallel import apply_tp

    group = TensorGroup(rank=0, size=2, process_set=None)
    plain = keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)])
    with pytest.raises(TensorParallelError, match=r"^Sequential has no transformer blocks to split .*tensor "
                                                  r"parallelism splits the gpt model; use --strategy data"):
        apply_tp(plain, group)
    with pytest.raises(TensorParallelError, match=r"^model.heads 3 do not split over tp 2: choose a tp that divides 3$"):
        apply_tp(build_model(ModelConfig(width=12, heads=3, layers=1, context=4), (4,), 16), group)
    with pytest.raises(TensorParallelError, match=r"^model.dropout 0.1 with tensor parallelism: .*set model.dropout 0$"):
        apply_tp(build_model(ModelConfig(width=8, heads=2, layers=1, context=4, dropout=0.1), (4,), 16), group)
