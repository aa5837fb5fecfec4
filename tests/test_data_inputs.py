"""Inputs a user brings to `data build` and a run: a vocabulary size the tokenizer trainer cannot
reserve, a tokenizer of their own that cannot encode text, a folder datasets' save_to_disk
wrote given to another format, and JSON lines with a byte-order mark. Each is refused (or read)
before any tokenizer is trained and without an XLA compile."""

from __future__ import annotations

import json
import os

os.environ["HF_DATASETS_OFFLINE"] = "1"  # read before datasets is imported: no network here

import pytest  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from moelab.data import tokenizer  # noqa: E402
from moelab.data.corpus import build_user_corpus, iter_documents  # noqa: E402
from test_cli import run_main  # noqa: E402


class Reached(Exception):
    """Raised where a refused input must never get to."""


@pytest.fixture
def no_tokenizer_training(monkeypatch):
    """Training a tokenizer fails the test at once: a refused size must never get there (a
    size of 1e9 aborted the whole process on a failed 70 GB allocation)."""
    def trainer(*_args, **_kw):
        raise Reached("a tokenizer was trained")

    monkeypatch.setattr(tokenizer.trainers, "BpeTrainer", trainer)


def _texts(folder, n: int = 3):
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"a{i}.txt").write_text(f"document {i} of a few plain words\n")
    return folder


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moelab: error: "), err
    return lines[0]


@pytest.mark.parametrize("argv, phrase", [
    (["data", "build", "{d}/txt", "--out", "{d}/o", "--vocab", "1000000000"],
     "--vocab 1000000000: must be <= 16,777,216"),
    (["train", "tiny", "model.vocab_size=1000000000", "train.memory_check=false",
      "data.source={d}/txt", "data.data_dir={d}/o", "--run-dir", "{d}/run"],
     "model.vocab_size=1000000000: a new tokenizer must be <= 16,777,216"),
])
def test_a_vocabulary_too_large_to_train_is_refused(argv, phrase, tmp_path, capsys,
                                                     no_tokenizer_training):
    _texts(tmp_path / "txt")
    rc, _, err = run_main([a.format(d=tmp_path) for a in argv], capsys)
    assert rc == 2, err
    assert phrase.format(d=tmp_path) in _one_error_line(err)
    assert not (tmp_path / "o").exists() and not (tmp_path / "run").exists()


def test_a_tokenizer_that_cannot_encode_text_is_refused_before_the_build(tmp_path, capsys):
    tok = Tokenizer(models.WordLevel({"</s>": 0, "document": 1}))  # no unknown token
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "words.json"))
    _texts(tmp_path / "txt")
    rc, _, err = run_main(["data", "build", str(tmp_path / "txt"), "--out", str(tmp_path / "o"),
                           "--tokenizer", str(tmp_path / "words.json"), "--no-progress"], capsys)
    assert rc == 2, err
    line = _one_error_line(err)
    assert f"tokenizer {tmp_path / 'words.json'}: cannot encode ordinary text" in line
    assert "Missing [UNK] token" in line and "leave --tokenizer (data.tokenizer) out" in line
    assert not (tmp_path / "o").exists()  # refused before a corpus was written


def test_a_save_to_disk_folder_is_read_only_as_hf_disk(tmp_path, capsys):
    datasets = pytest.importorskip("datasets")
    saved = tmp_path / "nest" / "saved"
    datasets.Dataset.from_dict({"text": ["one saved row", "another"]}).save_to_disk(str(saved))
    _texts(tmp_path / "nest", 2)
    capsys.readouterr()  # datasets' own progress bars
    for fmt in ("files", "hf-files"):  # named: its metadata was read as records before
        rc, _, err = run_main(["data", "build", str(saved), "--out", str(tmp_path / "o"),
                               "--format", fmt], capsys)
        assert rc == 2, err
        assert (f"input {saved}: a folder datasets' save_to_disk wrote; read it with --format "
                "hf-disk (data.format=hf-disk in a config)") in _one_error_line(err)
    manifest = build_user_corpus([tmp_path / "nest"], tmp_path / "c" / "corpus")  # inside one
    assert manifest["skipped"]["items"] == [
        "nest/saved: a folder datasets' save_to_disk wrote, not read as text"]
    docs = [d["id"] for s in ("train", "heldout") for d in iter_documents(tmp_path / "c/corpus", s)]
    assert sorted(docs) == ["nest/a0.txt", "nest/a1.txt"]
    err = capsys.readouterr().err
    assert "read a folder datasets' save_to_disk wrote with --format hf-disk" in err


