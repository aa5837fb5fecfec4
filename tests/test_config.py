"""Run configuration: presets, YAML files, dotted overrides, validation messages, hashing."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
import yaml

from moelab.config import (
    ConfigError,
    DataConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    TrainConfig,
    apply_overrides,
    config_from_dict,
    load_config,
    preset_names,
    save_config,
)


def _field_names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


# ---------------------------------------------------------------------------------------------
# presets and files


def test_preset_names_lists_the_shipped_presets():
    names = preset_names()
    assert "tiny" in names
    assert names == sorted(names)
    assert all(not n.endswith(".yaml") for n in names)


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_validates(name):
    cfg = load_config(name)
    assert isinstance(cfg, RunConfig)
    assert cfg.validate() is cfg
    # a preset is fully resolved: saving and reloading it gives the same config
    again = config_from_dict(yaml.safe_load(yaml.safe_dump(cfg.to_dict())))
    assert again == cfg
    assert again.hash() == cfg.hash()


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_takes_each_expert_parallel_degree_with_its_default_transport(name):
    from moelab.parallel.transport import check_config

    n = load_config(name).model.n_experts
    for ep in (d for d in (2, 4, 8, 16, 32, 64) if n % d == 0):  # e.g. 8 fake CPU devices
        check_config(load_config(name, [f"parallel.devices={ep}", f"parallel.expert={ep}"]))


def test_tiny_preset_values_come_from_the_yaml():
    from importlib import resources

    raw = yaml.safe_load((resources.files("moelab") / "presets" / "tiny.yaml").read_text())
    cfg = load_config("tiny")
    for section, fields in raw.items():
        for name, value in fields.items():
            assert getattr(getattr(cfg, section), name) == value, f"{section}.{name}"
    assert cfg.model.router == "sigmoid_bias" and cfg.model.d_model != ModelConfig().d_model
    # fields the preset does not name keep their dataclass defaults
    assert cfg.optim.floor == OptimConfig().floor
    assert cfg.train.keep_ckpts == TrainConfig().keep_ckpts


def test_yaml_file_round_trip(tmp_path):
    cfg = load_config("tiny", ["train.steps=7", "model.n_experts=4", "model.top_k=1"])
    path = tmp_path / "run.yaml"
    save_config(cfg, path)
    assert load_config(str(path)) == cfg


def test_missing_yaml_file_is_a_clear_error(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as e:
        load_config(str(missing))
    msg = str(e.value)
    assert str(missing) in msg and "not found" in msg
    assert "tiny" in msg  # lists the presets as the alternative


def test_bad_yaml_is_a_clear_error(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("model:\n  d_model: [1, 2\n  n_layers: 3\n")
    with pytest.raises(ConfigError, match="invalid YAML") as e:
        load_config(str(path))
    assert str(path) in str(e.value)


def test_yaml_top_level_must_be_a_mapping(tmp_path):
    path = tmp_path / "list.yaml"
    path.write_text("- model\n- data\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(str(path))


def test_unknown_preset_name_lists_presets():
    with pytest.raises(ConfigError) as e:
        load_config("no_such_preset_xyz")
    msg = str(e.value)
    assert "no_such_preset_xyz" in msg and "no such preset" in msg
    for name in preset_names():
        assert name in msg


def test_an_empty_yaml_file_is_refused_and_an_empty_mapping_gives_the_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing yet\n")  # most likely a mistake: say so rather than train defaults
    with pytest.raises(ConfigError, match=f"config {path}: empty") as e:
        load_config(str(path))
    # the message names every section (parallel too) and how to ask for the defaults
    assert "model, data, optim, train, parallel" in str(e.value) and "{}" in str(e.value)
    path.write_text("[1, 2]\n")
    with pytest.raises(ConfigError, match="optim, train, parallel"):
        load_config(str(path))
    path.write_text("{}\n")  # said explicitly
    assert load_config(str(path)) == RunConfig()


# ---------------------------------------------------------------------------------------------
# base: a YAML file extends a preset or another file


def _yaml(path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return str(path)


def test_a_yaml_extends_a_preset_field_by_field(tmp_path):
    mine = _yaml(tmp_path / "mine.yaml", "base: small\nmodel:\n  n_experts: 32\n"
                 "train: {steps: 50}\n")
    cfg = load_config(mine)
    assert cfg == load_config("small", ["model.n_experts=32", "train.steps=50"])
    assert cfg.model.d_model == load_config("small").model.d_model != ModelConfig().d_model


def test_a_base_chain_follows_paths_relative_to_each_file(tmp_path, monkeypatch):
    _yaml(tmp_path / "lib" / "common.yaml", "base: tiny\ntrain: {steps: 40, seed: 3}\n"
          "data: {mixture: {prose: 1, code: 1}}\noptim:\n  decays: [{start: 10, end: 20}]\n")
    mine = _yaml(tmp_path / "exp" / "mine.yaml", "base: ../lib/common.yaml\n"
                 "train: {steps: 60}\ndata: {mixture: {prose: 1}}\n")
    monkeypatch.chdir(tmp_path / "lib")  # relative to the file, not to where the command runs
    cfg = load_config(mine)
    want = load_config("tiny", ["train.steps=60", "train.seed=3", "data.mixture={prose: 1}",
                                "optim.decays=[{start: 10, end: 20}]"])
    assert cfg == want  # sections merge per field; a mixture or a list is replaced whole
    assert cfg.data.mixture == {"prose": 1.0}


@pytest.mark.parametrize("files, start, needle", [
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "base: ./a.yaml\n"}, "a.yaml",
     "config {d}/a.yaml: base cycle {d}/a.yaml -> {d}/b.yaml -> {d}/a.yaml; remove one"),
    ({"a.yaml": "base: a.yaml\n"}, "a.yaml", "base cycle {d}/a.yaml -> {d}/a.yaml"),
    ({"a.yaml": "base: sub/b.yaml\n"}, "a.yaml",
     "config file {d}/sub/b.yaml (the base of {d}/a.yaml): not found"),
    ({"a.yaml": "base: smal\n"}, "a.yaml",
     "config 'smal' (the base of {d}/a.yaml): no such preset or file; presets: "),
    ({"a.yaml": "base: 3\n"}, "a.yaml",
     "config {d}/a.yaml: base: expected a preset name or a YAML path (relative to {d}/a.yaml)"),
    ({"a.yaml": "base: b.yaml\n", "b.yaml": "train: {stpes: 3}\n"}, "a.yaml",
     "train.stpes: unknown field; did you mean train.steps?"),
])
def test_bad_bases_are_clear_errors(files, start, needle, tmp_path):
    for name, text in files.items():
        _yaml(tmp_path / name, text)
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / start))
    assert needle.format(d=tmp_path) in str(e.value)


def test_the_run_folder_records_the_resolved_config(tmp_path, data_dir, monkeypatch):
    """config.yaml in the run folder is the whole config, with no base left to follow."""
    from helpers import micro_dict, write_config_yaml
    from moelab.cli import main
    from moelab.train import setup

    class Stop(Exception):
        pass

    write_folder = setup._write_run_folder

    def stop(*a, **kw):  # once the run folder is written
        write_folder(*a, **kw)
        raise Stop

    write_config_yaml(tmp_path / "micro.yaml", micro_dict(data_dir))
    mine = _yaml(tmp_path / "mine.yaml", "base: micro.yaml\ntrain: {steps: 7}\n")
    monkeypatch.setattr(setup, "init_sharded_state", lambda *_a, **_kw: None)  # no compilation
    monkeypatch.setattr(setup, "_write_run_folder", stop)
    with pytest.raises(Stop):
        main(["train", mine, "--run-dir", str(tmp_path / "run")])
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    want = load_config(mine).to_dict()
    want["data"]["sampler"] = "epoch"  # not given: a new run's, written out
    assert "base" not in saved and saved == want
    assert saved["train"]["steps"] == 7 and saved["data"]["data_dir"] == str(data_dir)


# ---------------------------------------------------------------------------------------------
# overrides


def test_overrides_are_parsed_as_yaml_values():
    cfg = load_config("tiny", ["train.steps=5", "train.wandb=true", "optim.lr=0.01",
                               "data.mixture={a: 1, b: 2.5}", "model.router=softmax_aux"])
    assert cfg.train.steps == 5 and isinstance(cfg.train.steps, int)
    assert cfg.train.wandb is True
    assert cfg.optim.lr == 0.01
    assert cfg.data.mixture == {"a": 1.0, "b": 2.5}
    assert all(isinstance(v, float) for v in cfg.data.mixture.values())
    assert cfg.model.router == "softmax_aux"


def test_overrides_do_not_modify_their_input():
    base = {"train": {"steps": 3}}
    out = apply_overrides(base, ["train.steps=9", "model.d_model=64"])
    assert base == {"train": {"steps": 3}}
    assert out == {"train": {"steps": 9}, "model": {"d_model": 64}}


def test_override_value_may_contain_equals_sign():
    cfg = load_config("tiny", ["data.tokenizer=/tmp/a=b/tok.json"])
    assert cfg.data.tokenizer == "/tmp/a=b/tok.json"


def test_integral_float_is_accepted_for_an_int_field():
    assert load_config("tiny", ["train.steps=12.0"]).train.steps == 12
    with pytest.raises(ConfigError, match=r"train\.steps: expected an integer"):
        load_config("tiny", ["train.steps=12.5"])


def test_scientific_notation_float_override():
    """`optim.lr=3e-3` is how people write learning rates. YAML 1.1 (PyYAML) reads "3e-3" as a
    string (it wants "3.0e-3"), so the float field must accept a numeric string."""
    cfg = load_config("tiny", ["optim.lr=3e-3"])
    assert cfg.optim.lr == pytest.approx(3e-3)


@pytest.mark.parametrize("overrides, needle", [
    (["train.steps=10", "train.steps=20"],
     "override 'train.steps=20': train.steps is already set by 'train.steps=10'; give each "
     "field once"),
    (["data.mixture={a: 1}", "train.seed=2", "data.mixture.a=3"],
     "override 'data.mixture.a=3': data.mixture is already set by 'data.mixture={a: 1}'"),
    (["data.mixture.a=3", "data.mixture={a: 1}"],
     "override 'data.mixture={a: 1}': data.mixture is already set by 'data.mixture.a=3'"),
])
def test_a_field_given_twice_is_an_error_as_in_yaml(overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    assert str(e.value) == needle or str(e.value).startswith(needle)
    assert load_config("tiny", ["data.mixture.a=3", "data.mixture.b=1"]).data.mixture == {
        "a": 3.0, "b": 1.0}  # two keys of one mapping are two fields


BOOL_WORDS = [("true", True), ("FALSE", False), ("yes", True), ("No", False), ("on", True),
              ("OFF", False), ("1", True), ("0", False), ("tRuE", True), ("'yes'", True)]


@pytest.mark.parametrize("word, value", BOOL_WORDS)
def test_booleans_take_the_same_words_in_yaml_and_on_the_command_line(word, value, tmp_path):
    path = _yaml(tmp_path / "b.yaml", f"train:\n  wandb: {word}\nmodel: {{xsa: {word}}}\n")
    for cfg in (load_config("tiny", [f"train.wandb={word}", f"model.xsa={word}"]),
                load_config(path)):
        assert cfg.train.wandb is value and cfg.model.xsa is value


@pytest.mark.parametrize("word", ["maybe", "2", "1.0", "''", "[true]"])
def test_other_boolean_values_are_refused_alike(word, tmp_path):
    path = _yaml(tmp_path / "b.yaml", f"train:\n  wandb: {word}\n")
    for source, overrides, where in (("tiny", [f"train.wandb={word}"], ""),
                                     (path, [], f"config {path}: ")):  # a file names itself
        with pytest.raises(ConfigError, match="^" + re.escape(where) + r"train.wandb: expected "
                           r"true or false \(or yes/no, on/off, 1/0\), got "):
            load_config(source, overrides)


@pytest.mark.parametrize("item, needle", [
    ("train.steps", "expected section.field=value, e.g. train.steps=100 (no spaces around =)"),
    ("steps=5", "key must be section.field, e.g. train.steps=5"),  # the field meant
    (".steps=5", "key must be section.field, e.g. train.steps=5"),  # not ": unknown field"
    ("train.=5", "key must be section.field, e.g. model.d_model"),
    ("small", "a second config; give one config (preset or YAML file), before the overrides"),
    ("optim.decays.start=5", "optim.decays is a list; give it whole, e.g. "
                             "optim.decays=[{...}]"),  # not "expected a list, got {'start': 5}"
    ("my.yaml", "a second config; give one config (preset or YAML file), before the overrides"),
])
def test_malformed_overrides(item, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [item])
    assert str(e.value) == f"override {item!r}: {needle}"


def test_a_text_field_on_the_command_line_takes_the_text_typed(tmp_path):
    """YAML would read 2024 as a number and an empty value as null: a text field given on the
    command line takes the characters typed; a YAML file says to quote them."""
    cfg = load_config("tiny", ["train.wandb_project=2024", "data.tokenizer="])
    assert (cfg.train.wandb_project, cfg.data.tokenizer) == ("2024", "")
    assert load_config("tiny", ["data.source=x.jsonl", "data.split= 007 ",
                                "data.format=hf-files"]).data.split == "007"
    with pytest.raises(ConfigError, match=r"^model.conv_sites: expected a string, got \['q'"):
        load_config("tiny", ["model.conv_sites=[q, k]"])  # a list is not text
    path = _yaml(tmp_path / "n.yaml", "base: tiny\ntrain:\n  wandb_project: 2024\n")
    with pytest.raises(ConfigError, match=r"train.wandb_project: expected a string, got 2024; "
                                          r"in YAML, quote text that reads as a number"):
        load_config(path)
    path = _yaml(tmp_path / "e.yaml", "base: tiny\ndata:\n  tokenizer:\n")
    with pytest.raises(ConfigError, match=r"data.tokenizer: expected a string, got nothing "
                                          r"\(an empty value\); write '' for an empty one"):
        load_config(path)


@pytest.mark.parametrize("name, needle", [
    ("me/proj", "'me/proj': W&B project names cannot hold /; for entity/project set "
                "WANDB_ENTITY=me and train.wandb_project=proj"),
    ("a#b:c", "cannot hold # :"),
    ("a\\b", "cannot hold \\"),
    ("", "give a W&B project name of 1 to 128 characters"),
    ("x" * 129, "of 1 to 128 characters"),
])
def test_a_wandb_project_name_w_and_b_refuses_is_refused_at_once(name, needle):
    """wandb.init refuses these only once the run folder is made and the data prepared, with a
    traceback; the config names the field at once (the same rule as the installed wandb's)."""
    import wandb

    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"train.wandb_project={name}"])
    assert str(e.value).startswith("train.wandb_project: ") and needle in str(e.value)
    if name:  # W&B itself takes "" (its default project), which names nothing here
        with pytest.raises(wandb.errors.UsageError):
            wandb.Settings(project=name)
    for good in ("my proj-1.x", "x" * 128):
        assert load_config("tiny", [f"train.wandb_project={good}"]).train.wandb_project == good
        wandb.Settings(project=good)


