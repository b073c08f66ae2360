"""GPU placement: each model-split rank's share of the host's GPUs, the CPU without any, one line when too few;
the GPU(s) every rank pins at start-up.

The decisions (hvd_runtime.devices, and the frameworks' rank_gpu / rank_gpus start-up rules that
ask it) take counts, so every case is checked here without a GPU; the framework halves are checked
for asking with their own GPU count and naming the devices.
"""

import importlib.util
import itertools
import os
import subprocess
import sys

import pytest

from hvd_runtime.config import ConfigError
from hvd_runtime.devices import TooFewGpus, stage_gpus


@pytest.mark.parametrize("stages, local_size", [(1, 1), (2, 1), (2, 2), (2, 4), (4, 2), (3, 3)])
def test_no_gpu_puts_every_stage_on_the_cpu(stages, local_size):
    assert all(stage_gpus(stages, k, local_size, 0) is None for k in range(local_size))


@pytest.mark.parametrize("stages, local_size, gpus", [(1, 1, 1), (2, 1, 2), (2, 2, 4), (2, 4, 8), (4, 2, 8),
                                                      (2, 2, 8), (3, 2, 7), (2, 1, 8)])
def test_each_rank_takes_its_own_consecutive_share(stages, local_size, gpus):
    shares = [stage_gpus(stages, k, local_size, gpus) for k in range(local_size)]
    assert shares == [list(range(k * stages, (k + 1) * stages)) for k in range(local_size)]
    used = list(itertools.chain(*shares))
    assert len(set(used)) == len(used) == stages * local_size and max(used) < gpus   # disjoint, all exist


def test_the_default_gpu_overlay_one_gpu_per_worker_two_stages_is_refused_in_one_line():
    with pytest.raises(TooFewGpus) as error:
        stage_gpus(2, 0, 1, 1)
    message = str(error.value)
    assert "\n" not in message
    assert "1 rank(s) on this host (-np / ranks per host) x 2 stages (parallel.stages) need 2 GPUs" in message
    assert "this host shows 1" in message
    assert "--parallel.stages 1" in message and "hosts with 2 GPUs" in message
    assert "rank(s) per host (" not in message        # not even one rank fits: fewer ranks is no way out


def test_np4_on_a_four_gpu_node_with_two_stages_names_every_way_out():
    for local_rank in range(4):       # every rank stops, not only the ones past the last GPU
        with pytest.raises(TooFewGpus) as error:
            stage_gpus(2, local_rank, 4, 4)
    message = str(error.value)
    assert "4 rank(s) on this host" in message and "need 8 GPUs" in message and "shows 4" in message
    assert "run at most 2 rank(s) per host" in message
    assert "--parallel.stages 1" in message and "hosts with 8 GPUs" in message


def test_too_few_gpus_is_a_config_error_so_train_py_prints_one_line():
    assert issubclass(TooFewGpus, ConfigError)


@pytest.mark.parametrize("args", [(0, 0, 1, 4), (2, 2, 2, 4), (2, -1, 2, 4)])
def test_impossible_arguments_are_programming_errors(args):
    with pytest.raises(ValueError) as error:
        stage_gpus(*args)
    assert not isinstance(error.value, ConfigError)


needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
needs_tf = pytest.mark.skipif(importlib.util.find_spec("tensorflow") is None, reason="TensorFlow is not installed")


@needs_torch
@pytest.mark.parametrize("gpus, expected", [(0, ["cpu", "cpu"]), (4, ["cuda:2", "cuda:3"]), (6, ["cuda:2", "cuda:3"])])
def test_torch_split_devices_asks_with_the_visible_gpu_count(monkeypatch, gpus, expected):
    import torch

    from hvd_runtime.torch.model_split import split_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert split_devices(2, local_rank=1, local_size=2) == [torch.device(d) for d in expected]


@needs_torch
def test_torch_split_devices_refuses_too_few_gpus(monkeypatch):
    import torch

    from hvd_runtime.torch.model_split import split_devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    with pytest.raises(TooFewGpus, match="need 4 GPUs, but this host shows 3"):
        split_devices(2, local_rank=0, local_size=2)


