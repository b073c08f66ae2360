"""The cluster every multi-host test runs its job on (tests/helpers/cluster.py), torn down afterwards."""

from __future__ import annotations

import os

import pytest

from helpers.cluster import Cluster, why_unavailable


@pytest.fixture
def cluster(tmp_path):
    problem = why_unavailable()
    if problem:
        pytest.skip(f"Requires network namespaces and sshd: {problem}")
    made = Cluster(tmp_path / "cluster", tag=f"hvdt{os.getpid() % 10000}")
    try:
        yield made
    finally:
        made.down()
