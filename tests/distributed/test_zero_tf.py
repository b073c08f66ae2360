"""ZeRO 1 and 2 for Keras (hvd_runtime.tf.zero): steps against the whole model, checkpoints that
resume at another dp, another stage and unsplit.

Three real `horovodrun --gloo` jobs serve every check (tests/distributed/scripts/tf_zero_step.py,
several cases a job): at np 4 each case trains fresh and one saves a checkpoint; at np 2 each
trains fresh and the checkpoint resumes under ZeRO 1; at np 1 it resumes unsplit (rank 0 reading
every replica's rows). Each test reads its cases' reports and fails on its own assertion; fp32,
within 1e-5 (relative, each variable and optimizer slot).
"""

import json
import sys
from pathlib import Path

import pytest

from helpers import run_horovod

pytest.importorskip("tensorflow", reason="TensorFlow is not installed: the TF runtime is not tested here")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).parent / "scripts" / "tf_zero_step.py"
TOL = 1e-5

FRESH = {   # case name -> flags; each runs at np 4 and at np 2
    "zero1-sgd": {"zero": 1},
    "zero1-adam-clip": {"zero": 1, "optim": "adam", "clip": 0.05},
    "zero2-sgd-bpps2": {"zero": 2, "bpps": 2},
    "zero2-adam-clip-bpps2": {"zero": 2, "optim": "adam", "clip": 0.05, "bpps": 2},
    "zero2-sgd-bpps2-horovods-reducescatter": {"zero": 2, "bpps": 2, "native": True},   # GPUs' path
}
SAVED = "zero2-adam-clip-bpps2"   # the np 4 case whose checkpoint the others resume
RESUMES = {  # (np, case name) -> flags
    (2, "zero2-at-zero1-dp2"): {"zero": 1, "optim": "adam", "clip": 0.05, "bpps": 2},
    (1, "zero2-unsplit"): {"zero": 0, "optim": "adam", "clip": 0.05, "bpps": 2},
}


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> dict[tuple[int, str], list[dict]]:
    """Every case's per-rank reports, by (np, case name), from the three jobs."""
    root = tmp_path_factory.mktemp("tf_zero")
    saved = str(root / "ckpt")
    out = {}

    def case(np_, name, flags):
        flags = {**flags, "out": str(root / f"{np_}-{name}.json")}
        out[(np_, name)] = Path(flags["out"])
        return flags

    def job(np_, cases):
        listed = root / f"cases-{np_}.json"
        listed.write_text(json.dumps(cases))
        run_horovod(np_, [sys.executable, str(SCRIPT), "--cases", str(listed)], timeout=300)

    job(4, [case(4, name, {**flags, **({"save": saved} if name == SAVED else {})}) for name, flags in FRESH.items()])
    for np_ in (2, 1):
        resumes = [case(np_, name, {**flags, "resume": saved, "saved_np": 4})
                   for (n, name), flags in RESUMES.items() if n == np_]
        job(np_, resumes + ([case(2, name, flags) for name, flags in FRESH.items()] if np_ == 2 else []))
    return {key: json.loads(path.read_text()) for key, path in out.items()}


def worst(errors: dict[str, float]) -> tuple[str, float]:
    return max(errors.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("np_", [4, 2])
@pytest.mark.parametrize("name", list(FRESH))
def test_keras_zero_steps_match_the_unsplit_model(reports, name, np_):
    """Two updates, then a third, equal the whole model's within 1e-5 on every rank: variables
    and optimizer slots (each rank's rows of them); each rank holds about 1/np of the slots."""
    ranks = reports[(np_, name)]
    assert sorted(r["rank"] for r in ranks) == list(range(np_))
    for r in ranks:
        assert any("/" in key for key in r["errors"]), "no optimizer slot was compared"
        for what in ("errors", "after_one_more"):
            key, err = worst(r[what])
            assert err < TOL, f"rank {r['rank']} ({what}): {key} off by {err:.2e}"
        assert abs(r["optimizer_share"] - 1 / np_) < 0.1, r["optimizer_share"]
    assert sum(r["optimizer_share"] for r in ranks) >= 1.0   # every row is someone's (whole tensors: everyone's)


@pytest.mark.parametrize("np_, name", list(RESUMES), ids=[name for _, name in RESUMES])
def test_a_keras_zero_checkpoint_resumes_in_another_layout(reports, np_, name):
    """A ZeRO 2 checkpoint written at dp 4 restores every variable and optimizer slot the unsplit
    run holds at that step, under ZeRO 1 at dp 2 or in one unsplit process, and the next update
    still equals the whole model's."""
    for r in reports[(np_, name)]:
        assert r["restored_step"] == 4
        assert any("/" in key for key in r["restored"]), "no optimizer slot was compared"
        for what in ("restored", "after_one_more"):
            key, err = worst(r[what])
            assert err < TOL, f"rank {r['rank']} ({what}): {key} off by {err:.2e}"