@needs_torch
@pytest.mark.parametrize("local_size, gpus", [(1, 1), (2, 2), (4, 8)])
def test_torch_data_and_pipeline_ranks_pin_the_gpu_of_their_local_rank(local_size, gpus):
    from hvd_runtime.torch.context import rank_gpu

    assert [rank_gpu(k, local_size, gpus) for k in range(local_size)] == list(range(local_size))
    assert rank_gpu(0, local_size, 0) is None


@needs_torch
@pytest.mark.parametrize("stages, local_size, gpus", [(2, 1, 2), (2, 2, 4), (2, 4, 8), (4, 2, 8), (3, 2, 7)])
def test_torch_model_split_ranks_pin_their_first_stage_gpu(stages, local_size, gpus):
    """Batches land where stage 0 is: never on the local-rank GPU that holds another rank's stage."""
    from hvd_runtime.torch.context import rank_gpu

    pinned = [rank_gpu(k, local_size, gpus, devices_per_rank=stages) for k in range(local_size)]
    assert pinned == [stage_gpus(stages, k, local_size, gpus)[0] for k in range(local_size)]
    assert pinned == [k * stages for k in range(local_size)]       # rank 1 of 2, 2 stages, 4 GPUs: cuda:2, not cuda:1


@needs_torch
@pytest.mark.parametrize("stages, local_size, gpus", [(2, 1, 1), (2, 2, 2), (2, 2, 3), (2, 4, 4)])
def test_torch_model_split_with_too_few_gpus_stops_before_pinning(stages, local_size, gpus):
    """More ranks than GPUs: the one-line TooFewGpus, not CUDA's invalid-device error from set_device."""
    from hvd_runtime.torch.context import rank_gpu

    for k in range(local_size):
        with pytest.raises(TooFewGpus, match=f"need {stages * local_size} GPUs, but this host shows {gpus}"):
            rank_gpu(k, local_size, gpus, devices_per_rank=stages)


@needs_torch
def test_torch_model_split_without_a_gpu_pins_nothing():
    from hvd_runtime.torch.context import rank_gpu

    assert [rank_gpu(k, 2, 0, devices_per_rank=2) for k in range(2)] == [None, None]


@needs_tf
@pytest.mark.parametrize("local_size, gpus, expected", [(2, 2, [[0], [1]]), (2, 4, [[0], [1]]), (3, 2, [[0], [1], [0]]),
                                                        (2, 0, [None, None])])
def test_tf_data_and_pipeline_ranks_see_the_gpu_of_their_local_rank(local_size, gpus, expected):
    from hvd_runtime.tf.context import rank_gpus

    assert [rank_gpus(k, local_size, gpus) for k in range(local_size)] == expected


@needs_tf
@pytest.mark.parametrize("stages, local_size, gpus", [(2, 1, 2), (2, 2, 4), (2, 4, 8), (4, 2, 8), (3, 2, 7), (2, 2, 0)])
def test_tf_model_split_ranks_see_exactly_their_stage_gpus(stages, local_size, gpus):
    from hvd_runtime.tf.context import rank_gpus

    assert [rank_gpus(k, local_size, gpus, devices_per_rank=stages) for k in range(local_size)] == \
        [stage_gpus(stages, k, local_size, gpus) for k in range(local_size)]


@needs_tf
@pytest.mark.parametrize("stages, local_size, gpus", [(2, 1, 1), (2, 2, 3), (2, 4, 4)])
def test_tf_model_split_with_too_few_gpus_stops_before_tensorflow_fixes_its_devices(stages, local_size, gpus):
    from hvd_runtime.tf.context import rank_gpus

    for k in range(local_size):
        with pytest.raises(TooFewGpus, match=f"need {stages * local_size} GPUs, but this host shows {gpus}"):
            rank_gpus(k, local_size, gpus, devices_per_rank=stages)


def fake_gpus(monkeypatch, tf, physical: int, visible: list[int]):
    devices = [tf.config.PhysicalDevice(f"/physical_device:GPU:{k}", "GPU") for k in range(physical)]
    real_list, real_visible = tf.config.list_physical_devices, tf.config.get_visible_devices
    monkeypatch.setattr(tf.config, "list_physical_devices",
                        lambda kind=None: devices if kind == "GPU" else real_list(kind))
    monkeypatch.setattr(tf.config, "get_visible_devices",
                        lambda kind=None: [devices[k] for k in visible] if kind == "GPU" else real_visible(kind))


