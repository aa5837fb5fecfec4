"""Trust in a data folder: `data build` never mixes corpora (identity, --force, the lock, stale
temps, SIGTERM), token files are checked (checksums, ids against the vocabulary), inputs are
read by their type (.json, unknown extensions) and no document is unboundedly long."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import subprocess_env
from moelab.data.build import data_lock
from moelab.data.corpus import MAX_DOC_CHARS, bounded_parts, build_user_corpus, iter_documents
from moelab.data.errors import DataError
from moelab.data.store import TokenStore
from moelab.util import sha256_file
from test_cli import run_main

SRC = Path(__file__).resolve().parents[1] / "src"


def _texts(folder: Path, word: str, n: int = 12) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"{word}{i}.txt").write_text(f"{word} {i} " + " ".join([word] * 30) + "\n")
    return folder


def _build(capsys, *argv: str) -> tuple[int, str]:
    rc, _, err = run_main(["data", "build", *argv, "--vocab", "300", "--no-progress"], capsys)
    return rc, err


def test_a_rebuild_from_other_inputs_is_refused_and_force_retrains(tmp_path, capsys):
    a, b, out = _texts(tmp_path / "a", "apple"), _texts(tmp_path / "b", "pear"), tmp_path / "o"
    assert _build(capsys, str(a), "--out", str(out))[0] == 0
    tok = out / "tokenizer-300.json"
    first = sha256_file(tok)
    rc, err = _build(capsys, str(b), "--out", str(out))
    assert rc == 2 and f"{out}: its corpus was built from {a}" in err and "--force" in err
    assert sha256_file(tok) == first  # nothing touched
    # a killed build's temp files are removed by the next one (under the lock)
    stale = [out / "corpus" / ".docs.x1.tmp", next(out.glob("tokens-*")) / "train" / ".a.bin.x.tmp"]
    for p in stale:
        p.write_bytes(b"x" * 100)
    rc, err = _build(capsys, str(b), "--out", str(out), "--force")
    assert rc == 0, err
    assert "training a 300-token" in err and "removed tokenizer-300.json" in err
    assert sha256_file(tok) != first and not any(p.exists() for p in stale)
    assert json.loads((out / "corpus" / "manifest.json").read_text())["sources"] == [str(b)]
    # the same inputs with other text: the tokenizer trained on the old text is not reused
    second = sha256_file(tok)
    _texts(b, "quince")
    rc, err = _build(capsys, str(b), "--out", str(out))
    assert rc == 0 and "the corpus changed" in err and "training a 300-token" in err
    third = sha256_file(tok)
    assert third != second
    rc, err = _build(capsys, str(b), "--out", str(out))  # unchanged: the tokenizer is kept
    assert rc == 0 and "training a" not in err and sha256_file(tok) == third


def test_a_second_build_into_a_locked_folder_fails_at_once(tmp_path, capsys):
    a, out = _texts(tmp_path / "a", "apple"), tmp_path / "o"
    with data_lock(out, "moelab data build first"):
        t = time.perf_counter()
        rc, err = _build(capsys, str(a), "--out", str(out))
    assert rc == 2 and time.perf_counter() - t < 5
    assert f"{out} is in use by pid {os.getpid()}" in err and "(moelab data build first)" in err
    assert not (out / "corpus").exists()
    assert _build(capsys, str(a), "--out", str(out))[0] == 0  # released


def _store_copy(data_dir: Path, tmp_path: Path) -> Path:
    store = next(data_dir.glob("tokens-*"))
    return Path(shutil.copytree(store, tmp_path / store.name))


def test_token_files_are_checked_at_open_and_in_full_by_verify(data_dir, tmp_path, capsys):
    store = _store_copy(data_dir, tmp_path)
    rc, out, _ = run_main(["data", "verify", str(store)], capsys)
    assert rc == 0 and f"ok: {store}" in out
    rc, out, _ = run_main(["data", "verify", str(data_dir)], capsys)
    assert rc == 0 and f"ok: {data_dir / 'corpus'}" in out
    victim = store / "train" / "prose.bin"
    victim.write_bytes(os.urandom(victim.stat().st_size))  # noise, in place, same size
    with pytest.raises(DataError, match=f"{victim}: contents differ .* delete {store} and run "
                       "`moelab data build`"):
        TokenStore(store)
    rc, _, err = run_main(["data", "verify", str(store)], capsys)
    assert rc == 2 and f"moelab: error: {victim}" in err and len(err.strip().splitlines()) == 1


def test_token_ids_are_checked_against_the_vocabulary(data_dir):
    store = TokenStore(next(data_dir.glob("tokens-*")), vocab_size=512)
    top = store.max_id()
    assert 256 < top < 512
    with pytest.raises(DataError, match=f"ids up to {top}, but model.vocab_size=300; set "
                       f"model.vocab_size to at least {top + 1}"):
        TokenStore(store.dir, vocab_size=300)


def test_json_inputs_and_unknown_extensions(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    (d / "lines.json").write_text('{"text": "first line doc"}\n{"text": "second line doc"}\n')
    (d / "array.json").write_text(json.dumps([{"text": "array doc a"}, {"text": "array doc b"}],
                                             indent=1))
    (d / "one.json").write_text(json.dumps({"text": "a single record", "title": "t"}, indent=1))
    (d / "sheet.csv").write_text("text\nnot read as prose\n")
    m = build_user_corpus([d], tmp_path / "c", domain="x")
    texts = {doc["text"] for s in ("train", "heldout") for doc in iter_documents(tmp_path / "c", s)}
    assert texts == {"first line doc", "second line doc", "array doc a", "array doc b",
                     "a single record"}
    assert not any("{" in t for t in texts)  # no file became one document of raw JSON
    assert m["skipped"]["items"] == ["in/sheet.csv: unknown file type '.csv'"]
    with pytest.raises(DataError, match=r"input .*sheet.csv: unknown file type '.csv' "
                       r"\(known: .txt, .*\.jsonl, \.json, \.parquet"):
        build_user_corpus([d / "sheet.csv"], tmp_path / "c2")


def test_long_texts_become_bounded_documents(tmp_path):
    cases = {"a" * 10 + "\n\n" + "b" * 10 + "\n" + "c" * 10: 3,  # paragraph, then line breaks
             "word " * 20: 10,  # spaces
             "x" * 25: 3}  # one giant word: hard cuts
    for text, n in cases.items():
        parts = list(bounded_parts(text, limit=12))
        assert "".join(parts) == text and len(parts) == n and max(map(len, parts)) <= 12
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "one_line.txt").write_text("tok " * (MAX_DOC_CHARS // 2))  # 2 MAX
    build_user_corpus([tmp_path / "in"], tmp_path / "c")
    docs = [doc for s in ("train", "heldout") for doc in iter_documents(tmp_path / "c", s)]
    assert len(docs) >= 2 and max(len(doc["text"]) for doc in docs) <= MAX_DOC_CHARS
    assert docs[0]["id"].startswith("in/one_line.txt part ")


def test_sigterm_during_data_build_leaves_no_temp_files(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    line = "some words to read and write again " * 600 + "\n"
    for i in range(500):  # ~10 MB: the corpus pass runs for a while
        (src / f"f{i:04d}.txt").write_text(line)
    out = tmp_path / "o"
    proc = subprocess.Popen([sys.executable, "-m", "moelab.cli", "data", "build", str(src),
                             "--out", str(out), "--no-progress"], stderr=subprocess.PIPE,
                            text=True, env=subprocess_env(PYTHONPATH=str(SRC)))
    deadline = time.time() + 60
    while not list(out.rglob(".*.tmp")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.01)
    assert list(out.rglob(".*.tmp")), "the build never wrote a temp file"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "Traceback" not in err
    assert proc.returncode == 143 and err.strip().splitlines() == ["moelab: terminated (SIGTERM)"]
    assert not list(out.rglob(".*.tmp")) and not list(out.rglob(".hf-cache.*"))
    assert not (out / "corpus" / "manifest.json").exists()
