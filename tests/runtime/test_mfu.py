"""MFU (hvd_runtime.mfu): each generated model's FLOPs against a hand count, the peak table, the arithmetic.

The hand counts are the models' matmuls and convolutions, 2 FLOPs a multiply-add, from the
architecture each model.py describes; the counters (torch's flop_counter, TensorFlow's profiler
counts) run on the models as build_on_meta makes them, as a run does. TensorFlow's also count
biases and other element-wise ops: within 1% at these sizes. The GPT's count is 6N + 12·L·d·T a
token by its parameters, against its matmuls and attention counted by hand.
"""

from __future__ import annotations

import numpy as np
import pytest

from hvd_runtime.config import ModelConfig, RunConfig
from hvd_runtime.mfu import Utilization, gpu_peak, precision_column, training_flops
from hvd_runtime.throughput import Throughput
from hvdgen.render import render_tree
from hvdgen.spec import ProjectSpec
from helpers.tp_checks import load_generated_model

MLP = ModelConfig()                                        # hidden 128, 64
RESNET = ModelConfig(width=64)                             # the published widths
GPT = ModelConfig(width=256, heads=4, layers=3, context=64)


def mlp_forward(features: int, classes: int, hidden=(128, 64)) -> int:
    widths = [features, *hidden, classes]
    return sum(2 * a * b for a, b in zip(widths, widths[1:]))


