"""Corpora from where users keep them: Hugging Face ``datasets`` (save_to_disk folders, data
files through datasets' builders, streamed), fsspec URLs (memory:// here; gs:// without gcsfs
is a clear error), and the parallel tokenizer with its progress bar."""

from __future__ import annotations

import io
import json
import os
import random
import re
import sys
import uuid

os.environ["HF_DATASETS_OFFLINE"] = "1"  # read before datasets is imported: no network here

import datasets  # noqa: E402
import fsspec  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import helpers  # noqa: E402
from moelab.cli import main  # noqa: E402
from moelab.config import ConfigError  # noqa: E402
from moelab.data import (  # noqa: E402
    DataError,
    TokenStore,
    build_token_store,
    build_user_corpus,
    iter_documents,
    load_manifest,
    train_tokenizer,
)
from moelab.data.corpus import FORMAT  # noqa: E402
from moelab.data.tokenizer import doc_batches  # noqa: E402
from moelab.train.loop import train  # noqa: E402


@pytest.fixture(scope="module")
def texts() -> dict[str, list[str]]:
    """Two domains of the shared synthetic generators, 16 documents each."""
    rng = random.Random(5)
    return {"prose": [helpers._prose(rng) for _ in range(16)],
            "code": [helpers._code(rng) for _ in range(16)]}


@pytest.fixture(scope="module", autouse=True)
def compile_cache(tmp_path_factory):
    """Both training tests compile the same micro model: share the compiled executables."""
    if "jax_cache" not in helpers._CACHE:
        helpers._enable_compilation_cache(tmp_path_factory.mktemp("jax_cache"))


@pytest.fixture
def memfs():
    """A folder of its own in fsspec's in-process memory filesystem, removed afterwards."""
    fs, root = fsspec.filesystem("memory"), f"/t{uuid.uuid4().hex[:8]}"
    yield fs, root
    if fs.exists(root):
        fs.rm(root, recursive=True)


def _save_to_disk(texts, path) -> None:
    rows = [(t, d) for d, ts in texts.items() for t in ts]
    ds = datasets.Dataset.from_dict({"body": [t for t, _ in rows], "domain": [d for _, d in rows]})
    datasets.DatasetDict({"train": ds, "validation": ds.select(range(3))}).save_to_disk(str(path))


def _write_memory_corpus(texts, fs, root) -> str:
    """prose as JSONL records (text in "body"), code as one .txt file per document."""
    fs.pipe(f"{root}/prose/docs.jsonl",
            "".join(json.dumps({"body": t}) + "\n" for t in texts["prose"]).encode())
    for i, t in enumerate(texts["code"]):
        fs.pipe(f"{root}/code/f{i:02d}.txt", t.encode())
    return f"memory://{root}"


def _write_jsonl(texts, path) -> None:
    path.write_text("".join(json.dumps({"body": t, "domain": d}) + "\n"
                            for d, ts in texts.items() for t in ts))


# ---------------------------------------------------------------------------------------------
# sources that build and train


@pytest.mark.parametrize("kind", ["hf-disk", "memory"])
def test_source_builds_and_trains(kind, texts, tmp_path, memfs):
    if kind == "hf-disk":
        _save_to_disk(texts, tmp_path / "saved")
        data = {"source": str(tmp_path / "saved"), "format": "hf-disk", "split": "train"}
    else:
        data = {"source": _write_memory_corpus(texts, *memfs)}
    data_dir = tmp_path / "data"
    cfg = helpers.micro_config(data_dir, data={**data, "text_field": "body"},
                               train={"steps": 3})
    summary = train(cfg, tmp_path / "run", verbose=False, sample_prompt=None)
    assert summary["step"] == 3 and np.isfinite(summary["train/loss"])
    m = load_manifest(data_dir / "corpus")  # built from data.source by the training run
    assert m["kind"] == "user" and m["sources"] == [data["source"]]
    assert m["format"] == FORMAT and m["source_format"] == data.get("format", "files")
    assert sorted(m["domains"]) == ["code", "prose"]
    assert sum(m["total"][s]["docs"] for s in ("train", "heldout")) == 32
    assert {d["text"] for s in ("train", "heldout") for d in iter_documents(data_dir / "corpus", s)
            } == set(texts["prose"]) | set(texts["code"])
    assert not [p for p in (data_dir / "corpus").iterdir() if p.name.startswith(".")]
    other = helpers.micro_config(data_dir, data={"source": str(tmp_path / "elsewhere")})
    with pytest.raises(ConfigError, match="was built from"):  # never trains on another corpus
        train(other, tmp_path / "run2", verbose=False, sample_prompt=None)
    field = helpers.micro_config(data_dir, data={**data, "text_field": "domain"})
    with pytest.raises(ConfigError, match="data.text_field='domain'.*built with text_field"):
        train(field, tmp_path / "run3", verbose=False, sample_prompt=None)


