"""Horovod's own Keras 3 API in the wheel hvdgen builds, under a real `horovodrun -np 2 --gloo`.

hvdgen patches Horovod's Keras layer (hvdgen/build/patches.py); each check here fails on an
unpatched Horovod 0.28.1 and compares the ranks' work with one process on the global batch.
"""

from pathlib import Path

import pytest

from helpers import REPO, run_horovod, unpatched_files
from hvdgen.build.patches import IDENTITY_KEY_PATCHES, KERAS_3_API_PATCHES, KERAS_3_PATCHES

pytest.importorskip("tensorflow", reason="TensorFlow is not installed: Horovod's Keras layer is not tested here")
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).resolve().parent / "scripts" / "horovod_keras3_checks.py"
CHECKS = {
    "fit_averages_gradients", "metric_average_callback_averages_loss", "fit_with_variable_groups",
    "keras_gradient_accumulation_with_distributed_optimizer", "backward_passes_per_step_refused_clearly",
    "custom_loop_apply_gradients_averages", "partial_tape_keeps_local_source", "partial_optimizer_keeps_local_layer",
    "broadcast_variables_keras3", "broadcast_callback_skips_local_variables", "sync_batchnorm_matches_global_batch",
    "broadcast_callback_with_a_plain_optimizer", "elastic_keras_state_with_a_plain_optimizer",
    "lr_warmup_callback_on_keras3", "lr_schedule_callback_on_keras3",
    "partial_optimizer_compute_gradients_in_a_custom_loop", "load_model_wraps_the_saved_optimizer",
    "horovod_keras_callbacks_on_keras3",
}


def test_installed_horovod_carries_every_keras3_patch():
    """The checks below test the installed wheel: one built before these patches would fail them
    for a reason this names plainly."""
    stale = unpatched_files(IDENTITY_KEY_PATCHES + KERAS_3_PATCHES + KERAS_3_API_PATCHES)
    assert not stale, f"the installed horovod lacks hvdgen's patches to {stale}: run `hvdgen install-horovod --force`"


@pytest.mark.timeout(420)
def test_horovod_keras3_api_matches_a_single_process():
    proc = run_horovod(2, ["python", str(SCRIPT)], cwd=REPO, timeout=400, check=False)
    passed = {line.split("OK ", 1)[1].split(" (")[0] for line in proc.stdout.splitlines() if "]<stdout>:OK " in line}
    assert passed == CHECKS and proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
