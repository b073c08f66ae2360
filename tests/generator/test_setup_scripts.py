"""The set-up scripts install the framework releases generated projects pin, so the demo and the
suite run what users get."""

import os
import re
import subprocess
from pathlib import Path

from hvdgen.catalog import FRAMEWORK_PINS

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"


def test_setup_installs_the_pinned_framework_versions():
    text = SETUP.read_text()
    defaults = dict(re.findall(r'^(TORCH_SPEC|TF_SPEC)="\$\{\1:-([^}]+)\}"', text, re.M))
    assert defaults == {"TORCH_SPEC": FRAMEWORK_PINS["torch"], "TF_SPEC": FRAMEWORK_PINS["tensorflow"]}


def test_an_interpreter_that_does_not_run_is_named_in_one_line_before_any_venv(tmp_path):
    venv = tmp_path / "venv"
    proc = subprocess.run(["bash", str(SETUP)], capture_output=True, text=True, timeout=60,
                          env=dict(os.environ, PYTHON="python3.99", HVDGEN_VENV=str(venv)))
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("PYTHON=python3.99 does not run here") and "set PYTHON to an interpreter" in lines[0]
    assert not venv.exists()