def test_streaming_equals_loading_and_the_cli(texts, tmp_path, memfs, capsys):
    _write_jsonl(texts, tmp_path / "local.jsonl")
    url = _write_memory_corpus(texts, *memfs)
    for src in (str(tmp_path / "local.jsonl"), url):
        loaded = build_user_corpus([src], tmp_path / "loaded", 0.2, fmt="hf-files",
                                   text_field="body")
        streamed = build_user_corpus([src], tmp_path / "streamed", 0.2, fmt="hf-stream",
                                     text_field="body")
        assert streamed["fingerprint"] == loaded["fingerprint"]
        assert streamed["total"]["train"]["docs"] + streamed["total"]["heldout"]["docs"] == 32
        assert streamed["source_format"] == "hf-stream"
        assert sorted(streamed["domains"]) == ["code", "prose"]
    out = tmp_path / "built"
    rc = main(["data", "build", url, "--format", "hf-stream", "--text-field", "body",
               "--out", str(out), "--vocab", "300", "--no-progress"])
    assert rc == 0 and TokenStore(next(out.glob("tokens-*"))).domains() == ["code", "prose"]
    assert "tokenizing" not in capsys.readouterr().err  # no bar when asked, nor off a terminal


def test_unreadable_data_files_are_skipped_not_fatal(texts, tmp_path):
    (tmp_path / "in").mkdir()
    _write_jsonl(texts, tmp_path / "in" / "good.jsonl")
    (tmp_path / "in" / "broken.jsonl").write_text('{"body": "cut off\n')
    (tmp_path / "in" / "blob.bin").write_bytes(b"\x00\x01")
    m = build_user_corpus([tmp_path / "in"], tmp_path / "c", fmt="hf-files", text_field="body")
    assert m["total"]["train"]["docs"] + m["total"]["heldout"]["docs"] == 32
    broken = [i for i in m["skipped"]["items"] if i.startswith("in/broken.jsonl: ")]
    assert m["skipped"]["count"] == 2 and len(broken) == 1
    # the reader's own error, with its row (datasets wraps it in a generic one), and the format
    # that skips only the bad line
    assert re.fullmatch(r"in/broken.jsonl: unreadable file \(ArrowInvalid: JSON parse error: "
                        r".* in row 0\); --format files reads JSON lines, skipping each "
                        r"malformed line", broken[0]), broken[0]


# ---------------------------------------------------------------------------------------------
# clear errors


def test_a_wrong_text_field_names_the_columns(texts, tmp_path, memfs, capsys):
    _save_to_disk(texts, tmp_path / "saved")
    with pytest.raises(DataError, match=r"no text field 'content'; columns: body, domain; "
                       r"set --text-field \(data.text_field\)"):
        build_user_corpus([tmp_path / "saved"], tmp_path / "c", fmt="hf-disk",
                          text_field="content")
    _write_jsonl(texts, tmp_path / "x.jsonl")
    for fmt in ("hf-files", "hf-stream"):  # a streamed dataset is checked on its first row
        with pytest.raises(DataError, match="no text field 'text'; columns: body, domain"):
            build_user_corpus([tmp_path / "x.jsonl"], tmp_path / "c", fmt=fmt)
    with pytest.raises(DataError, match="no split 'test'; splits: train, validation"):
        build_user_corpus([tmp_path / "saved"], tmp_path / "c", fmt="hf-disk",
                          text_field="body", split="test")
    assert main(["data", "build", str(tmp_path / "saved"), "--format", "hf-disk",
                 "--out", str(tmp_path / "o")]) == 2
    assert "no text field 'text'; columns: body, domain" in capsys.readouterr().err


