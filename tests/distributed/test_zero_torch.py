"""ZeRO 1, 2 and 3 on Horovod (hvd_runtime.torch.zero), PyTorch: steps against the unsplit model,
and checkpoints that resume at another dp, another stage and unsplit.

Three real `horovodrun --gloo` jobs serve every check (tests/distributed/scripts/zero_step.py,
several cases a job): at np 4 each stage trains fresh and two of them save a checkpoint; at np 2
each stage trains fresh and those checkpoints resume; at np 1 the ZeRO 3 one resumes unsplit.
Each test reads its cases' reports and fails on its own assertion. fp32 within 1e-5 (relative, each
parameter and optimizer slot); the MLP trains with AdamW, the generated GPT (tied head) with SGD
and momentum: Adam divides by the square root of its second moment, which makes the noise of
gradients that are zero in exact arithmetic (a key bias's under softmax) as large as any update.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

from helpers import run_horovod
from hvd_runtime.config import ConfigError, HorovodConfig, load_config
from hvd_runtime.torch.zero import row_range

SCRIPT = Path(__file__).parent / "scripts" / "zero_step.py"
TOL = 1e-5

FRESH = {   # case name -> flags; each runs at np 4 and at np 2
    "zero1-mlp-adamw": {"zero": 1},
    "zero2-mlp-adamw": {"zero": 2},
    "zero3-mlp-adamw": {"zero": 3},
    "zero3-mlp-sgd": {"zero": 3, "optim": "sgd"},
    "zero2-mlp-clip-bpps2": {"zero": 2, "bpps": 2, "clip": 0.05},
    "zero3-mlp-clip-bpps2-recompute": {"zero": 3, "bpps": 2, "clip": 0.05, "recompute": True},
    "zero1-gpt": {"zero": 1, "model": "gpt", "optim": "sgd", "clip": 0.5},
    "zero2-gpt-bpps2": {"zero": 2, "model": "gpt", "optim": "sgd", "bpps": 2},
    "zero3-gpt": {"zero": 3, "model": "gpt", "optim": "sgd", "clip": 0.5},
    "zero3-gpt-recompute": {"zero": 3, "model": "gpt", "optim": "sgd", "recompute": True},
}
BF16 = {"zero3-gpt-bf16": {"zero": 3, "model": "gpt", "optim": "sgd", "precision": "bf16"}}
SAVED = {"zero3": "zero3-gpt", "zero2": "zero2-gpt-bpps2"}   # checkpoint -> the np 4 case that wrote it
RESUMES = {  # (np, case name) -> flags: the saved checkpoint resumed in another layout
    (2, "zero3-at-zero3-dp2"): {"zero": 3, "model": "gpt", "optim": "sgd", "clip": 0.5, "from": "zero3"},
    (2, "zero2-at-zero1-dp2"): {"zero": 1, "model": "gpt", "optim": "sgd", "bpps": 2, "from": "zero2"},
    (1, "zero3-unsplit"): {"zero": 0, "model": "gpt", "optim": "sgd", "clip": 0.5, "from": "zero3"},
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory, workload_projects) -> dict[tuple[int, str], list[dict]]:
    """Every case's per-rank reports, by (np, case name), from the three jobs."""
    root = tmp_path_factory.mktemp("zero")
    project = str(workload_projects["gpt"])
    out = {}

    def case(np_, name, flags):
        flags = {**flags, "project": project, "out": str(root / f"{np_}-{name}.json")}
        out[(np_, name)] = Path(flags["out"])
        return flags

    def job(np_, cases):
        listed = root / f"cases-{np_}.json"
        listed.write_text(json.dumps(cases))
        run_horovod(np_, [sys.executable, str(SCRIPT), "--cases", str(listed)], timeout=300)

    saves = {case_name: str(root / f"ckpt-{ckpt}") for ckpt, case_name in SAVED.items()}
    job(4, [case(4, name, {**flags, **({"save": saves[name]} if name in saves else {})})
            for name, flags in {**FRESH, **BF16}.items()])
    for np_ in (2, 1):
        resumes = [case(np_, name, {**{k: v for k, v in flags.items() if k != "from"}, "saved_np": 4,
                                    "resume": saves[SAVED[flags["from"]]]})
                   for (n, name), flags in RESUMES.items() if n == np_]
        job(np_, resumes + ([case(2, name, flags) for name, flags in FRESH.items()] if np_ == 2 else []))
    return {key: json.loads(path.read_text()) for key, path in out.items()}


def worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("np_", [4, 2])
@pytest.mark.parametrize("name", list(FRESH))
def test_zero_steps_match_the_unsplit_model(reports, name, np_):
    """Two updates (parameters and optimizer slots), then a third (parameters), equal the unsplit
    model's within 1e-5 on every rank; each rank holds about 1/np of the optimizer state and, under
    ZeRO 3, of the parameters; under ZeRO 2 no whole gradient outlives a backward pass. The
    validation loss over batches dealt unevenly (rank 0 one more) equals the reference's."""
    ranks = reports[(np_, name)]
    assert sorted(r["rank"] for r in ranks) == list(range(np_))
    for r in ranks:
        for what in ("errors", "after_one_more"):
            key, err = worst(r[what])
            assert err < TOL, f"rank {r['rank']} ({what}): {key} off by {err:.2e}"
        assert abs(r["optimizer_share"] - 1 / np_) < 0.1, r["optimizer_share"]
        assert r["parameter_share"] == (pytest.approx(r["optimizer_share"]) if r["zero"] == 3 else 1.0)
        assert not r["whole_grads_kept"]
        assert r["eval_error"] < TOL, f"rank {r['rank']}: validation loss off by {r['eval_error']:.2e}"
    assert sum(r["optimizer_share"] for r in ranks) >= 1.0   # every row is someone's (whole tensors: everyone's)


def test_zero3_under_bf16_follows_the_unsplit_model(reports):
    """bf16 autocast rounds each rank's batch apart from the whole batch's: near, not equal."""
    for r in reports[(4, "zero3-gpt-bf16")]:
        key, err = worst(r["after_one_more"])
        assert err < 3e-2, f"rank {r['rank']}: {key} off by {err:.2e}"


@pytest.mark.parametrize("np_, name", list(RESUMES), ids=[name for _, name in RESUMES])
def test_a_zero_checkpoint_resumes_in_another_layout(reports, np_, name):
    """A checkpoint written at dp 4 restores every parameter and optimizer slot the unsplit run
    holds at that step, at dp 2, another ZeRO stage, or in one unsplit process, and the next
    update still equals the unsplit model's."""
    for r in reports[(np_, name)]:
        assert r["restored_step"] == (2 if "zero3" in name.split("-at-")[0] else 4)
        assert any("/" in key for key in r["restored"]), "no optimizer slot was compared"
        for what in ("restored", "after_one_more"):
            key, err = worst(r[what])
            assert err < TOL, f"rank {r['rank']} ({what}): {key} off by {err:.2e}"


@pytest.mark.parametrize("rows, size", [(7, 3), (10, 4), (4, 4), (1000, 8)])
def test_rows_are_dealt_as_horovods_reduce_scatter_deals_them(rows, size):
    parts = torch.arange(rows).tensor_split(size)
    assert [row_range(rows, r, size) for r in range(size)] == [(int(p[0]), int(p[-1]) + 1) for p in parts]


def test_a_zero_stage_that_does_not_exist_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^horovod.zero is 4: choose one of 0, 1, 2, 3$"):
        load_config(overrides=["--horovod.zero", "4"])
    assert HorovodConfig().zero == 0
