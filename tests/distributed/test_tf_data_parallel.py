"""hvd_runtime.tf and the TF build of Horovod under a real `horovodrun -np 2 --gloo`.

Every data-parallel piece is checked numerically against one process on the global batch.
"""

from pathlib import Path

import pytest

from helpers import REPO, run_horovod

pytest.importorskip("tensorflow", reason="TensorFlow is not installed: the TF runtime is not tested here")
pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).resolve().parent / "scripts"
RUNTIME_CHECKS = {
    "steps_match_global_batch_reference", "ranks_identical_after_training", "backward_passes_per_step_accumulates",
    "fp16_compression_close", "sync_batchnorm_uses_global_statistics", "sync_batchnorm_step_matches_global_batch",
    "sync_batchnorm_moving_stats_match", "local_variables_not_allreduced", "local_variables_differ_shared_identical",
    "model_parallel_shards_match_full_layer", "metric_average_weights_by_count", "broadcast_makes_ranks_identical",
    "lr_warms_up_to_world_size_times_lr", "adasum_on_gloo_refused_clearly", "mid_epoch_resume_matches_uninterrupted",
    "fit_matches_global_batch_reference", "a_nonfinite_update_is_skipped_on_every_rank_alike",
    "a_nonfinite_update_stops_every_rank_before_it", "recomputed_blocks_match_kept_activations",
}
BUILD_CHECKS = {
    "collectives_float32", "collectives_float16", "collectives_int32", "allreduce_average_float32", "process_sets",
    "grouped_allreduce", "distributed_gradient_tape_keras3", "broadcast_object",
}


def passed_checks(stdout: str) -> set[str]:
    return {line.split("OK ", 1)[1].split(" (")[0] for line in stdout.splitlines() if "]<stdout>:OK " in line}


@pytest.mark.timeout(420)
def test_tf_runtime_matches_a_single_process():
    proc = run_horovod(2, ["python", str(SCRIPTS / "tf_dp_checks.py")], cwd=REPO, timeout=400)
    assert passed_checks(proc.stdout) == RUNTIME_CHECKS, proc.stdout[-4000:]


@pytest.mark.timeout(300)
def test_horovod_tf_build_collectives_and_tape():
    proc = run_horovod(2, ["python", str(SCRIPTS / "tf_build_checks.py")], cwd=REPO, timeout=280)
    assert passed_checks(proc.stdout) == BUILD_CHECKS, proc.stdout[-4000:]
