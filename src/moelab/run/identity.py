"""A run's identity: the data and the config it was trained with, compared with what is there now
before anything trains on the run or reads it.

- Data: ``provenance.json`` records the corpus fingerprint, the tokenizer hash (and size) and the
  absolute data folder. A resume or a branch on another corpus is refused unless the change
  is accepted (``--accept-data-change``), and then it is logged; on another tokenizer always
  (its ids would mean other text to the model): ``data.tokenizer`` gives it the run's own. A
  run recorded by an older moelab has no such record: its data is "unknown", recorded at its
  next start.
- Tokenizer: each checkpoint's ``meta.json`` also records the tokenizer it was trained with; the
  run folder's ``tokenizer.json`` (what generate, eval and export read) must be that one (or,
  for a checkpoint without it, the one in ``provenance.json``). Where ``provenance.json`` lost
  its record, the newest meta.json (else the run's tokenizer.json copy) stands in for it.
- Vocabulary: a resume keeps the model's size, so data whose tokenizer has another is refused.
- Config: each checkpoint's ``meta.json`` holds the config it was trained with; the newest one
  is what ``config.yaml`` is compared with (moelab.train.resume), or recovered from when the
  file was deleted.
"""

from __future__ import annotations

import json
from pathlib import Path

from moelab.config import ConfigError, RunConfig, config_from_dict, load_run_config
from moelab.config.io import apply_overrides
from moelab.data.errors import DataError
from moelab.data.prepare import vocab_needed
from moelab.data.tokenizer import load_tokenizer, tokenizer_sha256
from moelab.run.checkpoint import META_FILE, Checkpointer
from moelab.util import read_json_object

PROVENANCE = "provenance.json"
# what names a run's data; a record from before these fields has only the store's fingerprint
DATA_FIELDS = ("corpus_fingerprint", "tokenizer_sha256")
ACCEPT = "--accept-data-change"


def read_provenance(run_dir: Path | str) -> dict:
    """The run's ``provenance.json`` ({} when there is none yet)."""
    return read_json_object(Path(run_dir) / PROVENANCE, "restore it from a copy, or delete "
                            "it to record the run's data anew at its next start",
                            ConfigError) or {}


def tokenizer_record(tok) -> dict:
    """What names a tokenizer in provenance.json and in each checkpoint's meta.json."""
    return {"tokenizer_sha256": tokenizer_sha256(tok), "tokenizer_vocab": vocab_needed(tok)}


def data_record(corpus_fingerprint: str, tok, store_fingerprint: str, data_dir: Path) -> dict:
    """What provenance.json records of the data a run trains on."""
    return {"corpus_fingerprint": corpus_fingerprint, **tokenizer_record(tok),
            "data_fingerprint": store_fingerprint, "data_dir": str(Path(data_dir).resolve())}


def _file_sha(path: Path) -> str | None:
    """The tokenizer hash of ``path``; None when it is missing or no tokenizer."""
    try:
        return tokenizer_sha256(load_tokenizer(path)) if path.is_file() else None
    except DataError:
        return None


def run_data_record(run_dir: Path | str) -> dict:
    """The run's record of its data: provenance.json; where that names no tokenizer (deleted,
    or a run of an older moelab), the newest checkpoint's meta.json, else the run's own
    tokenizer.json copy, names it ("tokenizer_from" says which)."""
    rec = read_provenance(run_dir)
    if rec.get("tokenizer_sha256"):
        return rec
    got = checkpoint_meta(run_dir)
    if got and got[1].get("tokenizer_sha256"):
        return {**rec, "tokenizer_sha256": got[1]["tokenizer_sha256"],
                "tokenizer_from": f"the {META_FILE} of step {got[0]}"}
    sha = _file_sha(Path(run_dir) / "tokenizer.json")
    return {**rec, "tokenizer_sha256": sha, "tokenizer_from": "its tokenizer.json"} if sha else rec


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


def changes_text(changes: dict) -> str:
    """Which fingerprints changed, recorded vs now, shortened."""
    return "; ".join(f"{f.replace('_', ' ')} {_short(a)} recorded, {_short(b)} now"
                     for f, (a, b) in changes.items())


def _changed(run_dir: Path | str, recorded: dict, changes: dict, data_dir) -> str:
    """Which fingerprint changed (recorded vs now), and where."""
    what = changes_text(changes)
    if recorded.get("tokenizer_from"):
        what += f" (the run's record: {recorded['tokenizer_from']})"
    was = recorded.get("data_dir")
    where = f" (recorded in {was})" if was and str(was) != str(data_dir) else ""
    return f"{run_dir}: the data in {data_dir} is not what this run trained on{where}: {what}"


