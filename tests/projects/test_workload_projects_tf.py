"""Generated ResNet-18 and GPT TensorFlow projects: the checks of test_workload_projects.py, on Keras.

A file of its own so that the suite's workers (one file each) run the two frameworks side by side.
Images are read by tf.data's parallel map; bf16 is Keras' mixed_bfloat16 policy.

Cost: over 6% of the suite's CPU (docs/testing.md): 9 cases of two 2-rank jobs each (straight and
resumed), Keras tracing each rank's steps anew.
"""

import pytest

from test_workload_projects import BF16_CASES, CASES, learns_from_disk_and_resumes_exactly, trains_in_bf16

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("model,strategy", CASES, ids=["-".join(c) for c in CASES])
def test_generated_keras_workload_learns_from_disk_and_resumes_exactly(tmp_path, model, strategy):
    learns_from_disk_and_resumes_exactly(tmp_path, "tensorflow", model, strategy)


@pytest.mark.parametrize("model,strategy", BF16_CASES, ids=["-".join(c) for c in BF16_CASES])
def test_generated_keras_workload_trains_in_bf16_on_the_cpu(tmp_path, model, strategy):
    trains_in_bf16(tmp_path, "tensorflow", model, strategy)


def test_a_keras_zero_gpt_resumes_exactly_mid_epoch(tmp_path):
    """horovod.zero 2 in Keras: each rank writes and reads its rows of the optimizer state, and the
    resumed run ends on the same metrics and weights, the same on every rank."""
    learns_from_disk_and_resumes_exactly(tmp_path, "tensorflow", "gpt", "data", "--horovod.zero", "2")