def test_a_config_from_a_pipe_is_read_and_a_run_folder_is_named(tmp_path, monkeypatch):
    """`moelab train <(moelab config tiny ...)` reads a pipe, not a regular file; a run folder
    given as the config says where its config is and how to continue it."""
    import os
    import threading

    fifo = tmp_path / "cfg.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_text("base: tiny\ntrain:\n  steps: 7\n"),
                              daemon=True)
    writer.start()
    try:
        assert load_config(str(fifo)).train.steps == 7
    finally:
        if writer.is_alive():  # not read: let its open return instead of blocking for ever
            os.close(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
        writer.join(5)
    monkeypatch.chdir(tmp_path)
    _yaml(tmp_path / "runs" / "r1" / "config.yaml", "{}\n")
    with pytest.raises(ConfigError) as e:
        load_config("runs/r1")
    assert str(e.value).startswith("config file runs/r1: a folder, not a file (a run folder: its "
                                   "config is runs/r1/config.yaml; `moelab resume runs/r1` "
                                   "continues the run); give a YAML path or a preset name")


# ---------------------------------------------------------------------------------------------
# validation messages name the field


def test_unknown_field_names_it_and_lists_valid_fields():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["model.zzzz=3"])  # nothing close: every valid name
    msg = str(e.value)
    assert msg.startswith("model.zzzz: unknown field")
    for name in _field_names(ModelConfig):
        assert name in msg


