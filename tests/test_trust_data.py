"""Trust in a data folder: `data build` never mixes corpora (identity, --force, the lock, stale
temps, SIGTERM), token files are checked (checksums, ids against the vocabulary), inputs are
read by their type (.json, unknown extensions) and no document is unboundedly long."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import micro_dict, subprocess_env, write_config_yaml
from moelab.data.build import data_lock
from moelab.data.corpus import build_user_corpus, iter_documents
from moelab.data.errors import DataError
from moelab.data.store import TokenStore
from moelab.data.user_docs import MAX_DOC_CHARS, bounded_parts
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
    mine = out / "notes" / ".draft.tmp"  # a file of the user's in the folder: not a build's
    mine.parent.mkdir()
    for p in [*stale, mine]:
        p.write_bytes(b"x" * 100)
    rc, err = _build(capsys, str(b), "--out", str(out), "--force")
    assert rc == 0, err
    assert "training a 300-token" in err and "removed tokenizer-300.json" in err
    assert sha256_file(tok) != first and not any(p.exists() for p in stale)
    assert mine.read_bytes() == b"x" * 100
    assert json.loads((out / "corpus" / "manifest.json").read_text())["sources"] == [str(b)]
    # the same inputs with other text: the tokenizer trained on the old text is not reused
    second = sha256_file(tok)
    _texts(b, "quince")
    rc, err = _build(capsys, str(b), "--out", str(out))
    assert rc == 0 and "the corpus changed" in err and "training a 300-token" in err
    assert "resume one with its own: `moelab resume RUN data.tokenizer=RUN/tokenizer.json" in err
    third = sha256_file(tok)
    assert third != second
    rc, err = _build(capsys, str(b), "--out", str(out))  # unchanged: the tokenizer is kept
    assert rc == 0 and "training a" not in err and sha256_file(tok) == third


@pytest.mark.parametrize("lost", ["train.jsonl", "heldout.jsonl"])
def test_a_lost_corpus_file_is_repaired_by_the_same_build(lost, tmp_path, capsys):
    """verify names the file and the fix; the fix (the same build again) is not refused."""
    a, out = _texts(tmp_path / "a", "apple"), tmp_path / "o"
    assert _build(capsys, str(a), "--out", str(out))[0] == 0
    (out / "corpus" / lost).unlink()
    rc, _, err = run_main(["data", "verify", str(out)], capsys)
    assert rc == 2 and f"{out / 'corpus' / lost}: missing; the corpus is damaged" in err, err
    assert "run the `moelab data build` that made it again" in err
    rc, err = _build(capsys, str(a), "--out", str(out))
    assert rc == 0, err
    assert run_main(["data", "verify", str(out)], capsys)[0] == 0


def test_a_second_build_into_a_locked_folder_fails_at_once(tmp_path, capsys):
    a, out = _texts(tmp_path / "a", "apple"), tmp_path / "o"
    with data_lock(out, "moelab data build first"):  # a build that waited would never return
        rc, err = _build(capsys, str(a), "--out", str(out))
    assert rc == 2
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


def _stalled_build(patch: str, marker: str, *argv: str) -> subprocess.Popen:
    """`moelab data build ARGV` in a child process that ``patch`` (Python source run first)
    stalls: returned once the patch has printed ``marker`` on stderr, so that a signal
    lands at a known moment, not at a guessed one."""
    script = ("import signal, sys, time\n"
              # a process started in the background inherits SIGINT ignored; a terminal's
              # Ctrl-C reaches Python's own handler, as here
              "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
              f"{patch}"
              "from moelab.cli import main\n"
              f"sys.exit(main(['data', 'build', *{list(argv)!r}, '--no-progress']))\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                            env=subprocess_env(PYTHONPATH=str(SRC)))
    said = []
    for line in proc.stderr:
        said.append(line)
        if marker in line:
            return proc
    raise AssertionError(f"the build ended ({proc.wait()}) before {marker}: {''.join(said)}")


def test_sigterm_during_data_build_leaves_no_temp_files(tmp_path):
    """SIGTERM while the corpus is being written: the build ends with its message and exit
    code, and no temp file, half corpus or empty folder is left."""
    src, out = _texts(tmp_path / "src", "kiwi"), tmp_path / "o"
    proc = _stalled_build("import moelab.data.corpus as c\n"
                          "real = c._first_pass\n"
                          "def stalled(docs):\n"
                          "    for i, doc in enumerate(docs):\n"
                          "        if i == 1:\n"
                          "            print('WRITING', file=sys.stderr, flush=True)\n"
                          "            time.sleep(120)  # unhandled signal: the test fails\n"
                          "        yield doc\n"
                          "c._first_pass = lambda docs, *a: real(stalled(docs), *a)\n",
                          "WRITING", str(src), "--out", str(out))
    assert list(out.rglob(".*.tmp")), "the corpus pass writes through a temp file"
    proc.send_signal(signal.SIGTERM)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == 143, rest
    assert rest.strip().splitlines() == ["moelab: terminated (SIGTERM)"]
    # a first build stopped before it wrote anything leaves no folder (no lock, no temp file)
    assert not out.exists()


def test_your_files_never_go_to_the_builtin_folder_nor_train_a_default_run(tmp_path, capsys,
                                                                          monkeypatch):
    from moelab.config import DataConfig
    from moelab.config.errors import ConfigError
    from moelab.data.prepare import prepare_data

    a = _texts(tmp_path / "a", "apple")
    monkeypatch.chdir(tmp_path)
    for out in ("data/builtin", "./data/../data/builtin/", str(tmp_path / "data" / "builtin")):
        rc, err = _build(capsys, str(a), "--out", out, "--force")
        assert rc == 2 and f"--out {out}: the built-in corpus' folder" in err, err
        assert not (tmp_path / "data").exists()
    build_user_corpus([a], tmp_path / "data" / "builtin" / "corpus")  # as an older moelab did
    with pytest.raises(ConfigError, match=r"data.data_dir=data/builtin: the built-in corpus' "
                       r"folder holds a corpus of your own files \(built from .*a\).* `moelab "
                       r"data build --out data/builtin --force`"):
        prepare_data(DataConfig(), 300, verbose=False)
    assert not list((tmp_path / "data" / "builtin").glob("tokenizer*"))


def test_a_rebuild_names_what_differs_order_and_tokenizer(tmp_path, capsys):
    a, b, out = _texts(tmp_path / "a", "apple"), _texts(tmp_path / "b", "pear"), tmp_path / "o"
    assert _build(capsys, str(a), str(b), "--out", str(out))[0] == 0
    rc, err = _build(capsys, str(b), str(a), "--out", str(out))
    assert rc == 2 and f"built from the same inputs in another order ({a}, {b})" in err, err
    own = out / "tokenizer.json"
    first = sha256_file(own)
    rc, _, err = run_main(["data", "build", str(a), str(b), "--out", str(out), "--vocab", "280",
                           "--no-progress"], capsys)
    assert rc == 2 and f"{own}: the tokenizer in use (" in err and f"sha256 {first[:12]})" in err
    assert "--vocab 280 would replace it" in err and "--force" in err
    assert sha256_file(own) == first and not (out / "tokenizer-280.json").exists()
    rc, _, err = run_main(["data", "build", str(a), str(b), "--out", str(out), "--tokenizer",
                           str(out / "tokenizer-300.json"), "--no-progress"], capsys)
    assert rc == 0, err  # the same tokenizer, given by path: nothing changes
    assert _build(capsys, str(a), str(b), "--out", str(out))[0] == 0 and sha256_file(own) == first


def test_a_build_stopped_while_tokenizing_keeps_the_folders_own_tokenizer(tmp_path, capsys,
                                                                         monkeypatch):
    """tokenizer.json (what runs on the folder use) is written before tokenizing and never
    removed by a rebuild that keeps it: a stopped build leaves it, so a run with
    model.vocab_size=0 uses it, never a tokenizer of the default size trained on the side."""
    import moelab.data.prepare as prep
    from moelab.config import DataConfig

    def stopped(*_args, **_kwargs):
        raise KeyboardInterrupt

    src, out = _texts(tmp_path / "src", "lime"), tmp_path / "o"
    own, real = out / "tokenizer.json", prep.store.ensure_token_store
    monkeypatch.setattr(prep.store, "ensure_token_store", stopped)
    assert _build(capsys, str(src), "--out", str(out))[0] == 130  # a first build
    assert sha256_file(own) == sha256_file(out / "tokenizer-300.json")
    monkeypatch.setattr(prep.store, "ensure_token_store", real)
    assert _build(capsys, str(src), "--out", str(out))[0] == 0
    first = sha256_file(own)
    for s in out.glob("tokens-*"):  # a rebuild that tokenizes again
        shutil.rmtree(s)
    monkeypatch.setattr(prep.store, "ensure_token_store", stopped)
    assert _build(capsys, str(src), "--out", str(out))[0] == 130
    assert sha256_file(own) == first
    assert prep.given_tokenizer(DataConfig(data_dir=str(out))) == own


def test_a_build_skips_the_data_folders_inside_its_inputs(tmp_path, capsys):
    src = _texts(tmp_path / "in", "plum")
    assert _build(capsys, str(src / "plum0.txt"), str(src / "plum1.txt"), "--out",
                  str(src / "built"))[0] == 0
    m = build_user_corpus([src], tmp_path / "c")
    ids = {doc["id"] for s in ("train", "heldout") for doc in iter_documents(tmp_path / "c", s)}
    assert ids == {f"in/plum{i}.txt" for i in range(12)}
    assert m["skipped"]["items"] == ["in/built: a moelab data folder (an earlier build's output), "
                                     "not read as input"]


def test_a_run_preparing_its_data_takes_the_folder_lock(data_dir, tmp_path, monkeypatch):
    import threading

    from moelab.config import DataConfig
    from moelab.data.build import release_lock, take_data_lock
    from moelab.data.prepare import PREPARING, prepare_data

    data = DataConfig(data_dir=str(data_dir))

    def never(_seconds):
        raise AssertionError("the preparation waited for a build")

    with data_lock(data_dir, "moelab data build SRC --out DATA --force"), \
            monkeypatch.context() as m:
        m.setattr("moelab.data.prepare.time.sleep", never)  # fails at once, never waits
        with pytest.raises(DataError, match=f"{data_dir} is in use by pid {os.getpid()} .*"
                           r"\(moelab data build SRC --out DATA --force\); wait for it"):
            prepare_data(data, 512, verbose=False)
    fd = take_data_lock(data_dir, f"{PREPARING}: moelab train")  # another run's preparation
    done = []
    waiter = threading.Thread(target=lambda: done.append(prepare_data(data, 512, verbose=False)))
    waiter.start()
    time.sleep(0.5)
    assert waiter.is_alive() and not done  # waits for it, never fails
    release_lock(fd)
    waiter.join(30)
    assert done and done[0].store_dir.is_dir()
    # a folder this process cannot write is read as it is, without the lock
    ro = Path(shutil.copytree(data_dir, tmp_path / "ro", ignore=shutil.ignore_patterns(".lock", ".readers")))
    for p in (ro, *ro.rglob("*")):
        p.chmod(p.stat().st_mode & ~0o222)
    if os.geteuid() == 0:  # root writes anywhere: the probe is told the folder is read-only
        monkeypatch.setattr("moelab.data.prepare.writable", lambda _folder: False)
    try:
        assert prepare_data(DataConfig(data_dir=str(ro)), 512, verbose=False).store_dir.is_dir()
        assert not (ro / ".lock").exists()
    finally:
        for p in (ro, *ro.rglob("*")):
            p.chmod(p.stat().st_mode | 0o200)


def test_ids_above_the_recorded_largest_are_caught_in_every_batch(data_dir, tmp_path):
    from moelab.data.sampler import MixtureSampler, eval_windows
    from moelab.data.store import sampled_sha256

    store = _store_copy(data_dir, tmp_path)
    index = json.loads((store / "index.json").read_text())
    for split in ("train", "heldout"):  # ids >= vocab where the sampled hash does not look
        entry = index["splits"][split]["prose"]
        arr = (store / entry["file"])
        ids = bytearray(arr.read_bytes())
        ids[2: len(ids) - 2] = b"\xff" * (len(ids) - 4)
        arr.write_bytes(bytes(ids))
        entry["sample_sha256"] = sampled_sha256(arr)
    (store / "index.json").write_text(json.dumps(index))
    st = TokenStore(store, vocab_size=512)  # the sampled check misses it
    sampler = MixtureSampler(st, seq_len=16, batch_size=8, mixture={"prose": 1})
    with pytest.raises(DataError, match=f"{store / 'train' / 'prose.bin'}: holds id 65535, above "
                       r"the largest recorded at build \(\d+\) .*moelab data verify"):
        sampler.batch(0)
    with pytest.raises(DataError, match="heldout/prose.bin: holds id 65535"):
        eval_windows(st, "prose", 16, 64)


def test_the_tokenizer_trainer_sees_long_runs_in_pieces(tmp_path, monkeypatch):
    """A text without whitespace is one pre-token per document, and BPE training time grows
    much faster than such a word's length (0.2 MB: 17 s; 2 MB: over 5 minutes); the trainer
    gets runs of at most WORD_CAP characters, and other text whole."""
    from moelab.data import tokenizer as tk

    assert tk.training_pieces("two words") == ["two words"]
    text = "ab " + "x" * (2 * tk.WORD_CAP + 5) + " cd"
    pieces = tk.training_pieces(text)
    assert "".join(pieces) == text and max(map(len, pieces)) == tk.WORD_CAP
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("y" * (3 * tk.WORD_CAP) + " the end\n")
    build_user_corpus([tmp_path / "in"], tmp_path / "corpus")
    seen = [p for batch in tk._text_batches(tmp_path / "corpus") for p in batch]
    assert seen and max(len(w) for p in seen for w in p.split()) <= tk.WORD_CAP


@pytest.mark.parametrize("sig, code, said", [(signal.SIGTERM, 143, "terminated (SIGTERM)"),
                                              (signal.SIGINT, 130, "aborted")])
def test_a_signal_during_tokenizer_training_ends_the_build_with_its_message(
        tmp_path, sig, code, said):
    """The trainer runs in a worker thread (native code would hold the signal until it
    returns); the signal ends the build at once, as anywhere else: a message, its exit code,
    the lock released, no tokenizer written."""
    src, out = _texts(tmp_path / "src", "fig"), tmp_path / "o"
    proc = _stalled_build("import moelab.data.tokenizer as t\n"
                          "def slow(_corpus):\n"
                          "    print('TRAINING', file=sys.stderr, flush=True)\n"
                          "    time.sleep(120)  # unhandled signal: the test fails\n"
                          "    yield ['x']\n"
                          "t._text_batches = slow\n",
                          "TRAINING", str(src), "--out", str(out), "--vocab", "300")
    proc.send_signal(sig)
    rest = proc.stderr.read()
    assert proc.wait(timeout=120) == code, rest
    assert rest.strip().splitlines()[-1] == f"moelab: {said}"
    assert not (out / "tokenizer-300.json").exists() and not list(out.rglob(".*.tmp"))
    assert (out / ".lock").read_text() == ""  # released


def test_a_build_refuses_the_folder_a_run_trains_on(data_dir, tmp_path, capsys):
    from contextlib import ExitStack

    from moelab.config import DataConfig
    from moelab.data.build import READERS, check_no_readers, live_readers
    from moelab.data.prepare import prepare_data

    src = _texts(tmp_path / "src", "plum")
    out = tmp_path / "o"
    assert _build(capsys, str(src), "--out", str(out))[0] == 0
    tok = sha256_file(out / "tokenizer.json")
    with ExitStack() as reading:  # what a training run holds for its whole life
        prepare_data(DataConfig(data_dir=str(out)), 0, verbose=False, hold=reading)
        assert [h["pid"] for h in live_readers(out)] == [os.getpid()]
        rc, err = _build(capsys, str(src), "--out", str(out), "--force")
        assert rc == 2 and f"{out} is the data of a run training now: pid {os.getpid()}" in err
        assert "wait for it to end" in err and "another --out" in err
    assert sha256_file(out / "tokenizer.json") == tok  # nothing was touched
    assert live_readers(out) == [] and not list((out / READERS).iterdir())
    # the mark of a run killed with -9 (no flock held any more) is not a reader
    here = socket.gethostname()
    (out / READERS / "gone.json").write_text(json.dumps({"pid": 2**22 + 7, "host": here}))
    (out / READERS / "gone2.json").write_text("{}")
    check_no_readers(out)
    assert not list((out / READERS).iterdir())
    # one on another host cannot be told gone: named, with what to do if it is
    (out / READERS / "far.json").write_text(json.dumps({"pid": 5, "host": "elsewhere"}))
    with pytest.raises(DataError, match=r"pid 5 on elsewhere .*\(if it is gone, delete .*far"):
        check_no_readers(out)
    (out / READERS / "far.json").unlink()
    # a run's setup holds the mark (train() closes it when the run ends)
    from helpers import micro_config
    from moelab.train.setup import setup_run

    with ExitStack() as reading:
        run, _ = setup_run(micro_config(data_dir), tmp_path / "run", verbose=False, hold=reading)
        run.trackers.close()
        run.ckpt.close()
        assert [h["pid"] for h in live_readers(data_dir)] == [os.getpid()]
    assert live_readers(data_dir) == []


def test_a_failed_first_build_through_dotdot_leaves_no_folder(tmp_path, capsys, monkeypatch):
    """`--out x/../y/z`: a failed first build left the folder x, made on the way (the kernel
    needs x to step back out of it) and never removed."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    monkeypatch.chdir(tmp_path)
    rc, err = _build(capsys, "in", "--out", "x/../y/z")
    assert rc == 2 and "no usable documents" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    _texts(tmp_path / "in", "fig")
    assert _build(capsys, "in", "--out", "x/../y/z")[0] == 0
    assert (tmp_path / "y" / "z" / "tokenizer.json").is_file() and not (tmp_path / "x").exists()


