"""`hvdgen doctor` on the fit between the torch build (CPU or CUDA) and Horovod's tensor ops.

The real doctor runs in test_horovod_build.py (this CPU venv) and test_cuda_build.py (a CUDA torch
venv); here are the combinations neither venv has, on what `horovodrun --check-build` reports.
"""

from hvdgen.build.checks import build_mismatches, parse_check_build

CHECK_BUILD_NCCL = """\
Horovod v0.28.1:

Available Frameworks:
    [ ] TensorFlow
    [X] PyTorch
    [ ] MXNet

Available Controllers:
    [ ] MPI
    [X] Gloo

Available Tensor Operations:
    [X] NCCL
    [ ] DDL
    [ ] CCL
    [ ] MPI
    [X] Gloo
"""
CHECK_BUILD_CPU = CHECK_BUILD_NCCL.replace("[X] NCCL", "[ ] NCCL")


def _ops(text: str) -> dict[str, bool]:
    return parse_check_build(text)["Tensor Operations"]


def test_matching_builds_give_no_warning():
    assert build_mismatches("13.0", _ops(CHECK_BUILD_NCCL)) == []
    assert build_mismatches(None, _ops(CHECK_BUILD_CPU)) == []


def test_cuda_torch_with_a_horovod_without_nccl_is_warned_about():
    [warning] = build_mismatches("13.0", _ops(CHECK_BUILD_CPU))
    assert "torch is a CUDA 13.0 build but horovod has no NCCL ops" in warning
    assert warning.endswith("hvdgen install-horovod builds (or reinstalls) one with NCCL")


def test_nccl_horovod_with_a_cpu_torch_is_warned_about():
    [warning] = build_mismatches(None, _ops(CHECK_BUILD_NCCL))
    assert "horovod has NCCL ops but torch is a CPU build" in warning
    assert warning.endswith("hvdgen install-horovod builds one for this torch")


def test_beside_tensorflow_the_warning_does_not_promise_an_nccl_rebuild():
    [warning] = build_mismatches("13.0", _ops(CHECK_BUILD_CPU), tensorflow="2.21.0")
    assert warning.endswith("NCCL ops need a venv without TensorFlow (see gpu build above)")
