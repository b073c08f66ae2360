"""The pre-build check for the headers TensorFlow includes but leaves off its include path.

These run the real compiler's preprocessor on small header trees made in tmp_path.
"""

from __future__ import annotations

import pytest

from hvdgen.errors import HvdgenError
from hvdgen.build.horovod_wheel import TF_HEADERS_FIX, BuildTarget, _compiler, build_environment, tensorflow_header_dirs

COMPILER = _compiler()
needs_compiler = pytest.mark.skipif(COMPILER is None, reason="Requires: a C++ compiler (c++ or g++)")
HEADERS = {"hvdgen_probe/arch.h": "external/probe", "hvdgen_probe_hash.h": "external/hash/src"}


def _write(path, text="#pragma once\n"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@needs_compiler
def test_tf_shipped_copies_are_added_to_the_include_path(tmp_path):
    tf_include = tmp_path / "include"
    _write(tf_include / "external/probe/hvdgen_probe/arch.h")
    _write(tf_include / "external/hash/src/hvdgen_probe_hash.h")
    dirs = tensorflow_header_dirs(tf_include, COMPILER, HEADERS)
    assert dirs == [tf_include / "external/probe", tf_include / "external/hash/src"]


@needs_compiler
def test_a_header_found_nowhere_stops_before_the_build_with_the_apt_line(tmp_path):
    tf_include = tmp_path / "include"
    _write(tf_include / "external/probe/hvdgen_probe/arch.h")
    with pytest.raises(HvdgenError) as info:
        tensorflow_header_dirs(tf_include, COMPILER, HEADERS)
    message = info.value.message
    assert "hvdgen_probe_hash.h" in message and "hvdgen_probe/arch.h" not in message
    assert message.endswith(TF_HEADERS_FIX)


@needs_compiler
def test_a_header_on_the_system_path_is_enough(tmp_path, monkeypatch):
    system = tmp_path / "usr-include"
    _write(system / "hvdgen_probe/arch.h")
    _write(system / "hvdgen_probe_hash.h")
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", str(system))
    assert tensorflow_header_dirs(tmp_path / "include", COMPILER, HEADERS) == []


def test_without_a_compiler_only_shipped_copies_are_listed(tmp_path):
    tf_include = tmp_path / "include"
    _write(tf_include / "external/hash/src/hvdgen_probe_hash.h")
    assert tensorflow_header_dirs(tf_include, None, HEADERS) == [tf_include / "external/hash/src"]


def test_extra_dirs_go_first_on_the_build_include_path(tmp_path, monkeypatch):
    monkeypatch.setenv("CPLUS_INCLUDE_PATH", "/opt/mine")
    target = BuildTarget(python="311", torch=None, tensorflow="2.21.0", mpi=False)
    env = build_environment(target, jobs=1, include_dirs=[tmp_path / "a", tmp_path / "b"])
    assert env["CPLUS_INCLUDE_PATH"].split(":") == [str(tmp_path / "a"), str(tmp_path / "b"), "/opt/mine"]
    assert env["HOROVOD_WITH_TENSORFLOW"] == "1" and env["HOROVOD_WITHOUT_PYTORCH"] == "1"