def data_change_message(run_dir: Path | str, recorded: dict, changes: dict, data_dir) -> str:
    """One line: which fingerprint changed (recorded vs now), where, and the two ways on."""
    return (_changed(run_dir, recorded, changes, data_dir) + ". Give the run its own data "
            "back (the same corpus and tokenizer, or data.data_dir=the folder that holds "
            "them), or add " + ACCEPT + " to go on with this data (the "
            "change is logged in metrics.jsonl)")


def _own_tokenizer(run_dir: Path | str, sha: str, data_dir, resume_args: str = "") -> str:
    """Where the tokenizer with hash ``sha`` (the run's) is: the run's tokenizer.json (with the
    resume that gives it, ``resume_args`` before it), else what ``_holder`` finds."""
    own = Path(run_dir) / "tokenizer.json"
    if _file_sha(own) == sha:
        return (f"data.tokenizer={own} (`moelab resume {run_dir}{resume_args} "
                f"data.tokenizer={own}`)")
    return f"data.tokenizer=the tokenizer.json with sha256 {sha}" + _holder(run_dir, sha,
                                                                          data_dir)


def tokenizer_change_message(run_dir: Path | str, recorded: dict, changes: dict, data_dir,
                             tokenizer_file) -> str:
    """The run's data has another tokenizer: never accepted (its ids would mean other text to
    the model, even at the same size); which file, and the two ways on."""
    path = Path(tokenizer_file) if tokenizer_file else None
    size = vocab_needed(load_tokenizer(path)) if path and path.is_file() else None
    was = recorded.get("tokenizer_vocab")
    sizes = f" ({size} tokens; the run's: {was})" if size and was else ""
    # the resume shown keeps the data folder asked for (not the recorded one) and the corpus
    # change this data brings, so it does what the refused command meant
    moved = recorded.get("data_dir") and str(recorded["data_dir"]) != str(data_dir)
    corpus = len(changes) > 1
    args = (f" data.data_dir={data_dir}" if moved and data_dir else "") + (
        f" {ACCEPT}" if corpus else "")
    own = _own_tokenizer(run_dir, changes["tokenizer_sha256"][0], data_dir, args)
    return (f"{_changed(run_dir, recorded, changes, data_dir)}. The tokenizer cannot change, "
            f"not even with {ACCEPT}: {path or 'the data folder tokenizer'}{sizes} would give "
            "the model's token ids other text. Tokenize this data with the run's own "
            "tokenizer" + (f" (and {ACCEPT} for the corpus change)" if corpus else "")
            + f": {own}; or train this data in a new run (another --run-dir)")


def check_data(run_dir: Path | str, recorded: dict, now: dict, data_dir, accept: bool,
               tokenizer_file=None) -> dict:
    """The changes of the run's data (see ``data_changes``); refused unless ``accept``, and a
    tokenizer change always (``tokenizer_file``, else ``now["tokenizer_file"]``, names it)."""
    changes = data_changes(recorded, now)
    if "tokenizer_sha256" in changes:
        raise ConfigError(tokenizer_change_message(
            run_dir, recorded, changes, data_dir, tokenizer_file or now.get("tokenizer_file")))
    if changes and not accept:
        raise ConfigError(data_change_message(run_dir, recorded, changes, data_dir))
    return changes


def check_data_found(run_dir: Path | str, recorded: dict, now: dict, data_dir) -> None:
    """Refuse a run with a data record whose data folder holds no corpus (moved or deleted)
    before anything is built there: the built-in corpus would never be the run's."""
    if compared_fields(recorded) and "corpus_fingerprint" not in now:
        was = recorded.get("data_dir") or data_dir
        raise ConfigError(f"data.data_dir={data_dir}: holds no corpus, so it is not the data "
                          f"{run_dir} trained on (recorded in {was}); restore that folder, or "
                          f"point data.data_dir at where it moved (`moelab resume {run_dir} "
                          "data.data_dir=NEW`), whose data is then checked against the record")


def check_vocab_kept(run_dir: Path | str, vocab_size: int, tok_path: Path | None) -> None:
    """A resume keeps the model's vocabulary: refuse a tokenizer of another size (an accepted
    data change may bring one)."""
    if tok_path is None or not vocab_size:
        return
    size = vocab_needed(load_tokenizer(tok_path))
    if size != vocab_size:
        raise ConfigError(f"{tok_path}: {size} tokens, but the model of {run_dir} has "
                          f"{vocab_size}: a model's vocabulary cannot change on resume; train "
                          "this data in a new run (another --run-dir), or point data.tokenizer "
                          f"at the run's own tokenizer ({Path(run_dir) / 'tokenizer.json'})")


