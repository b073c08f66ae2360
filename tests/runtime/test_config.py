import pytest

from hvd_runtime.config import ConfigError, RunConfig, flatten, load_config, parse_overrides


def test_overrides_beat_file_beat_defaults(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  epochs: 7\n  batch_size: 16\noptim:\n  lr: 0.1\n")
    cfg = load_config(path, ["--train.epochs", "3", "optim.name=adam"])
    assert cfg.train.epochs == 3            # command line
    assert cfg.train.batch_size == 16       # file
    assert cfg.optim.lr == 0.1 and cfg.optim.name == "adam"
    assert cfg.train.eval_batch_size == RunConfig().train.eval_batch_size  # default


def test_ints_are_accepted_for_floats_and_lists_are_typed():
    cfg = load_config(None, ["--optim.lr", "1", "--model.hidden", "[32, 16]"])
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    assert cfg.model.hidden == [32, 16]


def test_a_float_without_a_dot_is_a_float(tmp_path):
    """YAML 1.1 reads 3e-4 as text: on the command line and in a file it is still the learning rate."""
    assert load_config(None, ["--optim.lr", "3e-4"]).optim.lr == 3e-4
    path = tmp_path / "c.yaml"
    path.write_text("optim:\n  lr: 6E-4\n  clip_norm: +1e0\n")
    assert (load_config(path).optim.lr, load_config(path).optim.clip_norm) == (6e-4, 1.0)
    with pytest.raises(ConfigError, match=r"^optim.lr must be float, got 'fast'$"):
        load_config(None, ["--optim.lr", "fast"])


def test_a_number_is_accepted_where_text_is_wanted(tmp_path):
    """`--parallel.partition 3` (where stage 2 starts), as the config's comment shows it, in a file too."""
    assert load_config(None, ["--parallel.partition", "3"]).parallel.partition == "3"
    path = tmp_path / "c.yaml"
    path.write_text("parallel:\n  partition: 2\n")
    assert load_config(path).parallel.partition == "2"
    with pytest.raises(ConfigError, match="parallel.partition must be str, got True"):
        load_config(None, ["--parallel.partition", "true"])
    with pytest.raises(ConfigError, match=r"parallel.partition must be str, got True \(YAML reads on, off, yes, no "
                                          r"as true or false\): quote the value$"):
        load_config(None, ["--parallel.partition", "yes"])
    with pytest.raises(ConfigError, match="tracking.checkpoint_models must be str, got False .*: choose one of "
                                          "auto, every, final$"):
        load_config(None, ["--tracking.checkpoint_models", "off"])
    # where `off` is one of the choices, the bool YAML made of it is that choice, in a file too
    assert load_config(None, ["--train.on_nonfinite", "off"]).train.on_nonfinite == "off"
    path.write_text("train:\n  on_nonfinite: off\n")
    assert load_config(path).train.on_nonfinite == "off"
    with pytest.raises(ConfigError, match="train.on_nonfinite must be str, got True .*: choose one of skip, stop, "
                                          "off$"):
        load_config(None, ["--train.on_nonfinite", "on"])


@pytest.mark.parametrize("override, fragment", [
    (["--train.epoch", "3"], "unknown config key train.epoch"),
    (["--train.epochs", "three"], "train.epochs must be int"),
    (["--train.epochs", "true"], "train.epochs must be int"),
    (["--model.hidden", "[1, x]"], "model.hidden[1] must be int"),
    (["--trian.epochs", "3"], "unknown config key trian"),
    (["--train.epochs"], "cannot read override"),
    (["--optim.name", "lamb"], "optim.name is 'lamb': choose one of sgd, adam, adamw"),
    (["--data.source", "csv"], "data.source is 'csv': choose one of"),
    (["--data.source", "npz"], "data.source npz needs data.path"),
    (["--train.batch_size", "0"], "train.batch_size must be at least 1"),
    (["--parallel.schedule", "interleaved-1f1b", "--parallel.micro_batches", "3"],
     "parallel.micro_batches 3 is not a multiple of parallel.stages 2: interleaved-1f1b sends micro-batches round "
     "the stages in groups of 2; use 4"),
    (["--parallel.schedule", "interleaved-1f1b", "--parallel.chunks", "1"],
     "parallel.chunks 1 gives each rank one chunk: interleaved-1f1b needs 2 or more"),
    (["--parallel.chunks", "0"], "parallel.chunks must be at least 1"),
    (["--horovod.threads_per_rank", "-2"], "horovod.threads_per_rank must be 0 or more, got -2"),
    (["--horovod.cycle_time_ms", "-1"], "horovod.cycle_time_ms must be 0 or more, got -1.0"),
    (["--checkpoint.every_steps", "-5"], "checkpoint.every_steps must be 0 or more, got -5"),
    (["--horovod.elastic_commit_every", "0"], "horovod.elastic_commit_every must be at least 1, got 0"),
    (["--data.val_fraction", "1"], "data.val_fraction must be 0 or more and less than 1, got 1.0"),
    (["--model.dropout", "-0.1"], "model.dropout must be 0 or more and less than 1, got -0.1"),
    (["--optim.lr", "0"], "optim.lr must be more than 0, got 0.0"),
])
def test_bad_overrides_name_the_key(override, fragment):
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
        load_config(None, override)


def test_parse_overrides_nests():
    assert parse_overrides(["a.b.c=1", "--a.d", "x"]) == {"a": {"b": {"c": 1}, "d": "x"}}


def test_flatten_uses_dotted_keys():
    flat = flatten(RunConfig())
    assert flat["optim.lr"] == RunConfig().optim.lr
    assert "model.hidden" in flat


def test_a_renamed_key_still_works_and_rank_0_says_its_new_name(tmp_path, monkeypatch, capsys):
    """parallel.virtual_stages is parallel.chunks now: a config file or an override that uses the
    old name trains as before; rank 0 says, in one line, what to rename; the others say nothing."""
    path = tmp_path / "config.yaml"
    path.write_text("parallel:\n  schedule: interleaved-1f1b\n  virtual_stages: 3\n  micro_batches: 6\n  stages: 2\n")
    for rank, says in (("0", True), ("1", False)):
        monkeypatch.setenv("HOROVOD_RANK", rank)
        assert load_config(path).parallel.chunks == 3
        assert load_config(None, ["--parallel.virtual_stages", "4"]).parallel.chunks == 4
        lines = capsys.readouterr().err.splitlines()
        assert len(lines) == (2 if says else 0), lines
        if says:
            assert lines[0] == (f"config: parallel.virtual_stages is now called parallel.chunks; the old name works "
                                f"in this release: rename it in {path}")
            assert lines[1].endswith("rename it on the command line")


def test_a_key_set_under_both_names_is_refused(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("parallel:\n  chunks: 2\n  virtual_stages: 3\n")
    with pytest.raises(ConfigError, match=r"^parallel.virtual_stages and parallel.chunks are both set in .*: keep "
                                          r"parallel.chunks \(parallel.virtual_stages is its old name\)$"):
        load_config(path)
