"""hvd_runtime.torch under a real `horovodrun -np 2`: every data-parallel piece checked numerically."""

from pathlib import Path

import pytest

from helpers import REPO, run_horovod

SCRIPT = Path(__file__).resolve().parent / "scripts" / "torch_dp_checks.py"
CHECKS = ["allreduce_step_matches_global_batch", "backward_passes_per_step_accumulates", "fp16_compression_close",
          "sync_batchnorm_uses_global_statistics",
          "sync_batchnorm_gradients_match", "sync_batchnorm_running_stats_match", "metric_average_weights_by_count",
          "broadcast_makes_ranks_identical", "lr_warms_up_to_world_size_times_lr",
          "a_checkpoint_from_before_shards_resumes", "a_nonfinite_update_is_skipped_on_every_rank_alike",
          "a_nonfinite_update_stops_every_rank_before_it", "a_shard_not_written_fails_the_checkpoint_on_every_rank",
          "a_folder_the_ranks_cannot_see_stops_every_rank_at_once", "recomputed_blocks_match_kept_activations"]


@pytest.mark.slow
def test_data_parallel_pieces_match_a_single_process():
    proc = run_horovod(2, ["python", str(SCRIPT)], cwd=REPO, timeout=180)
    passed = {line.split("OK ", 1)[1].split(" (")[0] for line in proc.stdout.splitlines() if "]<stdout>:OK " in line}
    assert passed == set(CHECKS), proc.stdout[-4000:]
