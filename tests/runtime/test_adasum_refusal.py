"""horovod.adasum is refused in one line exactly when the job has no Adasum op (no MPI controller).

The decision takes what Horovod reports (built with MPI, running on MPI), so every case is checked
here; tests/distributed/test_adasum.py runs the refusal under a real Gloo horovodrun, and
tests/projects/test_start_up_refusals.py the line a generated project prints.
"""

import pytest

from hvd_runtime.adasum import adasum_refusal, check_adasum
from hvd_runtime.config import ConfigError


@pytest.mark.parametrize("mpi_built, mpi_enabled", [(False, False), (True, False), (True, True)])
def test_no_adasum_asked_is_never_refused(mpi_built, mpi_enabled):
    assert adasum_refusal(False, mpi_built, mpi_enabled) is None


def test_adasum_on_the_mpi_controller_runs():
    assert adasum_refusal(True, mpi_built=True, mpi_enabled=True) is None


def test_a_horovod_without_mpi_is_told_how_to_get_one():
    line = adasum_refusal(True, mpi_built=False, mpi_enabled=False)
    assert "\n" not in line
    assert line.startswith("horovod.adasum needs Horovod's MPI controller, but this job runs on Gloo")
    assert "--horovod.adasum false" in line
    assert "`hvdgen install-horovod` with mpicxx on PATH" in line and "horovodrun --mpi" in line


def test_a_horovod_with_mpi_launched_on_gloo_is_told_to_launch_with_mpi():
    line = adasum_refusal(True, mpi_built=True, mpi_enabled=False)
    assert "--horovod.adasum false" in line and "launch with horovodrun --mpi" in line
    assert "install-horovod" not in line          # no rebuild needed: this Horovod has MPI


class Reports:
    """What a started horovod.torch / horovod.tensorflow answers about MPI."""

    def __init__(self, built: bool, enabled: bool):
        self.mpi_built = lambda: built
        self.mpi_enabled = lambda: enabled


def test_check_raises_the_config_error_train_py_prints_as_one_line():
    with pytest.raises(ConfigError, match="^horovod.adasum needs"):
        check_adasum(True, Reports(built=False, enabled=False))
    check_adasum(False, Reports(built=False, enabled=False))
    check_adasum(True, Reports(built=True, enabled=True))
