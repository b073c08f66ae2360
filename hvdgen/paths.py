"""Where hvdgen finds its templates and keeps its cache."""

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def templates_dir() -> Path:
    """Templates ship inside the wheel as hvdgen/_templates; a source checkout keeps them at the top."""
    packaged = _PACKAGE_DIR / "_templates"
    return packaged if packaged.is_dir() else _PACKAGE_DIR.parent / "templates"


def cache_dir() -> Path:
    """The user's cache dir (XDG), overridable with HVDGEN_CACHE_DIR."""
    explicit = os.environ.get("HVDGEN_CACHE_DIR")
    if explicit:  # absolute: pip records a wheel in it by file:// URL, which a relative path has none of
        return Path(os.path.abspath(os.path.expanduser(explicit)))
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(os.path.abspath(os.path.expanduser(base))) / "hvdgen"
