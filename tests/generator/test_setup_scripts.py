"""The set-up scripts install the framework releases generated projects pin, so the demo and the
suite run what users get."""

import re
from pathlib import Path

from hvdgen.catalog import FRAMEWORK_PINS

SETUP = Path(__file__).resolve().parents[2] / "scripts" / "setup.sh"


def test_setup_installs_the_pinned_framework_versions():
    text = SETUP.read_text()
    defaults = dict(re.findall(r'^(TORCH_SPEC|TF_SPEC)="\$\{\1:-([^}]+)\}"', text, re.M))
    assert defaults == {"TORCH_SPEC": FRAMEWORK_PINS["torch"], "TF_SPEC": FRAMEWORK_PINS["tensorflow"]}