def test_a_run_whose_source_fails_leaves_no_data_folder(tmp_path):
    """A run building data.data_dir from data.source (unreachable, or nothing usable) left the
    folder it made, holding only its lock file."""
    from moelab.config import DataConfig
    from moelab.data.prepare import prepare_data

    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "empty.txt").write_text("")
    for source in ("in", "absent"):
        dcfg = DataConfig(data_dir=str(tmp_path / "x" / "d"), source=str(tmp_path / source))
        with pytest.raises(DataError, match="no usable documents|not found"):
            prepare_data(dcfg, 300, verbose=False)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]


def test_a_first_build_stopped_before_its_tokenizer_is_not_trained_on(tmp_path, capsys,
                                                                      monkeypatch):
    """A first build stopped while training its tokenizer left the corpus without
    tokenizer.json; a run on the folder then trained a tokenizer of the default size on the
    side and trained on it. It is refused, naming the build that finishes the folder."""
    import moelab.data.tokenizer as tk
    from moelab.config import config_from_dict
    from moelab.data.prepare import with_tokenizer_vocab

    def stopped(_corpus):  # Ctrl-C while the tokenizer trains
        raise KeyboardInterrupt
        yield

    src, out, run = _texts(tmp_path / "src", "lime"), tmp_path / "o", tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(tk, "_text_batches", stopped)
        assert _build(capsys, str(src), "--out", str(out))[0] == 130
    assert (out / "corpus" / "manifest.json").is_file() and not list(out.glob("tokenizer*"))
    cfg = micro_dict(out, model={"vocab_size": 0})
    rc, _, err = run_main(["train", str(write_config_yaml(tmp_path / "m.yaml", cfg)),
                           "--run-dir", str(run)], capsys)
    assert rc == 2 and f"{out}: its `moelab data build` stopped before writing" in err, err
    assert f"data build {src} --out {out} --vocab 300 --no-progress" in err
    assert not run.exists() and not list(out.glob("tokenizer*")), "nothing trained"
    from moelab.data.build import check_finished, take_data_lock
    from moelab.data.errors import DataError
    from moelab.locks import release_lock

    fd = take_data_lock(out, "moelab data build (still running)")  # a build writing it now
    try:
        with pytest.raises(DataError, match=r"moelab data build \(still running\)"):
            check_finished(out)  # named as the build that holds it, not as one that stopped
    finally:
        release_lock(fd)
    assert _build(capsys, str(src), "--out", str(out))[0] == 0  # the same build finishes it
    assert with_tokenizer_vocab(config_from_dict(cfg)).model.vocab_size < 300


def test_one_function_removes_a_killed_write_s_temp_files(tmp_path, monkeypatch):
    """The data build and a run's start each had their own glob for them."""
    from moelab.data import build
    from moelab.tempfiles import remove_temp_files
    from moelab.train import setup

    for name in (".config.yaml.ab12.tmp", ".docs.x1.tmp", ".x.tmp", "mine.tmp", ".config.yaml"):
        (tmp_path / name).write_text("x")
    (tmp_path / ".a.b.tmp").mkdir()
    assert remove_temp_files(tmp_path, ("config.yaml", "summary.json")) == 1
    assert remove_temp_files(tmp_path) == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == [".a.b.tmp", ".config.yaml", "mine.tmp"]
    seen = []
    monkeypatch.setattr(build, "remove_temp_files", lambda d, names=None: seen.append(d) or 0)
    (tmp_path / "corpus").mkdir()
    build.remove_stale_temps(tmp_path)
    assert seen == [tmp_path, tmp_path / "corpus"]
    assert setup.remove_temp_files is remove_temp_files
