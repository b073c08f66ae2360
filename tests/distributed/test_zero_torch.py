"""ZeRO 1, 2 and 3 on Horovod (hvd_runtime.torch.zero), PyTorch: steps against the whole model,
and checkpoints that resume at another dp, another stage and unsplit.

Four real `horovodrun --gloo` jobs serve every check (tests/distributed/scripts/zero_step.py,
several cases a job): at np 4 each stage trains fresh and two of them save a checkpoint; at tp 2 x
dp 2 (np 4) the GPT split by tensor parallelism trains under each stage, one saves, and the dp 4
ZeRO 3 checkpoint resumes; at np 2 each stage trains fresh and the dp 4 checkpoints resume; at
np 1 both ZeRO 3 checkpoints resume unsplit.
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
from hvd_runtime.zero_rows import row_range

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
    "zero2-gpt-bpps2-many-buckets": {"zero": 2, "model": "gpt", "optim": "sgd", "bpps": 2, "bucket_bytes": 2048},
    "zero3-gpt": {"zero": 3, "model": "gpt", "optim": "sgd", "clip": 0.5},
    "zero3-gpt-recompute": {"zero": 3, "model": "gpt", "optim": "sgd", "recompute": True},
}
BF16 = {"zero3-gpt-bf16": {"zero": 3, "model": "gpt", "optim": "sgd", "precision": "bf16"}}
TP = {   # the GPT split over tp 2 x dp 2: ZeRO cuts each slice where tensor parallelism cut it
    "zero1-gpt-tp2": {"zero": 1, "model": "gpt", "optim": "sgd", "clip": 0.5},
    "zero2-gpt-tp2-bpps2": {"zero": 2, "model": "gpt", "optim": "sgd", "bpps": 2},
    "zero3-gpt-tp2": {"zero": 3, "model": "gpt", "optim": "sgd", "clip": 0.5},
}
PATHS = {"reducescatter-paths": {"check": "reducescatter"}}   # ZeRO's two reduce-scatters, side by side
SAVED = {"zero3": "zero3-gpt", "zero2": "zero2-gpt-bpps2", "zero3-tp2": "zero3-gpt-tp2"}   # checkpoint -> its np 4 case
RESUMES = {  # (np, tp, case name) -> flags: a saved checkpoint resumed in another layout
    (2, 0, "zero3-at-zero3-dp2"): {"zero": 3, "model": "gpt", "optim": "sgd", "clip": 0.5, "from": "zero3"},
    (2, 0, "zero2-at-zero1-dp2"): {"zero": 1, "model": "gpt", "optim": "sgd", "bpps": 2, "from": "zero2"},
    (1, 0, "zero3-unsplit"): {"zero": 0, "model": "gpt", "optim": "sgd", "clip": 0.5, "from": "zero3"},
    (4, 2, "zero3-at-zero3-tp2-dp2"): {"zero": 3, "model": "gpt", "optim": "sgd", "clip": 0.5, "from": "zero3"},
    (1, 0, "zero3-tp2-unsplit"): {"zero": 0, "model": "gpt", "optim": "sgd", "clip": 0.5, "from": "zero3-tp2"},
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory, workload_projects) -> dict[tuple[int, int, str], list[dict]]:
    """Every case's per-rank reports, by (np, tp, case name), from the four jobs."""
    root = tmp_path_factory.mktemp("zero")
    project = str(workload_projects["gpt"])
    out = {}
    saves = {case_name: str(root / f"ckpt-{ckpt}") for ckpt, case_name in SAVED.items()}

    def case(np_, tp, name, flags):
        flags = {**flags, "project": project, "out": str(root / f"{np_}-{tp}-{name}.json"),
                 **({"save": saves[name]} if name in saves and np_ == 4 else {})}
        out[(np_, tp, name)] = Path(flags["out"])
        return flags

    def resumes(np_, tp):
        return [case(np_, tp, name, {**{k: v for k, v in flags.items() if k != "from"},
                                     "saved_np": 4 // (2 if "tp2" in flags["from"] else 1),
                                     "resume": saves[SAVED[flags["from"]]]})
                for (n, t, name), flags in RESUMES.items() if (n, t) == (np_, tp)]

    def job(np_, tp, cases):
        listed = root / f"cases-{np_}-{tp}.json"
        listed.write_text(json.dumps(cases))
        run_horovod(np_, [sys.executable, str(SCRIPT), "--cases", str(listed), *(["--tp", str(tp)] if tp else [])],
                    timeout=300)

    # in order: the checkpoints the later jobs resume are written by the earlier ones
    job(4, 0, [case(4, 0, name, flags) for name, flags in {**FRESH, **BF16, **PATHS}.items()])
    job(4, 2, resumes(4, 2) + [case(4, 2, name, flags) for name, flags in TP.items()])
    job(2, 0, resumes(2, 0) + [case(2, 0, name, flags) for name, flags in FRESH.items()])
    job(1, 0, resumes(1, 0))
    return {key: json.loads(path.read_text()) for key, path in out.items()}


def worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("np_, tp, name", [(np_, 0, name) for np_ in (4, 2) for name in FRESH]
                         + [(4, 2, name) for name in TP])
def test_zero_steps_match_the_unsplit_model(reports, np_, tp, name):
    """Two updates (parameters and optimizer slots), then a third (parameters), equal the unsplit
    model's within 1e-5 on every rank; each rank holds about 1/np of the optimizer state and, under
    ZeRO 3, of the parameters (tp 2 x dp 2: a quarter, its rows of its slices); under ZeRO 2 no
    whole gradient outlives a backward pass, and each bucket is reduce-scattered once a pass; under
    ZeRO 3 the largest block gathered whole is the one the memory plan counts. The
    validation loss over batches dealt unevenly (rank 0's replica one more) equals the reference's."""
    ranks = reports[(np_, tp, name)]
    assert sorted(r["rank"] for r in ranks) == list(range(np_))
    for r in ranks:
        for what in ("errors", "after_one_more"):
            key, err = worst(r[what])
            assert err < TOL, f"rank {r['rank']} ({what}): {key} off by {err:.2e}"
        assert abs(r["optimizer_share"] - 1 / np_) < 0.1, r["optimizer_share"]
        # tp 2: a slice of each split tensor, the others whole
        assert r["parameter_share"] == (pytest.approx(r["optimizer_share"]) if r["zero"] == 3 else
                                        1.0 if not tp else pytest.approx(1 / tp, abs=0.05))
        assert not r["whole_grads_kept"]
        if r["zero"] == 2:   # every parameter has a gradient each pass: no bucket is sent twice
            assert r["bucket_sends"] == r["buckets"] * FRESH.get(name, TP.get(name, {})).get("bpps", 1), r
        if r["zero"] == 3 and "largest_block" in r:   # the memory plan's block: the largest one gathered
            assert r["largest_block"]["gathered"] == r["largest_block"]["planned"] > 0, r["largest_block"]
        if "many-buckets" in name:   # launched one after another while backward goes on
            assert r["buckets"] > 3, r["buckets"]
        assert r["eval_error"] < TOL, f"rank {r['rank']}: validation loss off by {r['eval_error']:.2e}"
    assert sum(r["optimizer_share"] for r in ranks) >= 1.0   # every row is someone's (whole tensors: everyone's)


def test_the_alltoall_reduce_scatter_equals_horovods(reports):
    """On CPU ZeRO reduce-scatters by one all-to-all; on GPUs by Horovod's grouped reduce-scatter.
    Both hand each of 4 ranks the same rows (uneven, along dim 0 and 1) of the same average."""
    ranks = reports[(4, 0, "reducescatter-paths")]
    assert [r["shapes"] for r in sorted(ranks, key=lambda r: r["rank"])] == [
        [[2, 5], [6, 3], [3]], [[2, 5], [6, 2], [3]], [[2, 5], [6, 2], [2]], [[1, 5], [6, 2], [2]]]
    for r in ranks:
        assert r["max_diff"] < 1e-6, r


def test_zero3_under_bf16_follows_the_unsplit_model(reports):
    """bf16 autocast rounds each rank's batch apart from the whole batch's: near, not equal."""
    for r in reports[(4, 0, "zero3-gpt-bf16")]:
        key, err = worst(r["after_one_more"])
        assert err < 3e-2, f"rank {r['rank']}: {key} off by {err:.2e}"


@pytest.mark.parametrize("np_, tp, name", list(RESUMES), ids=[name for _, _, name in RESUMES])
def test_a_zero_checkpoint_resumes_in_another_layout(reports, np_, tp, name):
    """A checkpoint written at dp 4 (or tp 2 x dp 2) restores every parameter and optimizer slot
    the unsplit run holds at that step, at dp 2, another ZeRO stage, tp 2 x dp 2, or in one unsplit
    process, and the next update still equals the whole model's."""
    for r in reports[(np_, tp, name)]:
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
