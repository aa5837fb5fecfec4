"""Discoverable config: field docs read from the source comments, `moelab config`, the config
sections in `train --help`, and model.vocab_size taken from (and checked against) the tokenizer."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import yaml

from moelab.cli import main
from moelab.config import ConfigError, load_config
from moelab.config.docs import describe_config, field_docs, section_classes
from moelab.data.prepare import DEFAULT_VOCAB, vocab_needed, with_tokenizer_vocab
from moelab.data.tokenizer import load_tokenizer


@dataclasses.dataclass
class _Documented:
    # a section header, not a doc: the field below has its own comment
    a: int = 1  # the comment beside a field wins
    # a doc above a field,
    # on two lines
    b: str = "#not a comment"
    c: int = 0


def test_field_docs_come_from_the_comments():
    assert field_docs(_Documented) == {"a": "the comment beside a field wins",
                                       "b": "a doc above a field, on two lines", "c": ""}


def test_every_config_field_has_a_doc():
    missing = [f"{s}.{name}" for s, cls in section_classes().items()
               for name, doc in field_docs(cls).items() if not doc]
    assert not missing, f"add a comment beside these fields in src/moelab/config/: {missing}"


@pytest.mark.parametrize("preset, overrides", [
    ("tiny", []),
    ("small", ["train.steps=7", "data.mixture={prose: 0.7, code: 0.3}",
               "optim.decays=[{start: 5, end: 7}]", "model.conv_sites=q,k"]),
])
def test_described_config_is_yaml_that_loads_back(preset, overrides):
    cfg = load_config(preset, overrides)
    text = describe_config(cfg)
    assert yaml.safe_load(text) == cfg.to_dict()
    assert "  steps: " in text and "# stop step" in text


def run(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as e:
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_moelab_config_prints_the_resolved_config(capsys):
    rc, out, _ = run(["config", "small", "train.steps=7"], capsys)
    assert rc == 0
    assert yaml.safe_load(out)["train"]["steps"] == 7
    line = next(x for x in out.splitlines() if x.strip().startswith("top_k:"))
    assert "# routed experts per token" in line
    rc, _, err = run(["config", "small", "train.step=7"], capsys)
    assert rc == 2 and "train.step: unknown field; did you mean train.steps?" in err


def test_train_help_lists_the_sections_and_points_to_moelab_config(capsys):
    rc, out, _ = run(["train", "--help"], capsys)
    assert rc == 0
    for section in section_classes():
        assert f"\n  {section} " in out
    assert "moelab config PRESET" in out
    assert "extends a preset or another file with `base: NAME_OR_PATH`" in " ".join(out.split())


# ---------------------------------------------------------------------------------------------
# model.vocab_size and the tokenizer


def test_vocab_size_comes_from_the_given_tokenizer(data_dir):  # noqa: F811
    tok = data_dir / "tokenizer-512.json"
    size = vocab_needed(load_tokenizer(tok))
    cfg = load_config("tiny", [f"data.tokenizer={tok}", "model.vocab_size=0"])
    assert with_tokenizer_vocab(cfg).model.vocab_size == size
    agreeing = load_config("tiny", [f"data.tokenizer={tok}", f"model.vocab_size={size}"])
    assert with_tokenizer_vocab(agreeing) == agreeing
    with pytest.raises(ConfigError, match=f"model.vocab_size=2048 disagrees with data.tokenizer "
                       f".*set model.vocab_size={size}, or 0"):
        with_tokenizer_vocab(load_config("tiny", [f"data.tokenizer={tok}"]))


def test_a_data_folder_with_its_own_tokenizer_is_never_given_a_second_one(data_dir, tmp_path):  # noqa: F811
    own = tmp_path / "mine"
    own.mkdir()
    shutil.copy(data_dir / "tokenizer-512.json", own / "tokenizer.json")
    size = vocab_needed(load_tokenizer(own / "tokenizer.json"))
    from_yaml = tmp_path / "c.yaml"  # a YAML without model.vocab_size
    from_yaml.write_text(f"data:\n  data_dir: {own}\n")
    assert with_tokenizer_vocab(load_config(str(from_yaml))).model.vocab_size == size
    with pytest.raises(ConfigError, match="model.vocab_size=2048 disagrees with the data "
                       "folder's tokenizer"):
        with_tokenizer_vocab(load_config("tiny", [f"data.data_dir={own}"]))
    assert sorted(p.name for p in own.iterdir()) == ["tokenizer.json"]  # nothing trained


def test_without_a_tokenizer_the_size_trains_one(tmp_path):
    cfg = load_config("tiny", [f"data.data_dir={tmp_path}"])
    assert with_tokenizer_vocab(cfg) == cfg  # tokenizer-2048.json, trained when missing
    zero = load_config("tiny", [f"data.data_dir={tmp_path}", "model.vocab_size=0"])
    assert with_tokenizer_vocab(zero).model.vocab_size == DEFAULT_VOCAB