def test_missing_filesystem_package_and_bad_options(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "gcsfs", None)  # as if gcsfs were not installed
    with pytest.raises(ValueError, match=r"gs://bucket/corpus: cannot open gs:// paths .*"
                       "pip install gcsfs"):
        build_user_corpus(["gs://bucket/corpus"], tmp_path / "c")
    assert main(["data", "build", "gs://bucket/corpus", "--out", str(tmp_path / "o")]) == 2
    assert "pip install gcsfs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nosuch://x: cannot open nosuch:// paths"):
        build_user_corpus(["nosuch://x"], tmp_path / "c")
    with pytest.raises(DataError, match="input path.* not found: memory:///absent"):
        build_user_corpus(["memory:///absent"], tmp_path / "c")
    monkeypatch.chdir(tmp_path)  # a Hub dataset's id is not a path: its URL is named
    with pytest.raises(DataError, match="not found: HuggingFaceFW/fineweb; .* by the URL of its "
                       r"data files: hf://datasets/HuggingFaceFW/fineweb/PATH \(--format"):
        build_user_corpus(["HuggingFaceFW/fineweb"], tmp_path / "c", fmt="hf-stream")
    with pytest.raises(DataError, match=r"not found: notes/corpus.txt; give existing "):  # a file's name
        build_user_corpus(["notes/corpus.txt"], tmp_path / "c")
    (tmp_path / "texts").mkdir()  # a missing file in a folder that exists is only missing
    with pytest.raises(DataError, match=r"not found: texts/a.txt; give existing "):
        build_user_corpus(["texts/a.txt"], tmp_path / "c")
    with pytest.raises(DataError, match="format 'hf' .*must be one of files, hf-disk"):
        build_user_corpus([tmp_path], tmp_path / "c", fmt="hf")
    with pytest.raises(ConfigError, match="data.format: must be one of files, hf-disk"):
        helpers.micro_config(tmp_path, data={"format": "datasets"})
    with pytest.raises(ConfigError, match="data.split: only for the hf-"):
        helpers.micro_config(tmp_path, data={"split": "train"})


def test_an_unreachable_url_is_one_line_not_a_traceback(tmp_path, monkeypatch, capsys):
    """Without network hf:// (huggingface_hub) raised its HTTP client's ConnectError from the
    existence check: a traceback and exit 1. Any filesystem's failure there is one line."""
    from fsspec.implementations.memory import MemoryFileSystem

    class ConnectError(Exception):  # as httpx's: not an OSError
        pass

    class Offline(MemoryFileSystem):
        protocol = "offlinetest"

        def exists(self, path, **kw):
            raise ConnectError("Name or service\n  not known")  # no network; two lines

    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "offlinetest", Offline)
    for fmt in ("files", "hf-stream"):
        rc = main(["data", "build", "offlinetest://owner/corpus", "--format", fmt,
                   "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1, err
        assert ("offlinetest://owner/corpus: cannot be reached (ConnectError: Name or "
                "service not known); check the network") in err
    assert not (tmp_path / "o").exists()


# ---------------------------------------------------------------------------------------------
# parallel tokenization


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_parallel_tokens_equal_serial_and_the_progress_bar(texts, tmp_path, monkeypatch):
    docs = [{"text": t} for ts in texts.values() for t in ts]
    cut = list(doc_batches(iter(docs), 5, chars=3000))  # by count, and by size for long texts
    assert [d for b in cut for d in b] == docs and max(map(len, cut)) <= 5
    assert any(len(b) < 5 for b in cut[:-1])
    _write_jsonl(texts, tmp_path / "x.jsonl")
    corpus = tmp_path / "corpus"
    build_user_corpus([tmp_path / "x.jsonl"], corpus, 0.2, text_field="body")
    tok = train_tokenizer(corpus, tmp_path / "tok.json", vocab_size=300)
    term = _Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    build_token_store(corpus, tok, tmp_path / "store")
    assert "tokenizing train" in term.getvalue() and "tokenizing heldout" in term.getvalue()
    store = TokenStore(tmp_path / "store")
    for split in ("train", "heldout"):
        for domain in store.domains(split):
            serial = [t for d in iter_documents(corpus, split) if d["domain"] == domain
                      for t in tok.encode(d["text"], add_special_tokens=False).ids + [0]]
            np.testing.assert_array_equal(store.tokens(split, domain), serial)
    quiet = _Terminal()
    monkeypatch.setattr(sys, "stderr", quiet)
    build_token_store(corpus, tok, tmp_path / "store2", progress=False)
    assert "tokenized train" in quiet.getvalue() and "tokenizing" not in quiet.getvalue()
