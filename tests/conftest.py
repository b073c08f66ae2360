import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(autouse=True)
def no_inherited_tracking_uri(monkeypatch):
    """mlflow.set_tracking_uri() also exports MLFLOW_TRACKING_URI; an in-process tracking test
    would otherwise point every later horovodrun job at its (by then dead) store."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