def test_json_lines_with_a_byte_order_mark(tmp_path):
    d = tmp_path / "in"
    d.mkdir()
    lines = "".join(json.dumps({"text": f"record {i} of the file"}) + "\r\n" for i in range(2))
    (d / "utf8.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())  # as Windows tools write
    (d / "utf8.json").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    (d / "wide.jsonl").write_bytes(lines.encode("utf-16"))
    (d / "wide.json").write_bytes(json.dumps([{"text": "an array"}]).encode("utf-16"))
    manifest = build_user_corpus([d], tmp_path / "corpus")
    docs = {doc["id"]: doc["text"] for s in ("train", "heldout")
            for doc in iter_documents(tmp_path / "corpus", s)}
    assert docs["in/utf8.jsonl line 1"] == "record 0 of the file"  # its first record kept
    assert docs["in/utf8.json line 1"] == "record 0 of the file"
    assert len(docs) == 4
    assert sorted(manifest["skipped"]["items"]) == [  # named, not line after line of "binary"
        "in/wide.json: UTF-16 text (not UTF-8)", "in/wide.jsonl: UTF-16 text (not UTF-8)"]


def test_a_build_holding_out_every_document_is_refused(tmp_path, capsys):
    txt = _texts(tmp_path / "txt", 6)
    out = tmp_path / "o"
    argv = ["data", "build", str(txt), "--out", str(out), "--vocab", "300", "--no-progress"]
    assert run_main(argv, capsys)[0] == 0
    manifest = (out / "corpus" / "manifest.json").read_text()
    for extra, made in ((["--force"], out), ([], tmp_path / "new")):
        args = [*argv[:4], str(made), *argv[5:], *extra, "--heldout", "0.999"]
        rc, _, err = run_main(args, capsys)
        assert rc == 2, err  # was built: a tokenizer of bytes only, and nothing to train on
        assert (f"--heldout 0.999: every document of {txt} is held out, leaving none to train "
                "a tokenizer and a model on; give a smaller --heldout") in _one_error_line(err)
    assert not (tmp_path / "new").exists()
    assert (out / "corpus" / "manifest.json").read_text() == manifest  # the old corpus stays


def test_links_to_folders_are_read_once(tmp_path):
    _texts(tmp_path / "kept" / "prose", 2)  # where the text is kept
    inp = _texts(tmp_path / "in", 1)
    (inp / "prose").symlink_to(tmp_path / "kept" / "prose")  # was read as nothing, unsaid
    (inp / "again").symlink_to(tmp_path / "kept" / "prose")
    (inp / "loop").symlink_to(inp)
    manifest = build_user_corpus([inp], tmp_path / "corpus")
    docs = sorted(d["id"] for s in ("train", "heldout")
                  for d in iter_documents(tmp_path / "corpus", s))
    assert docs == ["in/a0.txt", "in/again/a0.txt", "in/again/a1.txt"]  # "again" sorts first
    assert manifest["skipped"]["items"] == [
        f"in/{name}: a link to a folder read under another name (a loop, or a second way to it)"
        for name in ("loop", "prose")]


def test_a_folder_inside_the_input_is_read_as_itself_not_as_a_link_sorting_before_it(tmp_path):
    """A link to a folder of the input, sorting before it, read that folder's files under the
    link's name (its domain too) and reported the real folder as "a link to a folder read
    already"."""
    inp = tmp_path / "in"
    _texts(inp / "prose", 2)
    (inp / "alias").symlink_to(inp / "prose")
    manifest = build_user_corpus([inp], tmp_path / "corpus")
    docs = sorted((d["id"], d["domain"]) for s in ("train", "heldout")
                  for d in iter_documents(tmp_path / "corpus", s))
    assert docs == [("in/prose/a0.txt", "prose"), ("in/prose/a1.txt", "prose")]
    assert manifest["skipped"]["items"] == [
        "in/alias: a link to a folder read under another name (a loop, or a second way to it)"]


def test_a_start_says_when_the_source_changed_since_its_corpus_was_built(tmp_path, capsys):
    """data.source edited after its corpus was built: the run trains on the corpus as built
    (a resume must), which it did without a word; now a note names what changed."""
    from moelab.config import DataConfig
    from moelab.data.prepare import prepare_data

    src = tmp_path / "src" / "prose"
    src.mkdir(parents=True)
    for i in range(12):
        (src / f"d{i:02d}.txt").write_text(f"document {i}: " + "some plain words here. " * 20)
    dcfg = DataConfig(source=str(tmp_path / "src"), data_dir=str(tmp_path / "data"))
    for _ in range(2):  # the build, then a start on the corpus it built: nothing to say
        prepare_data(dcfg, 300, progress=False)
        assert "changed since the corpus" not in capsys.readouterr().err
    (src / "d03.txt").write_text("an edited document, " * 20)
    (src / "new.txt").write_text("a new document, " * 20)
    prepare_data(dcfg, 300, progress=False)
    err = capsys.readouterr().err
    assert (f"note: data.source {tmp_path / 'src'} changed since the corpus in "
            f"{tmp_path / 'data' / 'corpus'} was built (1 changed, 1 added; e.g. "
            "src/prose/d03.txt): this run trains on the corpus as built") in err, err