def resnet18_forward(channels: int, side: int, width: int, classes: int) -> int:
    """The small-image ResNet-18: a 3x3 stem, four stages of two residual blocks (the first of each
    later stage halves the side, with a 1x1 shortcut), a linear head."""
    flops, c, s = 2 * 9 * channels * width * side * side, width, side
    for stage, out in enumerate((width, 2 * width, 4 * width, 8 * width)):
        for i in range(2):
            stride = 2 if stage > 0 and i == 0 else 1
            s = -(-s // stride)
            flops += 2 * 9 * c * out * s * s + 2 * 9 * out * out * s * s
            if stride != 1 or c != out:
                flops += 2 * c * out * s * s
            c = out
    return flops + 2 * c * classes


def gpt_training(vocab: int, cfg: ModelConfig) -> int:
    """A token's matmuls: per block q, k, v and the output projection (4d²) and the MLP (8d²); the
    head tied to the embedding (V·d); x3 for backward; attention's scores and weighted sum 2·2·T·d
    a block, x3."""
    d, t, layers = cfg.width, cfg.context, cfg.layers
    per_token = 3 * 2 * (layers * 12 * d * d + vocab * d) + 3 * layers * 4 * t * d
    return t * per_token


@pytest.fixture(scope="module")
def generated(tmp_path_factory):
    """build_model of a generated project per (framework, model kind)."""
    found = {}
    for framework in ("torch", "tensorflow"):
        for kind in ("mlp", "resnet18", "gpt"):
            out = tmp_path_factory.mktemp(f"{framework}-{kind}")
            render_tree(ProjectSpec(name="p", framework=framework, model=kind), out)
            found[framework, kind] = load_generated_model(out, f"mfu_{framework}_{kind}").build_model
    return found


def counted(framework: str, build, cfg: ModelConfig, input_shape, classes: int, language_model: bool) -> float:
    """training_flops of the model as a run counts it (on the meta model)."""
    if framework == "torch":
        from hvd_runtime.torch.flops import forward_flops
        from hvd_runtime.torch.memory_plan import held_parameters
        from hvd_runtime.torch.meta_init import build_on_meta
        import torch
        dtype = torch.long if language_model else torch.float32
    else:
        from hvd_runtime.tf.flops import forward_flops
        from hvd_runtime.tf.memory_plan import held_parameters
        from hvd_runtime.tf.meta_init import build_on_meta
        import tensorflow as tf
        dtype = tf.int32 if language_model else tf.float32
    model = build_on_meta(build, cfg, input_shape, classes)
    return training_flops(cfg, language_model, lambda: held_parameters(model),
                          lambda: forward_flops(model, input_shape, dtype))


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_each_generated_models_flops_match_a_hand_count(generated, framework, caplog):
    mlp = counted(framework, generated[framework, "mlp"], MLP, (64,), 10, False)
    assert mlp == pytest.approx(3 * mlp_forward(64, 10), rel=0.01)
    resnet = counted(framework, generated[framework, "resnet18"], RESNET, (3, 32, 32), 10, False)  # channels first
    assert resnet == pytest.approx(3 * resnet18_forward(3, 32, 64, 10), rel=0.01)
    assert resnet18_forward(3, 32, 64, 10) == pytest.approx(2 * 0.557e9, rel=0.01)   # CIFAR ResNet-18: 0.56 G MACs
    gpt = counted(framework, generated[framework, "gpt"], GPT, (GPT.context,), 256, True)
    assert gpt == pytest.approx(gpt_training(256, GPT), rel=0.01)
    # TensorFlow's counts are its TF1 profiler's, which warns of its own helpers: not in a user's run
    assert not [r.getMessage() for r in caplog.records if "deprecated" in r.getMessage()]


def test_the_peak_table_finds_each_gpu_by_its_drivers_name():
    assert gpu_peak("NVIDIA H100 80GB HBM3", "bf16") == pytest.approx(989.4e12)
    assert gpu_peak("NVIDIA H100 PCIe", "bf16") == pytest.approx(756e12)
    assert gpu_peak("NVIDIA H200", "tf32") == pytest.approx(494.7e12)
    assert gpu_peak("NVIDIA A100-SXM4-80GB", "fp32") == pytest.approx(19.5e12)
    assert gpu_peak("NVIDIA A10", "bf16") == pytest.approx(125e12)   # not the A100's
    assert gpu_peak("NVIDIA L4", "fp16") == pytest.approx(121e12)
    assert gpu_peak("NVIDIA L40S", "fp16") == pytest.approx(362.05e12)
    assert gpu_peak("Tesla V100-SXM2-16GB", "bf16") is None           # no bf16 units: no MFU
    assert gpu_peak("NVIDIA GeForce GTX 1080", "fp32") is None        # not in the table
    assert precision_column("fp32", tf32=True) == "tf32" and precision_column("fp32", tf32=False) == "fp32"
    assert precision_column("bf16", tf32=True) == "bf16"


def test_every_rate_comes_with_its_mfu():
    utilization = Utilization(flops_per_sample=3e9, peak=2 * 989.4e12, devices="2 x NVIDIA H100 80GB HBM3, bf16")
    assert utilization.of(100_000) == pytest.approx(3e14 / 1978.8e12)
    assert utilization.line() == ("mfu: 3 GFLOP a sample (forward and backward), the job's peak 1.98 PFLOP/s "
                                  "(2 x NVIDIA H100 80GB HBM3, bf16)")
    speed = Throughput(samples_per_step=64, utilization=Utilization(1e6, 1e9, "1 x CPU"))
    speed.step()
    rates = speed.since_last()
    assert rates["mfu"] == pytest.approx(1e6 * rates["samples_per_s"] / 1e9)
    assert "mfu" not in Throughput(samples_per_step=64)._rates(1.0, 1)   # the other ranks: none


def test_counting_draws_no_random_number_and_only_rank_0_counts():
    """A run's numbers must not depend on MFU: the CPU's peak is timed on constant matrices."""
    import torch

    from hvd_runtime.torch.flops import count_utilization
    from hvd_runtime.torch.meta_init import build_on_meta

    class Rank:
        def __init__(self, rank):
            self.is_root, self.size, self.device, self.stage_devices = rank == 0, 2, torch.device("cpu"), None

    cfg = RunConfig()
    model = build_on_meta(lambda: torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)))
    example = np.zeros((1, 64), np.float32)
    assert count_utilization(model, example, Rank(1), cfg, language_model=False) is None
    torch.manual_seed(0)
    before = torch.get_rng_state()
    found = count_utilization(model, example, Rank(0), cfg, language_model=False)
    assert torch.equal(torch.get_rng_state(), before)
    assert found.flops_per_sample == 3 * 2 * (64 * 128 + 128 * 10) and found.peak > 0
    assert found.devices.startswith("2 x CPU at its measured fp32 matmul rate")
