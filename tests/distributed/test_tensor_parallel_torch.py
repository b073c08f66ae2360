"""Tensor parallelism on Horovod process sets (hvd_runtime.torch.tensor_parallel), PyTorch.

Real `horovodrun --gloo` jobs, each rank comparing one step of the split MLP or generated GPT with
the unsplit one in its own process (tests/distributed/scripts/tp_step.py, judged by
tests/helpers/tp_checks.py); and the layout's arithmetic and refusals, which need no Horovod.
"""

import json
import sys
from pathlib import Path

import pytest
from torch import nn

from helpers import run_horovod
from hvd_runtime.parallel.tensor_groups import TensorParallelError
from hvd_runtime.torch.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TensorGroup, apply_tp
from helpers.tp_checks import check_apply_tp_refusals, check_edited_block_refusals, check_tp_reports, load_generated_model

SCRIPT = Path(__file__).parent / "scripts" / "tp_step.py"


def test_sizes_that_do_not_split_are_refused_in_one_line():
    group = TensorGroup(rank=0, size=3, process_set=None)
    with pytest.raises(TensorParallelError, match=r"^column-parallel Linear\(in_features=4, out_features=8, "
                                                  r"bias=True\) has 8 features, which do not split over tp 3: "
                                                  r"choose a tp that divides 8$"):
        ColumnParallelLinear(nn.Linear(4, 8), group)
    with pytest.raises(TensorParallelError, match=r"has 4 features, which do not split over tp 3"):
        RowParallelLinear(nn.Linear(4, 6), group)


@pytest.mark.parametrize("np_, tp, model, gpt_args", [(2, 2, "mlp", []), (4, 2, "mlp", []), (2, 2, "gpt", []),
                                                      (4, 2, "gpt", ["--vocab", "17", "--tied"])],
                         ids=["mlp-tp2", "mlp-tp2xdp2", "gpt-tp2", "gpt-tp2xdp2-tied-odd-vocab"])
def test_split_step_matches_the_unsplit_model(tmp_path, workload_projects, np_, tp, model, gpt_args):
    """Outputs, the MLP input's gradient and every parameter's gradient equal the whole model's
    (their slice of it) within 1e-5 relative; each rank holds 1/tp of the split layers' weights.
    gpt is the generated project's model split by apply_tp (heads, the MLP, the embedding and head
    by vocabulary), its loss and accuracy computed on logits split over the vocabulary: they too
    equal the whole model's. A vocabulary of 17 splits 9 + 8; a tied head stays tied."""
    out = tmp_path / "r.json"
    project = ["--project", str(workload_projects["gpt"]), *gpt_args] if model == "gpt" else []
    run_horovod(np_, [sys.executable, str(SCRIPT), "--tp", str(tp), "--model", model, *project, "--out", str(out)],
                timeout=300)
    reports = json.loads(out.read_text())
    check_tp_reports(reports, np_, tp, even="17" not in gpt_args)
    if model == "gpt":
        assert all({"loss", "accuracy", "0.tokens.weight"} <= set(r["errors"]) for r in reports)


def test_apply_tp_refuses_what_it_cannot_split(workload_projects):
    model = load_generated_model(workload_projects["gpt"], "torch_gpt_model_tp")
    check_apply_tp_refusals(apply_tp, model.build_model, nn.Sequential(nn.Linear(4, 4)))


def test_a_block_edited_so_its_heads_do_not_split_is_refused_in_one_line(workload_projects):
    model = load_generated_model(workload_projects["gpt"], "torch_gpt_model_tp_heads")
    check_edited_block_refusals(apply_tp, model.build_model, lambda gpt: gpt[2],
                                lambda block, rate: setattr(block, "extra", nn.Dropout(rate)))
