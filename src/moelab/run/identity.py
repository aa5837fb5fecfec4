"""A run's identity: the data and the config it was trained with, compared with what is there now
before anything trains on the run or reads it.

- Data: ``provenance.json`` records the corpus fingerprint, the tokenizer hash (and size) and the
  absolute data folder. A resume or a branch on other data is refused unless the change is
  accepted (``--accept-data-change``), and then it is logged; a run recorded by an older moelab
  has no such record: its data is "unknown", recorded at its next start.
- Tokenizer: the run folder's ``tokenizer.json`` (what generate, eval and export read) must be
  the one recorded.
- Config: each checkpoint's ``meta.json`` holds the config it was trained with; the newest one
  is what ``config.yaml`` is compared with (moelab.train.resume), or recovered from when the
  file was deleted.
"""

from __future__ import annotations

import json
from pathlib import Path

from moelab.config import ConfigError
from moelab.data.prepare import vocab_needed
from moelab.data.tokenizer import tokenizer_sha256
from moelab.run.checkpoint import META_FILE, Checkpointer

PROVENANCE = "provenance.json"
# what names a run's data; a record from before these fields has only the store's fingerprint
DATA_FIELDS = ("corpus_fingerprint", "tokenizer_sha256")
ACCEPT = "--accept-data-change"


def read_provenance(run_dir: Path | str) -> dict:
    """The run's ``provenance.json`` ({} when there is none yet)."""
    path = Path(run_dir) / PROVENANCE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (ValueError, OSError) as e:
        raise ConfigError(f"{path}: unreadable ({e}); restore it from a copy, or delete it to "
                          "record the run's data anew at its next start") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: not a JSON object; restore it from a copy, or delete it to "
                          "record the run's data anew at its next start")
    return data


def data_record(corpus_fingerprint: str, tok, store_fingerprint: str, data_dir: Path) -> dict:
    """What provenance.json records of the data a run trains on."""
    return {"corpus_fingerprint": corpus_fingerprint, "tokenizer_sha256": tokenizer_sha256(tok),
            "tokenizer_vocab": vocab_needed(tok), "data_fingerprint": store_fingerprint,
            "data_dir": str(Path(data_dir).resolve())}


def compared_fields(recorded: dict) -> tuple[str, ...]:
    """The recorded fields that name the data: the corpus and the tokenizer, or for a run of an
    older moelab the store's fingerprint (which hashes both); none for a run without a record."""
    fields = tuple(f for f in DATA_FIELDS if recorded.get(f))
    return fields or (("data_fingerprint",) if recorded.get("data_fingerprint") else ())


def data_changes(recorded: dict, now: dict) -> dict:
    """{field: [recorded, now]} for each recorded field known now that differs."""
    return {f: [recorded[f], now[f]] for f in compared_fields(recorded)
            if now.get(f) and now[f] != recorded[f]}


def _short(v: str) -> str:
    return str(v)[:16]


def data_change_message(run_dir: Path | str, recorded: dict, changes: dict, data_dir) -> str:
    """One line: which fingerprint changed (recorded vs now), where, and the two ways on."""
    what = "; ".join(f"{f.replace('_', ' ')} {_short(a)} recorded, {_short(b)} now"
                     for f, (a, b) in changes.items())
    was = recorded.get("data_dir")
    where = f" (recorded in {was})" if was and str(was) != str(data_dir) else ""
    return (f"{run_dir}: the data in {data_dir} is not what this run trained on{where}: {what}. "
            "Give the run its own data back (the same corpus and tokenizer, or data.data_dir="
            "the folder that holds them), or add " + ACCEPT + " to go on with this data (the "
            "change is logged in metrics.jsonl)")


def check_data(run_dir: Path | str, recorded: dict, now: dict, data_dir, accept: bool) -> dict:
    """The changes of the run's data (see ``data_changes``); refused unless ``accept``."""
    changes = data_changes(recorded, now)
    if changes and not accept:
        raise ConfigError(data_change_message(run_dir, recorded, changes, data_dir))
    return changes


def check_run_tokenizer(run_dir: Path | str, tok, vocab_size: int) -> None:
    """Refuse a run folder whose tokenizer.json is not the one the run trained with: another
    size, or another tokenizer of the same size (its hash against provenance.json)."""
    path = Path(run_dir) / "tokenizer.json"
    rec = read_provenance(run_dir)
    sha, size = tokenizer_sha256(tok), vocab_needed(tok)
    want = rec.get("tokenizer_sha256")
    if sha == want or (not want and size <= vocab_size):  # an older run: the size alone
        return
    recorded = (f"{_short(want)} ({rec.get('tokenizer_vocab', '?')} tokens) recorded in "
                f"{PROVENANCE}" if want else f"a model of {vocab_size} tokens")
    raise ConfigError(f"{path}: not the tokenizer this run trained with: {_short(sha)} ({size} "
                      f"tokens) here, {recorded}; copy the run's own tokenizer back (its data "
                      "folder's tokenizer with that hash)")


def checkpoint_config(run_dir: Path | str) -> tuple[int, dict] | None:
    """(step, config) saved with the newest checkpoint whose meta.json reads; None without
    one. Only the meta is read: a restore checks the checkpoint itself."""
    ckpt = Checkpointer(Path(run_dir) / "checkpoints")
    for step in reversed(ckpt.steps()):
        try:
            meta = json.loads((ckpt.step_dir(step) / META_FILE).read_text())
        except (OSError, ValueError):
            continue  # damaged: a restore skips it too
        if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
            return step, meta["config"]
    return None