@needs_tf
@pytest.mark.parametrize("visible, expected", [([2, 3], ["/GPU:0", "/GPU:1"]),        # init_horovod hid the rest
                                               ([0, 1, 2, 3], ["/GPU:2", "/GPU:3"])])  # nothing hidden
def test_tf_split_devices_names_this_ranks_gpus_as_tensorflow_sees_them(monkeypatch, visible, expected):
    import tensorflow as tf

    from hvd_runtime.tf.model_split import split_devices

    fake_gpus(monkeypatch, tf, 4, visible)
    assert split_devices(2, local_rank=1, local_size=2) == expected


@needs_tf
@pytest.mark.parametrize("local_rank", [0, 1])
def test_tf_start_up_shows_the_gpus_model_split_then_names(monkeypatch, local_rank):
    """What pin_devices leaves visible (rank_gpus) is what split_devices looks for, stage by stage."""
    import tensorflow as tf

    from hvd_runtime.tf.context import rank_gpus
    from hvd_runtime.tf.model_split import split_devices

    fake_gpus(monkeypatch, tf, 4, rank_gpus(local_rank, 2, 4, devices_per_rank=2))
    assert split_devices(2, local_rank=local_rank, local_size=2) == ["/GPU:0", "/GPU:1"]


@needs_tf
def test_tf_split_devices_refuses_too_few_gpus_even_after_they_were_hidden(monkeypatch):
    import tensorflow as tf

    from hvd_runtime.tf.model_split import split_devices

    fake_gpus(monkeypatch, tf, 1, [])     # GPUs hidden by hand: the host's count still decides
    with pytest.raises(TooFewGpus, match="need 2 GPUs, but this host shows 1"):
        split_devices(2, local_rank=0, local_size=1)


@needs_tf
def test_tf_split_devices_without_a_gpu_uses_logical_cpus_or_cpu0():
    import tensorflow as tf

    from hvd_runtime.tf.model_split import split_devices

    cpus = len(tf.config.list_logical_devices("CPU"))
    expected = [f"/CPU:{k}" for k in range(2)] if cpus >= 2 else ["/CPU:0"] * 2
    assert split_devices(2, local_rank=0, local_size=1) == expected


@needs_tf
def test_tf_split_devices_says_when_its_gpus_were_hidden_by_a_one_device_start(monkeypatch):
    import tensorflow as tf

    from hvd_runtime.tf.model_split import split_devices

    fake_gpus(monkeypatch, tf, 4, [1])    # init_horovod() without devices_per_rank pinned one GPU
    with pytest.raises(RuntimeError, match=r"init_horovod\(devices_per_rank=2\)"):
        split_devices(2, local_rank=1, local_size=2)


FAKE_ONE_GPU = '''"""TensorFlow reports one GPU (there is none here): what a worker of the 1-GPU overlay shows."""
import tensorflow as tf

_real = tf.config.list_physical_devices
tf.config.list_physical_devices = lambda kind=None: (
    [tf.config.PhysicalDevice("/physical_device:GPU:0", "GPU")] if kind == "GPU" else _real(kind))
'''


@needs_tf
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_project_on_too_few_gpus_stops_with_one_config_error_line_and_writes_nothing(tmp_path):
    """The whole path a user meets: generated train.py, init_horovod, ModelSplit, the config-error exit.

    Only the GPU count is made up (TensorFlow is told it has one GPU); the rest runs as shipped.
    """
    subprocess.run([sys.executable, "-m", "hvdgen", "new", "proj", "--framework", "tensorflow",
                    "--strategy", "model-split", "--output", str(tmp_path / "out")], check=True, capture_output=True)
    project = tmp_path / "out" / "proj"
    (tmp_path / "fake").mkdir()
    (tmp_path / "fake" / "sitecustomize.py").write_text(FAKE_ONE_GPU)
    before = sorted(p.relative_to(project) for p in project.rglob("*"))
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake"), "TF_CPP_MIN_LOG_LEVEL": "2"}
    proc = subprocess.run([sys.executable, "train.py"], cwd=project, env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if line.startswith("config error:")]
    assert "2 stages (parallel.stages) need 2 GPUs, but this host shows 1" in line
    assert "--parallel.stages 1" in line
    assert sorted(p.relative_to(project) for p in project.rglob("*")) == before    # nothing written
