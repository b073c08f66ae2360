"""Every available template renders, parses, and its config matches the runtime's schema."""

import dataclasses

import pytest
import yaml

from hvd_runtime.config import RunConfig, load_config
from hvdgen import catalog
from hvdgen.render import check_tree, render_tree
from hvdgen.spec import ProjectSpec


@pytest.mark.parametrize("framework, strategy", sorted(catalog.AVAILABLE))
def test_renders_and_parses(tmp_path, framework, strategy):
    spec = ProjectSpec(name="proj", framework=framework, strategy=strategy)
    written = render_tree(spec, tmp_path)
    check_tree(tmp_path)
    assert {"train.py", "model.py", "data.py", "config.yaml", "README.md", "Makefile"} <= set(written)


@pytest.mark.parametrize("framework, strategy", sorted(catalog.AVAILABLE))
def test_config_file_sets_every_runtime_field(tmp_path, framework, strategy):
    """The generated config.yaml is the user's documentation: it must list every setting."""
    render_tree(ProjectSpec(name="proj", framework=framework, strategy=strategy), tmp_path)
    load_config(tmp_path / "config.yaml")  # validates keys and types
    data = yaml.safe_load((tmp_path / "config.yaml").read_text())

    def keys(node, prefix=""):
        out = set()
        for k, v in node.items():
            out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
        return out

    expected = keys(dataclasses.asdict(RunConfig()))
    if strategy == "data":  # the stage settings only appear where there are stages
        expected = {k for k in expected if not k.startswith("parallel.")}
    assert keys(data) == expected
