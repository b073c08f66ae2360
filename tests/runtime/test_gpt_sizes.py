"""The GPT's sizes (`hvdgen new --model gpt --size NAME`): gpt2-small is GPT-2 small, in both frameworks.

Counted on each generated model.py as build_on_meta builds it (shapes only): 124,439,808
parameters at GPT-2's vocabulary of 50,257 ids (the published count, the head tied to the token
embedding), 124,475,904 at the 50,304 the padded vocabulary (model.vocab_multiple 64) gives.
"""

from __future__ import annotations

import pytest

from hvd_runtime.config import load_config
from hvdgen.render import render_tree
from hvdgen.spec import ProjectSpec
from helpers.tp_checks import load_generated_model


@pytest.mark.parametrize("framework", ["torch", "tensorflow"])
def test_gpt2_small_has_gpt2_smalls_parameters(tmp_path, framework):
    render_tree(ProjectSpec(name="p", framework=framework, model="gpt", size="gpt2-small"), tmp_path)
    cfg = load_config(tmp_path / "config.yaml", [])
    build = load_generated_model(tmp_path, f"gpt2_small_{framework}").build_model
    if framework == "torch":
        from hvd_runtime.torch.memory_plan import held_parameters
        from hvd_runtime.torch.meta_init import build_on_meta
    else:
        from hvd_runtime.tf.memory_plan import held_parameters
        from hvd_runtime.tf.meta_init import build_on_meta
    counts = {vocab: held_parameters(build_on_meta(build, cfg.model, (cfg.model.context,), vocab))
              for vocab in (50_257, 50_304)}
    assert counts == {50_257: 124_439_808, 50_304: 124_475_904}
