"""Tensor parallelism on Horovod process sets (hvd_runtime.tf.tensor_parallel), TensorFlow / Keras 3.

Real `horovodrun --gloo` jobs, each rank comparing the gradient of the generated Keras GPT split
by `apply_tp` with the unsplit one in its own process (tests/distributed/scripts/tf_tp_step.py,
judged by tests/helpers/tp_checks.py as for PyTorch); and the refusals, which need no Horovod.
"""

import json
import sys
from pathlib import Path

import keras
import pytest

from helpers import run_horovod
from hvd_runtime.tf.tensor_parallel import apply_tp
from helpers.tp_checks import check_apply_tp_refusals, check_edited_block_refusals, check_tp_reports, load_generated_model

SCRIPT = Path(__file__).parent / "scripts" / "tf_tp_step.py"


@pytest.mark.parametrize("np_, gpt_args", [(2, []), (4, ["--vocab", "17", "--tied"])],
                         ids=["gpt-tp2", "gpt-tp2xdp2-tied-odd-vocab"])
def test_split_gpt_gradient_matches_the_unsplit_model(tmp_path, tf_workload_projects, np_, gpt_args):
    """Logits (this rank's vocabulary rows), loss, accuracy and every variable's gradient equal the
    whole model's (their slice of it) within 1e-5 relative; each rank holds half of the split
    layers' weights (about half, for a vocabulary of 17 split 9 + 8). A tied head stays tied."""
    out = tmp_path / "r.json"
    run_horovod(np_, [sys.executable, str(SCRIPT), "--tp", "2", "--project", str(tf_workload_projects["gpt"]),
                      *gpt_args, "--out", str(out)], timeout=300)
    reports = json.loads(out.read_text())
    check_tp_reports(reports, np_, tp=2, even=not gpt_args)
    assert all({"loss", "accuracy", "embedding_1_tp.embeddings"} <= set(r["errors"]) for r in reports)


def test_apply_tp_refuses_what_it_cannot_split(tf_workload_projects):
    model = load_generated_model(tf_workload_projects["gpt"], "keras_gpt_model_tp")
    check_apply_tp_refusals(apply_tp, model.build_model, keras.Sequential([keras.Input((4,)), keras.layers.Dense(4)]))


def test_a_block_edited_so_its_heads_do_not_split_is_refused_in_one_line(tf_workload_projects):
    model = load_generated_model(tf_workload_projects["gpt"], "keras_gpt_model_tp_heads")
    check_edited_block_refusals(apply_tp, model.build_model, lambda gpt: gpt.layers[2],
                                lambda block, rate: setattr(block.dropout, "rate", rate))