def trained_tokenizer(run_dir: Path | str, step: int | None = None) -> tuple[dict, str]:
    """(the tokenizer record, where it is) the run's checkpoint ``step`` (the newest by
    default) was trained with: its meta.json's, else provenance.json's (a checkpoint of an
    older moelab); ({}, "") without either. The meta wins: it records that checkpoint's
    weights, and provenance.json names the data from the latest start on."""
    got = checkpoint_meta(run_dir, step)
    if got and got[1].get("tokenizer_sha256"):
        return got[1], f"the {META_FILE} of step {got[0]}"
    rec = read_provenance(run_dir)
    return (rec, PROVENANCE) if rec.get("tokenizer_sha256") else ({}, "")


def check_run_tokenizer(run_dir: Path | str, tok, vocab_size: int, step: int | None = None,
                        data_dir=None) -> None:
    """Refuse a run folder whose tokenizer.json is not the one checkpoint ``step`` trained
    with: another size, or another tokenizer of the same size (its recorded hash)."""
    path = Path(run_dir) / "tokenizer.json"
    rec, where = trained_tokenizer(run_dir, step)
    sha, size = tokenizer_sha256(tok), vocab_needed(tok)
    want = rec.get("tokenizer_sha256")
    if sha == want or (not want and size <= vocab_size):  # an older run: the size alone
        return
    if not want:
        raise ConfigError(f"{path}: not the tokenizer this run trained with: {_short(sha)} "
                          f"({size} tokens) here, a model of {vocab_size} tokens; copy the "
                          "run's own tokenizer back (its data folder's tokenizer)")
    raise ConfigError(f"{path}: not the tokenizer this run trained with: {_short(sha)} ({size} "
                      f"tokens) here, {_short(want)} ({rec.get('tokenizer_vocab', '?')} tokens) "
                      f"recorded in {where}; copy the run's own tokenizer back"
                      + _holder(run_dir, want, data_dir))


def _holder(run_dir: Path | str, sha: str, data_dir) -> str:
    """Where the tokenizer with hash ``sha`` is: a tokenizer*.json of the run's recorded data
    folder (else ``data_dir``), or that none there has it."""
    folder = read_provenance(run_dir).get("data_dir") or data_dir
    if not folder:
        return " (its data folder's tokenizer with that hash)"
    found = next((p for p in sorted(Path(folder).glob("tokenizer*.json")) if _file_sha(p) == sha),
                 None)
    return (f": {found} holds it" if found else f"; {folder} holds none with that hash, find "
            "the tokenizer.json that has it")


def missing_tokenizer_message(run_dir: Path | str, step: int | None, data_dir) -> str:
    """The run's tokenizer.json is gone: which one to copy back (its recorded hash) and, when
    the recorded data folder (else ``data_dir``) holds it, where."""
    path = Path(run_dir) / "tokenizer.json"
    rec, where = trained_tokenizer(run_dir, step)
    want = rec.get("tokenizer_sha256")
    if not want:
        return (f"{path}: not found; copy back the tokenizer this run trained with (the "
                f"tokenizer.json of its data folder {data_dir})")
    return (f"{path}: not found; copy back the tokenizer this run trained with, sha256 {want} "
            f"({where})" + _holder(run_dir, want, data_dir))


def checkpoint_meta(run_dir: Path | str, step: int | None = None) -> tuple[int, dict] | None:
    """(step, meta) of checkpoint ``step`` or, by default, of the newest whose meta.json reads
    and holds its config; None without one. Only the meta is read: a restore checks the
    checkpoint itself."""
    ckpt = Checkpointer(Path(run_dir) / "checkpoints")
    for s in reversed(ckpt.steps()) if step is None else [step]:
        try:
            meta = json.loads((ckpt.step_dir(s) / META_FILE).read_text())
        except (OSError, ValueError):
            continue  # damaged or missing: a restore skips or names it
        if isinstance(meta, dict) and isinstance(meta.get("config"), dict):
            return s, meta
    return None


def checkpoint_config(run_dir: Path | str) -> tuple[int, dict] | None:
    """(step, config) saved with the newest checkpoint whose meta.json reads; None without
    one."""
    got = checkpoint_meta(run_dir)
    return (got[0], got[1]["config"]) if got else None


def run_config_or_checkpoint(run_dir: Path | str, overrides: list[str] | None = None,
                             step: int | None = None) -> tuple[RunConfig, int | None]:
    """(the run's config.yaml with ``overrides``, None); when the file was deleted but
    checkpoints remain, (the config checkpoint ``step``, the newest by default, was trained
    with, that step): never a different one. Neither: ``load_run_config``'s error."""
    run_dir = Path(run_dir)
    got = None if (run_dir / "config.yaml").is_file() else checkpoint_meta(run_dir, step)
    if got is None:
        return load_run_config(run_dir, overrides), None
    return config_from_dict(apply_overrides(got[1]["config"], overrides or [])), got[0]
