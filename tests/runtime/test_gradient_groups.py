"""How a CPU rank's gradients are grouped for Horovod: a step's worth at once, one fusion buffer a group."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from hvd_runtime.torch.fusion import DEFAULT_FUSION_THRESHOLD  # noqa: E402
from hvd_runtime.torch.optim import gradient_groups  # noqa: E402

CPU = torch.device("cpu")


def model():
    """Three layers of 4x4 weights + 4 biases: 80 bytes per layer in fp32."""
    return torch.nn.Sequential(*(torch.nn.Linear(4, 4) for _ in range(3)))


@pytest.fixture(autouse=True)
def not_elastic(monkeypatch):
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)


def test_a_small_model_sends_all_its_gradients_as_one_group(monkeypatch):
    monkeypatch.delenv("HOROVOD_FUSION_THRESHOLD", raising=False)
    net = model()
    assert DEFAULT_FUSION_THRESHOLD == 64 * 1024 * 1024  # Horovod's own default
    assert gradient_groups(net, CPU, adasum=False) == [list(net.parameters())]


def test_groups_hold_at_most_one_fusion_buffer_in_the_models_order(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "160")  # two layers' weights and biases
    net = model()
    params = list(net.parameters())
    assert gradient_groups(net, CPU, adasum=False) == [params[:4], params[4:]]


def test_a_tensor_larger_than_the_buffer_is_a_group_of_its_own(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "32")
    net = model()
    assert [len(g) for g in gradient_groups(net, CPU, adasum=False)] == [1, 1, 1, 1, 1, 1]


def test_frozen_parameters_are_left_out():
    net = model()
    net[0].weight.requires_grad_(False)
    groups = gradient_groups(net, CPU, adasum=False)
    assert all(p is not net[0].weight for g in groups for p in g)
    assert sum(len(g) for g in groups) == 5


def test_no_groups_without_trainable_parameters():
    net = model().requires_grad_(False)
    assert gradient_groups(net, CPU, adasum=False) is None


@pytest.mark.parametrize("device, adasum", [(torch.device("cuda", 0), False), (CPU, True)],
                         ids=["gpu: Horovod overlaps allreduce with backward", "adasum: per tensor"])
def test_gpus_and_adasum_keep_one_allreduce_per_tensor(device, adasum):
    assert gradient_groups(model(), device, adasum=adasum) is None


def test_elastic_jobs_keep_one_allreduce_per_tensor(monkeypatch):
    """With groups Horovod's optimizer holds a collective when built: a joining worker would hang."""
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    assert gradient_groups(model(), CPU, adasum=False) is None
