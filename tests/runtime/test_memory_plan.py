"""The memory plan (hvd_runtime.memory_plan): what a rank will hold, counted before its model is real.

The activations are counted on meta tensors; here against what autograd saves in a real forward
of the same model (the same hooks, real values), with and without recomputed blocks. The refusal
under horovodrun, a GPT past any machine's memory: tests/projects/test_start_up_refusals.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hvd_runtime.config import ConfigError
from hvd_runtime.memory_plan import GIB, MemoryPlan, available_bytes, verdict
from hvd_runtime.torch.memory_plan import activations_of, block_activations, held_parameters, largest_block
from hvd_runtime.torch.meta_init import build_on_meta
from hvd_runtime.torch.recompute import is_recomputed, recompute_blocks


def model() -> nn.Sequential:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16), nn.LayerNorm(16)) for _ in range(3)]
    return nn.Sequential(nn.Linear(8, 16), *blocks, nn.Linear(16, 4))


def saved_for_real(m: nn.Sequential, x: torch.Tensor) -> dict[str, int]:
    """block_activations' count, made with real tensors: what the meta count must equal."""
    counted = {}
    for name, block in m.named_children():
        inputs = x.detach().requires_grad_(True)
        saved = [0]

        def pack(t):
            if not isinstance(t, nn.Parameter) and (t._base is None or not isinstance(t._base, nn.Parameter)):
                saved[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            x = block(inputs)
        counted[name] = saved[0]
    return counted


@pytest.mark.parametrize("recompute", [False, True])
def test_activations_counted_on_meta_are_what_a_real_forward_saves(recompute):
    x = torch.randn(32, 8)
    meta = build_on_meta(model)
    real = model()
    if recompute:
        recompute_blocks(meta), recompute_blocks(real)
    counted = block_activations(meta, x)
    if recompute:   # a recomputed block keeps its input alone
        expected = {str(i): 32 * (8 if i == 0 else 16) * 4 for i in range(5)}
    else:
        expected = saved_for_real(real, x)
    assert {k: v for k, v in counted.items() if v} == {k: v for k, v in expected.items() if v}
    assert held_parameters(meta) == sum(p.numel() for p in real.parameters())


def test_a_recomputed_block_adds_what_its_backward_saves_again_once():
    """Backward runs a recomputed block's forward again and holds what that saves while it runs: the
    plan counts every block's input, and the largest block's whole activations once."""
    x = torch.randn(32, 8)
    meta = recompute_blocks(build_on_meta(model))
    counted = activations_of(meta, x)
    whole = saved_for_real(model(), x)
    assert counted.recomputing == whole and counted.kept == block_activations(meta, x)
    assert all(is_recomputed(block) for block in meta.children()), "the blocks recompute again afterwards"
    kept = sum(counted.kept.values())
    assert counted.bytes(None, 1.0, 1.0) == kept + max(whole.values())
    assert counted.bytes(["1", "2"], 3.0, 0.5) == round(3 * (counted.kept["1"] + counted.kept["2"])
                                                       + 0.5 * max(whole["1"], whole["2"]))
    assert activations_of(build_on_meta(model), x).recomputing == {}   # nothing recomputed, nothing added


def test_a_tied_parameter_counts_once():
    tied = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    tied[1].weight = tied[0].weight
    assert held_parameters(tied) == 40


def test_the_plan_refuses_what_the_host_cannot_hold():
    plan = MemoryPlan(parameters=GIB // 4, optimizer_state=2, activations=GIB, ranks_on_host=4, recompute=False)
    assert plan.rank_bytes == 4 * GIB + GIB   # parameters, gradients and Adam's two moments, float32
    assert plan.line().startswith("memory: each rank holds about 5.00 GiB (268,435,456 parameters: 1.00 GiB, "
                                  "gradients 1.00 GiB, optimizer state 2.00 GiB, activations 1.00 GiB); 4 on this host")
    plan.check(20 * GIB, "more parallel.stages")   # fits: 4 x 5 GiB
    with pytest.raises(ConfigError) as refused:
        plan.check(19 * GIB, "more parallel.stages")
    assert str(refused.value) == (
        "memory: the 4 rank(s) on this host would hold about 20.00 GiB (5.00 GiB each: 4.00 GiB of parameters, "
        "gradients and optimizer state, 1.00 GiB of activations), more than the 19.00 GiB of this host: use fewer "
        "ranks on this host, a smaller model, or model.recompute blocks (activations), more parallel.stages")
    plan.check(None, "more parallel.stages")   # a host that does not say: no verdict


@pytest.mark.parametrize("zero, per_parameter", [(0, 16), (1, 8 + 8 / 4), (2, 4 + 12 / 4), (3, 16 / 4)])
def test_zero_holds_the_papers_bytes_a_parameter(zero, per_parameter):
    """fp32 Adam: 16 bytes a parameter; ZeRO over N = 4 replicas: 8 + 8/N, 4 + 12/N, 16/N."""
    plan = MemoryPlan(parameters=2**20, optimizer_state=2, activations=0, ranks_on_host=4, recompute=False,
                      zero=zero, replicas=4)
    assert plan.state_bytes == per_parameter * 2**20
    if zero:
        assert f"(1,048,576 parameters under ZeRO {zero} over 4 replicas: " in plan.line()


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_zero_3_adds_its_largest_block_whole_three_times(zero):
    """ZeRO 3 holds, on top of its rows, the largest block's gradients whole in backward and the
    reduce-scatter's send and receive buffers of them: 3 x 4 bytes an element of that block. The
    other stages gather no block."""
    plan = MemoryPlan(parameters=2**20, optimizer_state=2, activations=0, ranks_on_host=4, recompute=False,
                      zero=zero, replicas=4, largest_block=1000)
    assert plan.gathered_bytes == (12_000 if zero == 3 else 0)
    assert plan.rank_bytes == plan.state_bytes + plan.gathered_bytes
    assert ("a block gathered 0.0 MiB" in plan.line()) == (zero == 3)
    if zero == 3:
        refused = verdict([("h", 1, plan)], "more ranks")
        assert "of parameters, gradients and optimizer state, 0.0 MiB of a block gathered, " in refused


class WithOwn(nn.Sequential):
    """Blocks, and a parameter of the model's own outside them (ZeRO 3 gathers it as one more part)."""

    def __init__(self, own: int):
        super().__init__(*model())
        self.scale = nn.Parameter(torch.ones(own))


def test_the_largest_block_is_counted_whole_or_the_models_own_parameters():
    # model(): Linear(8, 16) 144, three blocks of 16*64 + 64 + 64*16 + 16 + 2*16 = 2,160 each, Linear(16, 4) 68
    assert largest_block(model()) == 2160
    assert largest_block(WithOwn(own=100)) == 2160
    assert largest_block(WithOwn(own=5000)) == 5000
    tied = model()
    tied[1][0].weight = tied[2][0].weight     # one tensor in two blocks: each gathers it
    assert largest_block(tied) == 2160


@pytest.mark.parametrize("zero, per_parameter", [(0, 16), (1, 8 + 12 / 4), (2, 8 + 12 / 4)])
def test_keras_zero_counts_its_copy_of_the_rows_and_whole_gradients(zero, per_parameter):
    """Keras steps a copy of a rank's rows (4/N) and a pass's gradients are whole: 8 + 12/N."""
    plan = MemoryPlan(parameters=2**20, optimizer_state=2, activations=0, ranks_on_host=4, recompute=False,
                      zero=zero, replicas=4, rows_copy=True)
    assert plan.state_bytes == per_parameter * 2**20


def test_the_hosts_memory_is_its_total_or_a_lower_container_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683784 kB\nMemFree:         1000000 kB\nMemAvailable:   18000000 kB\n")
    unlimited, limited = tmp_path / "memory.max", tmp_path / "limit_in_bytes"
    unlimited.write_text("max\n")
    assert available_bytes(meminfo, (unlimited,)) == 24683784 * 1024
    limited.write_text(f"{8 * GIB}\n")
    assert available_bytes(meminfo, (unlimited, limited)) == 8 * GIB
    assert available_bytes(tmp_path / "missing", ()) is None


def test_a_host_is_judged_by_its_ranks_plans_summed():
    """A pipeline's stages hold different shares: the host holds their sum, named by its fullest rank."""
    big = MemoryPlan(parameters=GIB // 4, optimizer_state=2, activations=None, ranks_on_host=2, recompute=False)
    small = MemoryPlan(parameters=GIB // 16, optimizer_state=2, activations=None, ranks_on_host=2, recompute=False)
    assert verdict([("a", 6 * GIB, big), ("a", 6 * GIB, small)], "more parallel.stages") is None   # 4 + 1 GiB
    assert verdict([("a", 6 * GIB, big), ("b", 6 * GIB, big)], "x") is None                       # a host each
    assert verdict([("a", None, big), ("a", None, big)], "x") is None      # hosts that do not say: no verdict
    assert verdict([("a", 4 * GIB, small), ("a", 4 * GIB, big)], "more parallel.stages") == (
        "memory: the 2 rank(s) on this host would hold about 5.00 GiB (4.00 GiB on the fullest: 4.00 GiB of "
        "parameters, gradients and optimizer state, activations not counted), more than the 4.00 GiB of this host: "
        "use fewer ranks on this host, a smaller model, or more parallel.stages")
    refused = verdict([("a", 9 * GIB, big), ("b", 7 * GIB, big), ("b", 7 * GIB, big)], "more parallel.stages")
    assert refused.startswith("memory: the 2 rank(s) on this host would hold about 8.00 GiB (4.00 GiB each: ")
    assert " more than the 7.00 GiB of this host" in refused
