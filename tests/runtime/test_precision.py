"""Mixed precision and the loss every generated model trains with, in one process."""

import pytest
import torch
import torch.nn.functional as F

from hvd_runtime.config import ConfigError
from hvd_runtime.torch.objective import accuracy, accuracy_sum, cross_entropy
from hvd_runtime.torch.precision import Precision


def test_fp16_on_the_cpu_is_refused_in_one_line():
    with pytest.raises(ConfigError) as error:
        Precision("fp16", torch.device("cpu"))
    assert str(error.value) == ("train.precision fp16 needs a GPU (its loss scaling is CUDA's): "
                                "use bf16 on the CPU, or fp32")
    with pytest.raises(ConfigError, match="train.precision is 'fp8': choose one of fp32, bf16, fp16"):
        Precision("fp8", torch.device("cpu"))


def test_bf16_runs_matmuls_in_bf16_and_fp32_changes_nothing():
    layer = torch.nn.Linear(4, 3)
    x = torch.randn(2, 4)
    with Precision("bf16", torch.device("cpu")).autocast():
        assert layer(x).dtype == torch.bfloat16
    with Precision("fp32", torch.device("cpu")).autocast():
        assert torch.equal(layer(x), layer(x)) and layer(x).dtype == torch.float32


def test_one_loss_for_classifiers_and_language_models():
    logits, target = torch.randn(6, 5), torch.randint(0, 5, (6,))
    assert torch.equal(cross_entropy(logits, target), F.cross_entropy(logits, target))
    seq_logits, seq_target = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    want = F.cross_entropy(seq_logits.permute(0, 2, 1), seq_target)      # torch's (N, C, T) layout
    assert cross_entropy(seq_logits, seq_target).item() == pytest.approx(want.item(), rel=1e-6)
    assert cross_entropy(seq_logits.bfloat16(), seq_target).dtype == torch.float32


def test_accuracy_is_each_samples_share_of_positions_right():
    out = torch.tensor([[[0.0, 1.0], [1.0, 0.0]], [[1.0, 0.0], [1.0, 0.0]]])   # predicts [1, 0] and [0, 0]
    y = torch.tensor([[1, 1], [0, 0]])
    assert accuracy_sum(out, y).item() == pytest.approx(0.5 + 1.0)
    assert accuracy(out, y) == {"accuracy": pytest.approx(0.75)}
    assert accuracy_sum(torch.tensor([[0.0, 2.0], [3.0, 1.0]]), torch.tensor([1, 1])).item() == 1.0
