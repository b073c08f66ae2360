"""Every available template renders, parses, and its config matches the runtime's schema."""

import dataclasses

import pytest
import yaml

from hvd_runtime.config import RunConfig, load_config
from hvdgen import catalog
from hvdgen.render import check_tree, render_tree
from hvdgen.spec import ProjectSpec


SHAPES = catalog.shapes()


@pytest.mark.parametrize("framework, strategy, model", SHAPES)
def test_renders_and_parses(tmp_path, framework, strategy, model):
    spec = ProjectSpec(name="proj", framework=framework, strategy=strategy, model=model)
    written = render_tree(spec, tmp_path)
    check_tree(tmp_path)
    assert {"train.py", "model.py", "data.py", "config.yaml", "README.md", "Makefile"} <= set(written)


# The settings each model reads; a config.yaml lists its own model's and none of the others'.
MODEL_KEYS = {"mlp": {"model.hidden", "model.dropout", "model.batch_norm"}, "resnet18": {"model.width"},
              "gpt": {"model.layers", "model.heads", "model.width", "model.context", "model.vocab_multiple",
                      "model.dropout", "model.tie_embeddings"}}
TOKEN_DATA_KEYS = {"data.source", "data.path", "data.workers"}   # a token folder has its own split and sizes
TORCH_ONLY = {"data.workers",   # TensorFlow reads in tf.data's threads, sized by AUTOTUNE
              "train.compile"}  # torch.compile


def keys(node: dict, prefix: str = "") -> set[str]:
    out = set()
    for k, v in node.items():
        out |= keys(v, f"{prefix}{k}.") if isinstance(v, dict) else {prefix + k}
    return out


def applicable_keys(framework: str, strategy: str, model: str) -> set[str]:
    expected = keys(dataclasses.asdict(RunConfig()))
    # the stage settings only appear where there are stages, parallel.tp only under tensor parallelism
    # (the tensor strategy, and a pipeline whose stages it can split: a model with heads)
    if not (strategy == "tensor" or (strategy == "pipeline" and model == "gpt")):
        expected.discard("parallel.tp")
    if strategy != "pipeline":   # the chunks per rank of the interleaved pipeline schedule
        expected.discard("parallel.chunks")
    else:                        # a stage runs eager
        expected.discard("train.compile")
    if not (strategy == "data" or framework == "torch" and strategy in ("tensor", "pipeline")):   # ZeRO
        expected.discard("horovod.zero")
    if strategy in ("data", "tensor"):
        expected = {k for k in expected if not k.startswith("parallel.") or k == "parallel.tp"}
    # each model's own keys, and what the runtime does with any model's blocks
    expected = {k for k in expected if not k.startswith("model.")} | MODEL_KEYS[model] | {"model.recompute"}
    if model == "gpt":  # AdamW: no momentum; tokens: no image or synthetic settings
        expected = {k for k in expected if not k.startswith("data.") and k != "optim.momentum"} | TOKEN_DATA_KEYS
    if framework == "tensorflow":
        expected -= TORCH_ONLY
    return expected


@pytest.mark.parametrize("framework, strategy, model", SHAPES)
def test_config_file_sets_every_runtime_field(tmp_path, framework, strategy, model):
    """The generated config.yaml is the user's documentation: it must list every setting that applies."""
    render_tree(ProjectSpec(name="proj", framework=framework, strategy=strategy, model=model), tmp_path)
    load_config(tmp_path / "config.yaml")  # validates keys and types
    data = yaml.safe_load((tmp_path / "config.yaml").read_text())

    assert keys(data) == applicable_keys(framework, strategy, model)
