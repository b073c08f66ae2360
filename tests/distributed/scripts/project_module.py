"""A generated project's module (its model.py), imported under a name of its own.

One step-script process may run several cases (`--cases`), each loading another project's
model.py; a plain `from model import build_model` would hand every case the first one back.
"""

import importlib.util
import sys
from pathlib import Path


def project_module(project: str, name: str):
    """`project`/`name`.py as a module, loaded once per file."""
    path = Path(project).resolve() / f"{name}.py"
    unique = f"{name}_of_{abs(hash(str(path)))}"
    if unique not in sys.modules:
        spec = importlib.util.spec_from_file_location(unique, path)
        sys.modules[unique] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[unique]