@pytest.mark.parametrize("key, hint", [
    ("model.d_modle", "did you mean model.d_model?"),  # a typo: the closest field
    ("trian.steps", "trian: unknown field; did you mean train?"),  # a section's typo
    ("model.steps", "did you mean train.steps?"),  # a field of another section
])
def test_unknown_key_suggests_the_intended_one(key, hint, tmp_path):
    with pytest.raises(ConfigError, match=re.escape(hint)):
        load_config("tiny", [f"{key}=3"])
    section, name = key.split(".")
    path = tmp_path / "c.yaml"  # the same from a YAML file
    path.write_text(f"{section}:\n  {name}: 3\n")
    with pytest.raises(ConfigError, match=re.escape(hint)):
        load_config(str(path))


def test_an_unknown_field_names_its_file_in_a_base_chain(tmp_path):
    """A YAML file's unknown field is named with the file it is in (the base, not the file
    given, when the base holds it); a section's field at the top level says where it goes."""
    (tmp_path / "base.yaml").write_text("base: tiny\nsteps: 100\n")
    (tmp_path / "top.yaml").write_text("base: base.yaml\ntrain:\n  steps: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(str(tmp_path / "top.yaml"))
    assert str(e.value) == (
        f"config {tmp_path / 'base.yaml'} (the base of {tmp_path / 'top.yaml'}): steps: unknown "
        "field; did you mean train.steps? (a YAML file gives it inside its section: `train:`, "
        "then `  steps: ...`)")
    (tmp_path / "typo.yaml").write_text("base: tiny\nmodel:\n  n_expertz: 4\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: model.n_expertz: unknown field; did you "
                                          r"mean model.n_experts\?"):
        load_config(str(tmp_path / "typo.yaml"))


@pytest.mark.parametrize("text, needle", [
    ("model:\n", "model: expected a section of fields (indented lines such as `  vocab_size: "
                 "...` below `model:`), got nothing (an empty value); give its fields, or remove "
                 "the `model:` line"),
    ("model: 3\n", "model: expected a section of fields"),
    ("model:\n  - d_model: 64\n", "model: expected a section of fields"),
    ("model:\n  d_model: big\n", "model.d_model: expected an integer, got 'big'"),
    ("model:\n  d_model:\n", "model.d_model: expected an integer, got nothing (an empty value)"),
])
def test_a_wrong_section_or_value_names_its_file_in_a_base_chain(text, needle, tmp_path):
    """A section left empty or given a value, or a field of the wrong type, is named with the
    file that holds it (here the base of the file given), in words rather than Python's."""
    _yaml(tmp_path / "base.yaml", "base: tiny\n" + text)
    top = _yaml(tmp_path / "top.yaml", "base: base.yaml\ntrain:\n  steps: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(top)
    assert str(e.value).startswith(f"config {tmp_path / 'base.yaml'} (the base of {top}): ")
    assert needle in str(e.value) and "NoneType" not in str(e.value)


def test_an_empty_override_says_so():
    with pytest.raises(ConfigError, match=r"^model.d_model: expected an integer, got nothing "
                                          r"\(an empty value\)$"):
        load_config("tiny", ["model.d_model="])


def test_unknown_field_in_other_sections():
    for section, cls in (("data", DataConfig), ("optim", OptimConfig), ("train", TrainConfig)):
        with pytest.raises(ConfigError) as e:
            load_config("tiny", [f"{section}.bogus=1"])
        msg = str(e.value)
        assert msg.startswith(f"{section}.bogus: unknown field")
        assert all(n in msg for n in _field_names(cls))


def test_unknown_section_is_named_without_a_stray_dot():
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["xyzzy.d_model=3"])
    msg = str(e.value)
    assert "xyzzy" in msg and "unknown field" in msg
    for section in ("model", "data", "optim", "train"):
        assert section in msg
    assert msg.startswith("xyzzy"), msg  # not ".xyzzy: ..."


@pytest.mark.parametrize("override, field, needle", [
    ("model.d_model=abc", "model.d_model", "expected an integer, got 'abc'"),
    ("model.d_model=true", "model.d_model", "expected an integer"),
    ("optim.lr=fast", "optim.lr", "expected a number"),
    ("train.wandb=maybe", "train.wandb", "expected true or false"),
    ("model.router=3", "model.router", "must be 'softmax_aux'"),  # the text 3 (a choice field)
    ("data.mixture=5", "data.mixture", "expected a mapping"),
    ("data.mixture={a: x}", "data.mixture.a", "expected a number"),
])
def test_wrong_type_names_the_field(override, field, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    msg = str(e.value)
    assert msg.startswith(field + ":"), msg
    assert needle in msg


@pytest.mark.parametrize("overrides, field, needle", [
    (["model.n_heads=4", "model.n_kv_heads=3"], "model.n_kv_heads", "must divide n_heads=4"),
    (["model.n_experts=4", "model.top_k=5"], "model.top_k", "must be <= n_experts=4"),
    (["model.d_model=0"], "model.d_model", "positive"),
    (["model.router=topk"], "model.router", "softmax_aux"),
    (["model.moe_impl=fast"], "model.moe_impl", "auto"),
    (["model.latent_dim=999"], "model.latent_dim", "d_model"),
    (["model.rope_fraction=1.5"], "model.rope_fraction", "[0, 1]"),
    (["model.head_dim=30", "model.rope_fraction=0.1"], "model.rope_fraction", "even"),
    (["model.head_dim=33"], "model.rope_fraction", "change head_dim=33 or rope_fraction"),
    (["model.norm_eps=0"], "model.norm_eps", "> 0"),
    (["model.compute_dtype=float16"], "model.compute_dtype", "bfloat16"),
    (["data.seq_len=0"], "data.seq_len", "> 0"),
    (["data.mixture={a: -1}"], "data.mixture.a", ">= 0"),
    (["data.mixture={a: 0, b: 0}"], "data.mixture", "at least one"),
    (["optim.lr=0"], "optim.lr", "> 0"),
    (["optim.floor=1.5"], "optim.floor", "[0, 1]"),
    (["optim.b2=1.0"], "optim.b1/b2", "[0, 1)"),
    (["train.steps=0"], "train.steps", "> 0"),
    (["train.ckpt_every=0"], "train.ckpt_every", "> 0"),
    (["train.peak_flops=-1"], "train.peak_flops", ">= 0"),
])
def test_invalid_values_name_the_field(overrides, field, needle):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", overrides)
    msg = str(e.value)
    assert msg.startswith(field + ":"), msg
    assert needle in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_config_from_dict_validates():
    with pytest.raises(ConfigError, match=r"^model\.top_k"):
        config_from_dict({"model": {"n_experts": 2, "top_k": 3}})
    with pytest.raises(ConfigError, match="expected a mapping"):
        config_from_dict({"model": 5})


# ---------------------------------------------------------------------------------------------
# derived values and hashing


def test_schedule_and_warmup_defaults():
    cfg = load_config("tiny", ["train.steps=1000"])
    assert cfg.schedule_steps == 1000  # 0 = train.steps
    assert cfg.warmup_steps == 10  # 0 = 1% of the schedule
    cfg = load_config("tiny", ["train.steps=50", "optim.schedule_steps=400",
                               "optim.warmup_steps=0"])
    assert cfg.schedule_steps == 400 and cfg.warmup_steps == 4
    cfg = load_config("tiny", ["train.steps=50"])
    assert cfg.warmup_steps == 1  # at least one step
    cfg = load_config("tiny", ["optim.warmup_steps=7"])
    assert cfg.warmup_steps == 7


def test_hash_is_stable_and_changes_with_any_field():
    a, b = load_config("tiny"), load_config("tiny")
    assert a.hash() == b.hash()
    assert len(a.hash()) == 12 and all(c in "0123456789abcdef" for c in a.hash())
    seen = {a.hash()}
    for override in ("model.d_model=64", "train.steps=601", "optim.lr=0.002",
                     "data.mixture={x: 1}", "train.wandb=true", "data.seed=1"):
        h = load_config("tiny", [override]).hash()
        assert h not in seen, override
        seen.add(h)
    # the hash depends on values, not on how they were written
    steps = a.train.steps
    assert load_config("tiny", [f"train.steps={steps}"]).hash() == a.hash()
    assert load_config("tiny", [f"train.steps={steps}.0"]).hash() == a.hash()


def test_hash_is_independent_of_mixture_order():
    x = load_config("tiny", ["data.mixture={a: 1, b: 2}"])
    y = load_config("tiny", ["data.mixture={b: 2, a: 1}"])
    assert x.hash() == y.hash()


def test_pooled_global_has_its_own_sender_factor_and_old_configs_keep_theirs(tmp_path):
    """pooled_global reads parallel.global_sender_cf, pooled_wave parallel.sender_cf; a config
    naming pooled_global with sender_cf alone (as written before global_sender_cf existed,
    run folders included) reads it as global_sender_cf."""
    from moelab.parallel import transport

    default = config_from_dict({}).parallel
    old = config_from_dict({"parallel": {"transport": "pooled_global", "sender_cf": 1.5}})
    assert old.parallel.global_sender_cf == 1.5 != default.global_sender_cf
    both = config_from_dict({"parallel": {"transport": "pooled_global", "sender_cf": 1.5,
                                          "global_sender_cf": 1.25}}).parallel
    assert (both.sender_cf, both.global_sender_cf) == (1.5, 1.25)
    wave = config_from_dict({"parallel": {"transport": "pooled_wave", "sender_cf": 1.5}}).parallel
    assert wave.global_sender_cf == default.global_sender_cf
    save_config(old, tmp_path / "config.yaml")  # saved with both: read back unchanged
    assert load_config(str(tmp_path / "config.yaml")) == old

    rows = transport.get("pooled_global").rows  # send pools follow global_sender_cf only
    send = lambda par: rows(par, 1024, 8, 8, 64).send
    assert send(both) == send(dataclasses.replace(both, sender_cf=3.0)) < send(
        dataclasses.replace(both, global_sender_cf=3.0))
    with pytest.raises(ConfigError, match="parallel.global_sender_cf"):
        transport.get("pooled_global").check(dataclasses.replace(both, global_sender_cf=0.0), 8)


def test_a_run_keeps_its_data_paths_absolute_source_included(tmp_path, monkeypatch):
    """A stream run started with a relative data.source resumed from another folder read
    another path (and was told to delete its corpus): config.yaml keeps it absolute now."""
    monkeypatch.chdir(tmp_path)
    cfg = load_config("tiny", ["data.source=src2", "data.data_dir=d", "data.tokenizer=t.json"])
    d = cfg.with_absolute_data().data
    assert (d.source, d.data_dir, d.tokenizer) == (str(tmp_path / "src2"), str(tmp_path / "d"),
                                                   str(tmp_path / "t.json"))
    url = load_config("tiny", ["data.source=gs://b/src"]).with_absolute_data()
    assert url.data.source == "gs://b/src"  # a URL stays as given


@pytest.mark.parametrize("name", ["eval_every", "ckpt_every"])
def test_a_zero_period_says_how_to_keep_only_the_end_s_one(name):
    with pytest.raises(ConfigError, match=rf"train\.{name}: must be > 0; .* past train\.steps"):
        load_config("tiny", [f"train.{name}=0"])
    assert getattr(load_config("tiny", [f"train.{name}=1e9"]).train, name) == 10**9


def test_a_folder_named_as_a_preset_does_not_hide_it(tmp_path, monkeypatch):
    """A run folder `tiny` where the command runs (`moelab train --run-dir tiny`, or inside
    runs/) left `moelab plan tiny` and `moelab plan` (default tiny) refused as a folder."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "lab").mkdir()
    assert load_config("tiny") == load_config(str(_yaml(tmp_path / "t.yaml", "base: tiny\n")))
    with pytest.raises(ConfigError, match="config file lab: a folder, not a file"):
        load_config("lab")  # no preset of that name: the folder is what was meant
    with pytest.raises(ConfigError, match="config file ./tiny: a folder, not a file"):
        load_config("./tiny")  # a path, said as one


def test_a_run_folder_given_as_the_config_names_its_config_file(tmp_path, monkeypatch):
    """`moelab plan runs/lo` (a run folder for a config file), on the command line or as a
    base, points at runs/lo/config.yaml."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs" / "lo").mkdir(parents=True)
    save_config(load_config("tiny"), tmp_path / "runs" / "lo" / "config.yaml")
    for given in ("runs/lo", "runs/lo/"):
        with pytest.raises(ConfigError, match="config file runs/lo/?: a folder, not a file "
                           r"\(a run folder: its config is runs/lo/config.yaml;"):
            load_config(given)
    with pytest.raises(ConfigError, match=r"runs/lo \(the base of .*\): a folder, not a file "
                       r"\(a run folder: its config is .*runs/lo/config.yaml;"):
        load_config(str(_yaml(tmp_path / "t.yaml", "base: runs/lo\n")))
    assert load_config("runs/lo/config.yaml") == load_config("tiny")


def test_a_mistyped_preset_name_suggests_the_preset():
    with pytest.raises(ConfigError, match=r"presets: .*; did you mean '535b-a23b'\?"):
        load_config("535b-a32b")


def test_a_transport_field_the_training_transport_never_reads_is_noted():
    """parallel.capacity_factor under pooled_wave, and any transport setting at EP 1, trained
    as if never given, without a word."""
    from moelab.config import load_config
    from moelab.parallel.transport import unread_fields

    def notes(*overrides):
        return unread_fields(load_config("tiny", list(overrides)), overrides)

    ep4 = ("parallel.devices=8", "parallel.expert=4")
    assert notes(*ep4, "parallel.capacity_factor=2", "parallel.receiver_cf=1.3") == [
        "note: parallel.capacity_factor is not read (pooled_wave reads sender_cf, receiver_cf, "
        "waves)"]
    assert notes(*ep4, "parallel.transport=expert_cells", "parallel.capacity_factor=2") == []
    # a lone sender_cf is pooled_global's send-pool factor (configs written before its field)
    assert notes(*ep4, "parallel.transport=pooled_global", "parallel.sender_cf=1.5") == []
    assert notes(*ep4, "parallel.transport=pooled_global", "parallel.sender_cf=1.5",
                 "parallel.global_sender_cf=2.0")[0].startswith("note: parallel.sender_cf is "
                                                             "not read (pooled_global reads")
    at_ep1 = notes("parallel.devices=8", "parallel.transport=expert_cells",
                   "parallel.capacity_factor=2")
    assert [n.split(" (")[0] for n in at_ep1] == [
        "note: parallel.transport=expert_cells is not used",
        "note: parallel.capacity_factor is not read"]
    assert "set parallel.expert > 1" in at_ep1[0]


@pytest.mark.parametrize("stage", [
    {"max_drops": 0.01, "fallbacks": [{"receiver_cf": 1e12}]},
    {"max_drops": 0.01, "decision": "switch", "parallel": {"receiver_cf": 1e12}},
])
def test_a_stage_capacity_past_any_useful_size_is_refused(stage):
    """The run's own factors past 1024 were refused (1e12 crashed the compile), but a stage's
    were not: the crash came at the stage's step, mid-run."""
    stages = [{"step": 100, "seq_len": 512, **stage}]
    with pytest.raises(ConfigError, match="at most 1024"):
        load_config("tiny", [f"data.context_stages={json.dumps(stages)}"])


@pytest.mark.parametrize("stage, said", [
    ("{step: 10, seq_len: 4096}", "data.context_stages[0]: its batch of 2 sequences (the tokens "
     "per batch at seq_len 4096) must be divisible by parallel.devices=4 (each device gets "
     "rows): give the stage a batch_size that is a multiple of 4, e.g. 4"),
    ("{step: 10, seq_len: 512, batch_size: 6}", "data.context_stages[0].batch_size: its batch "
     "of 6 sequences must be divisible by parallel.devices=4 (each device gets rows): give the "
     "stage a batch_size that is a multiple of 4, e.g. 4"),
])
def test_a_stage_batch_the_devices_cannot_split_is_named_with_the_fix(stage, said):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", ["parallel.devices=4", f"data.context_stages=[{stage}]"])
    assert str(e.value) == said


def test_a_decided_stage_s_capacity_wins_over_a_typed_one_and_says_so():
    """A gate decided at step 3 set receiver_cf 1.5 from there on: a resume that types
    parallel.receiver_cf=2.0 trains at 1.5 after step 3, and now hears it; a move to a
    transport the decided gate's fallbacks do not fit is no longer refused (they are never
    tried again)."""
    from moelab.parallel.transport import check_config, unread_fields
    from moelab.train.adapt import check_adaptive

    stage = ("[{step: 3, seq_len: 512, max_drops: 0.01, decision: DECISION, parallel: "
             "{receiver_cf: 1.5}, fallbacks: [{receiver_cf: 1.5}]}]")
    base = ["parallel.devices=8", "parallel.expert=4", "parallel.waves=2", "train.steps=10"]

    def cfg(decision, *given):
        stages = (stage.replace("DECISION", decision) if decision else  # a gate still to decide
                  "[{step: 3, seq_len: 512, max_drops: 0.01, fallbacks: [{receiver_cf: 1.5}]}]")
        return check_config(load_config("tiny", [*base, f"data.context_stages={stages}",
                                                 *given]))

    given = ["parallel.receiver_cf=2.0"]
    assert cfg("switch", *given).parallel_at(5).receiver_cf == 1.5
    assert unread_fields(cfg("switch", *given), given) == [
        "note: parallel.receiver_cf=2 is not used from step 3 on, where "
        "data.context_stages[0].parallel sets receiver_cf=1.5"]
    assert unread_fields(cfg("stay", *given), given) == []  # a stage that stayed trains nothing
    moved = ["parallel.transport=expert_cells"]
    check_adaptive(cfg("switch", *moved))
    with pytest.raises(ConfigError, match=r"fallbacks\[0\]\.receiver_cf: expert_cells does not "
                                          "read parallel.receiver_cf"):
        check_adaptive(cfg("", *moved))  # still to decide: its fallbacks must fit


def test_a_value_the_file_holds_is_refused_naming_the_file(tmp_path):
    """optim.lr: must be > 0 from a YAML file named the field alone; an override's own value
    is still named as the override's, and an override that fixes the file's value loads."""
    bad = _yaml(tmp_path / "bad.yaml", "base: tiny\noptim:\n  lr: -1\n")
    with pytest.raises(ConfigError, match=f"^config {bad}: optim.lr: must be > 0"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=f"^config {bad}: optim.lr: must be > 0"):
        load_config(str(bad), ["train.steps=5"])
    assert load_config(str(bad), ["optim.lr=0.001"]).optim.lr == 0.001
    good = _yaml(tmp_path / "good.yaml", "base: tiny\n")
    with pytest.raises(ConfigError, match="^optim.lr: must be > 0"):
        load_config(str(good), ["optim.lr=-2"])


@pytest.mark.parametrize("over, says", [
    (["parallel.devices=8", "parallel.expert=3"], "parallel.expert: must divide "
     "parallel.devices=8, not 3: give one of 1, 2, 4, 8, or change parallel.devices"),
    (["parallel.devices=8", "parallel.expert=8", "model.n_experts=12"], "parallel.expert: must "
     "divide model.n_experts=12 (each rank holds n_experts/expert), not 8: give one of 1, 2, 4 "
     "(dividing parallel.devices=8 too)"),
    (["parallel.expert=2"], "or a multiple of 2, or parallel.expert=1 for one device"),
])
def test_an_expert_degree_that_does_not_divide_names_the_degrees_that_do(over, says):
    """The refusal named the constraint but neither the value given nor one that fits."""
    with pytest.raises(ConfigError) as e:
        load_config("tiny", over)
    assert says in str(e.value)
