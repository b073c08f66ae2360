"""The rule for checkpoint writes that fail (hvd_runtime.write_failures): how many in a row the run
goes on past, that a written one resets the count, that the run's last one is never gone past,
and that only the process told to speak prints. The runs that meet a full disk are in
tests/projects/test_run_faults.py."""

import pytest

from hvd_runtime.write_failures import CheckpointsFailing, WriteFailures


def test_the_run_goes_on_past_max_failures_in_a_row_and_stops_at_the_next(capsys):
    failures = WriteFailures(max_failures=2)
    failures.failed("checkpoint 10 was not written", 10, last=False, directory="ck", say=True)
    failures.failed("checkpoint 20 was not written", 20, last=False, directory="ck", say=True)
    with pytest.raises(CheckpointsFailing) as stopped:
        failures.failed("checkpoint 30 was not written", 30, last=False, directory="ck", say=True)
    assert stopped.value.code == 1 and stopped.value.run_status == "FAILED" and stopped.value.step == 30
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("; ", 1)[1] for line in lines[:2]] == [
        "training goes on and tries again at the next checkpoint (1 failed in a row; checkpoint.max_failures 2)",
        "training goes on and tries again at the next checkpoint (2 failed in a row; checkpoint.max_failures 2)"]
    assert len(lines) == 3 and "3 in a row, more than checkpoint.max_failures 2: stopping at step 30" in lines[2]


def test_a_written_checkpoint_starts_the_count_again():
    failures = WriteFailures(max_failures=1)
    for step in (10, 30, 50):
        failures.failed(f"checkpoint {step} was not written", step, last=False, directory="ck", say=False)
        failures.written()
    assert failures.in_a_row == 0


def test_the_last_checkpoint_failing_stops_the_run_whatever_the_count(capsys):
    failures = WriteFailures(max_failures=5)
    with pytest.raises(CheckpointsFailing):
        failures.failed("checkpoint 69 was not written", 69, last=True, directory="ck", say=False)
    assert capsys.readouterr().err == ""    # not rank 0: silent
