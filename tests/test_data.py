"""Data path: corpus building, tokenizer, token store, mixture sampler, eval windows.

Everything runs on small synthetic corpora; the built-in corpus is only located, never built.
"""

from __future__ import annotations

import json
import random
import re
import shutil
import unicodedata
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from moelab.data import (
    DataError,
    MixtureSampler,
    TokenStore,
    build_token_store,
    build_user_corpus,
    builtin_sources,
    decode,
    encode_batch,
    ensure_token_store,
    eos_id,
    eval_windows,
    heldout_text,
    iter_documents,
    load_manifest,
    load_tokenizer,
    train_tokenizer,
)
from moelab.data.builtin_docs import gutenberg_books, split_paragraphs
from moelab.data.corpus import is_heldout
from moelab.data.encode import line_chunks, pool_size
from moelab.data.errors import skip_summary
from moelab.data.sampler import EpochSampler
from moelab.data.user_docs import MAX_DOMAIN_CHARS, MAX_DOMAINS, clean_domain

UNICODE_TEXT = ("Grüße, naïve café! 你好，世界。 Emoji: 🎉🚀👩‍💻 and ∑ₙ x² ≠ ∞\n\n"
                "def f(x: int) -> int:\n\treturn x ** 2  # tab-indented\r\n"
                "    trailing spaces   \n\n\n")


def _words(rng: random.Random, alphabet: str, n: int) -> str:
    return " ".join("".join(rng.choice(alphabet) for _ in range(rng.randint(1, 7)))
                    for _ in range(n))


def _write_domains(root: Path, n_docs: int = 40) -> Path:
    """Two folders = two domains with disjoint characters: letters (some non-ASCII) vs digits."""
    rng = random.Random(0)
    for domain, alphabet in (("alpha", "abcdefghéü"), ("num", "0123456789")):
        (root / domain).mkdir(parents=True)
        for i in range(n_docs):
            text = "\n".join(_words(rng, alphabet, 20) for _ in range(rng.randint(3, 8)))
            (root / domain / f"doc{i:03d}.txt").write_text(text)
    return root


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A two-domain corpus, its tokenizer (vocab 400) and token store."""
    root = tmp_path_factory.mktemp("small")
    src = _write_domains(root / "src")
    corpus = root / "corpus"
    manifest = build_user_corpus([src], corpus, heldout_fraction=0.2)
    tok = train_tokenizer(corpus, root / "tokenizer.json", vocab_size=400)
    build_token_store(corpus, tok, root / "store")
    return {"root": root, "corpus": corpus, "manifest": manifest, "tok": tok,
            "store": TokenStore(root / "store")}


# ---------------------------------------------------------------------------------------------
# corpus


def test_builtin_sources_are_found():
    src = builtin_sources()
    assert set(src) == {"prose", "bible", "shakespeare", "code"}
    assert src["prose"].name == "big.txt" and src["prose"].stat().st_size > 1_000_000
    assert src["bible"].name == "kjv.jsonl" and src["bible"].is_file()
    assert len(list(src["shakespeare"].glob("*_gut.txt"))) >= 30
    assert (src["code"] / "os.py").is_file()


def test_split_paragraphs_keeps_text_and_sizes():
    rng = random.Random(1)
    paras = [_words(rng, "abcdefgh", rng.randint(5, 200)) for _ in range(300)]
    chunks = split_paragraphs("\n\n".join(paras), min_bytes=4096, max_bytes=8192)
    assert "\n\n".join(chunks) == "\n\n".join(paras)  # cut only at blank lines, nothing lost
    sizes = [len(c.encode()) for c in chunks]
    assert all(4096 <= s <= 8192 for s in sizes[:-1]), sizes


def test_gutenberg_boilerplate_is_dropped():
    text = ("License blah\n*** START OF THE PROJECT GUTENBERG EBOOK, MY BOOK ***\nBody one.\n"
            "*** END OF THE PROJECT GUTENBERG EBOOK, MY BOOK ***\nMore license\n")
    assert [(s, b.strip()) for s, b in gutenberg_books(text)] == [("my-book", "Body one.")]
    assert gutenberg_books("plain text") == [("text", "plain text")]


def _messy_inputs(root: Path) -> Path:
    d = root / "inputs" / "mydomain"
    d.mkdir(parents=True)
    (d / "good.txt").write_text(UNICODE_TEXT, encoding="utf-8")
    (d / "notes.md").write_text("# Notes\n\nSome *markdown*.\n")
    (d / "empty.txt").write_bytes(b"")
    (d / "blob.bin").write_bytes(b"\x89PNG\x00\x00\x01binary")
    (d / "latin1.txt").write_bytes("café crème".encode("latin-1"))
    lines = [json.dumps({"text": "jsonl doc one"}),
             json.dumps({"title": "no text here"}),
             "{not json",
             json.dumps({"text": 42}),
             "",
             json.dumps({"text": "nul \u0000 inside"}),
             json.dumps({"text": "jsonl doc with domain", "domain": "news"})]
    (d / "docs.jsonl").write_text("\n".join(lines) + "\n")
    pq.write_table(pa.table({"text": ["parquet row 0", None, "parquet row 2"],
                             "domain": ["pq", "pq", None]}), d / "table.parquet")
    pq.write_table(pa.table({"body": ["no text column"]}), d / "notext.parquet")
    return root / "inputs"


def test_user_corpus_skips_bad_inputs(tmp_path, capsys):
    inputs = _messy_inputs(tmp_path)
    m = build_user_corpus([inputs], tmp_path / "corpus")
    skipped = {item.split(": ", 1)[0]: item.split(": ", 1)[1] for item in m["skipped"]["items"]}
    assert skipped == {
        "inputs/mydomain/blob.bin": "unknown file type '.bin'",
        "inputs/mydomain/docs.jsonl line 2": "missing field 'text' (fields: title)",
        "inputs/mydomain/docs.jsonl line 3": "not valid JSON",
        "inputs/mydomain/docs.jsonl line 4": "field 'text' is not a string",
        "inputs/mydomain/docs.jsonl line 6": "binary content (NUL bytes)",
        "inputs/mydomain/empty.txt": "empty file",
        "inputs/mydomain/latin1.txt": "not valid UTF-8 text",
        "inputs/mydomain/notext.parquet": "no 'text' column (columns: body)",
        "inputs/mydomain/table.parquet row 1": "empty text (null)",
    }
    assert m["skipped"]["count"] == 9
    assert "skipped 9 inputs" in capsys.readouterr().err
    # a Parquet file without the text column gets the fix a JSON record without the field does
    said = skip_summary([("notext.parquet", skipped["inputs/mydomain/notext.parquet"])])
    assert said.endswith("; --text-field (data.text_field) names the field holding the text"), said

    docs = [d for s in ("train", "heldout") for d in iter_documents(tmp_path / "corpus", s)]
    by_text = {d["text"]: d["domain"] for d in docs}
    assert by_text == {UNICODE_TEXT: "mydomain", "# Notes\n\nSome *markdown*.\n": "mydomain",
                       "jsonl doc one": "mydomain", "jsonl doc with domain": "news",
                       "parquet row 0": "pq", "parquet row 2": "mydomain"}
    n = sum(s["docs"] for d in m["domains"].values() for s in d.values())
    assert n == 6 and m["total"]["train"]["docs"] + m["total"]["heldout"]["docs"] == 6


def test_user_corpus_domain_argument_and_single_file(tmp_path):
    f = tmp_path / "one.txt"
    f.write_text("hello world")
    m = build_user_corpus(f, tmp_path / "c", domain="my domain")
    assert list(m["domains"]) == ["my_domain"]  # cleaned: it names files and metric keys


def test_domain_names_are_cleaned_without_merging():
    plain = ["books", "web.en", "my_books-2", "a" * 64]
    assert [clean_domain(n) for n in plain] == plain
    assert clean_domain("my books") == "my_books" and clean_domain("") == "text"
    # what cleaning only trimmed before names hashed ones came, stays as it was
    for name in ("_books", "books_", ".books", " books ", "my  books", "my\tbooks"):
        assert clean_domain(name) in ("books", "my_books"), name
    assert clean_domain("web.en.") == "web.en"
    # one name, one domain: Unicode forms (macOS folder names come back decomposed), spaces
    assert clean_domain(unicodedata.normalize("NFD", "Économie")) == clean_domain("Économie")
    assert clean_domain(" C++") == clean_domain("C++") != clean_domain("C#")
    odd = ["C++", "C#", "C", "a/b", "a b/", "Économie", "Economie", "한국어", "x" * 300,
           "x" * 301, "y" * 65, ".hidden", "ä" * 100]
    got = [clean_domain(n) for n in odd]
    assert len(set(got)) == len(odd), got  # none merge
    assert got == [clean_domain(n) for n in odd]  # and always alike
    for name in got:
        assert re.fullmatch(r"[A-Za-z0-9_.-]+", name) and len(name) <= MAX_DOMAIN_CHARS, name
    assert got[0].startswith("C-") and got[5].startswith("Economie-")  # readable where it can


def test_odd_domain_values_build_and_too_many_are_refused(tmp_path, capsys):
    from moelab.cli import main

    src = tmp_path / "in"
    src.mkdir()
    names = ["x" * 300, "Ünïcödé domain", "C++", "C#"]
    (src / "r.jsonl").write_text("".join(
        json.dumps({"text": f"record {i} says " + "hello world " * 60, "domain": names[i % 4]})
        + "\n" for i in range(40)))
    assert main(["data", "build", str(src), "--out", str(tmp_path / "d"), "--vocab", "300",
                 "--no-progress"]) == 0  # a 300-character name once failed: file name too long
    out = capsys.readouterr().out
    held = json.loads((tmp_path / "d" / "corpus" / "manifest.json").read_text())["domains"]
    assert sorted(held) == sorted(clean_domain(n) for n in names)
    assert f"note: domain {clean_domain('C#')!r} holds out" in out  # about 200 tokens each

    many = tmp_path / "many"
    many.mkdir()
    (many / "r.jsonl").write_text("".join(json.dumps({"text": "t", "domain": f"u{i}"}) + "\n"
                                          for i in range(MAX_DOMAINS + 1)))
    with pytest.raises(DataError, match=rf"more than {MAX_DOMAINS} domains \(the first one over: "
                       rf"'u{MAX_DOMAINS}'\).* a coarse 'domain'"):
        build_user_corpus([many], tmp_path / "c")


def test_a_record_s_domain_that_is_no_name_is_skipped_with_its_reason():
    """A number names a domain as its text would; a list or an object is no name, and the
    record is skipped saying so (it was put in the folder's domain without a word)."""
    from moelab.data.user_docs import record_doc

    skips = []
    assert record_doc({"text": "a", "domain": 2023}, "r 0", "folder", skips)["domain"] == "2023"
    assert record_doc({"text": "a", "domain": None}, "r 1", "folder", skips)["domain"] == "folder"
    assert record_doc({"text": "a", "domain": ["web"]}, "r 2", "folder", skips) is None
    assert record_doc({"text": "a", "domain": True}, "r 3", "folder", skips) is None
    assert skips == [
        ("r 2", "its 'domain' is list ['web'], not a name (give a string, or leave it out for "
         "the folder's name)"),
        ("r 3", "its 'domain' is bool True, not a name (give a string, or leave it out for the "
         "folder's name)")]


def test_a_reason_shared_by_many_records_is_said_once(tmp_path):
    """A JSONL file whose records all lack the text field: one item naming the file once,
    its first lines and a count, then the fix (it repeated the same words for 8 lines)."""
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "d.jsonl").write_text("".join(json.dumps({"content": f"doc {i}"}) + "\n"
                                                     for i in range(300)))
    with pytest.raises(DataError) as e:
        build_user_corpus([tmp_path / "in"], tmp_path / "corpus")
    said = str(e.value)
    assert said.count("missing field") == 1 and said.count("d.jsonl") == 1, said
    assert ("skipped 300 inputs: in/d.jsonl line 1, line 2, line 3 and 297 more: missing field "
            "'text' (fields: content); --text-field (data.text_field)") in said, said
    two = skip_summary([("a.txt", "empty file"), ("b.txt", "empty file"), ("c.csv", "x")])
    assert two == "skipped 3 inputs: a.txt, b.txt: empty file; c.csv: x", two


def test_data_text_says_what_a_run_trains_on(data_dir):
    """The start-up's and summary's data line: the folder, what its corpus was built from, its
    training tokens and domains, with data.mixture's share of each."""
    from moelab.config import DataConfig
    from moelab.config.data import MixtureChange
    from moelab.data.prepare import data_text

    store = TokenStore(next(data_dir.glob("tokens-*")))
    n = sum(store.n_tokens("train", d) for d in store.domains("train"))
    src = load_manifest(data_dir / "corpus")["sources"]
    said = data_text(DataConfig(data_dir=str(data_dir)), store, data_dir / "corpus")
    assert said == (f"{data_dir} (built from {', '.join(src)}): {n:,} training tokens in 3 "
                    "domains: code, logs, prose"), said
    mixed = DataConfig(data_dir=str(data_dir), mixture={"prose": 3, "code": 1},
                       mixture_schedule=[MixtureChange(10, {"logs": 1})])
    assert data_text(mixed, store, data_dir / "corpus").endswith("code 25%, logs 0%, prose 75%")
    assert data_text(mixed, store, data_dir / "corpus", 10).endswith("code 0%, logs 100%, "
                                                                       "prose 0%")  # changed


def test_nothing_usable_is_a_clear_error(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "empty.txt").write_bytes(b"")
    (d / "blob.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match=r"no usable documents in .*bad.*skipped 2 inputs"):
        build_user_corpus([d], tmp_path / "corpus")
    assert not (tmp_path / "corpus" / "manifest.json").exists()
    with pytest.raises(DataError, match="not found: .*nope"):
        build_user_corpus([tmp_path / "nope"], tmp_path / "corpus")
    with pytest.raises(DataError, match="manifest.json missing"):
        load_manifest(tmp_path / "corpus")


def test_split_is_deterministic_and_by_document(tmp_path):
    src = _write_domains(tmp_path / "src", n_docs=300)
    m1 = build_user_corpus([src], tmp_path / "c1", heldout_fraction=0.2)
    m2 = build_user_corpus([src], tmp_path / "c2", heldout_fraction=0.2)
    assert m1["fingerprint"] == m2["fingerprint"]
    for name in ("train.jsonl", "heldout.jsonl", "manifest.json"):
        assert (tmp_path / "c1" / name).read_bytes() == (tmp_path / "c2" / name).read_bytes()
    train = {d["id"] for d in iter_documents(tmp_path / "c1", "train")}
    held = {d["id"] for d in iter_documents(tmp_path / "c1", "heldout")}
    assert not train & held and len(train | held) == 600
    assert held == {i for i in train | held if is_heldout(i, 0.2)}  # the side depends on the id
    assert 0.14 < len(held) / 600 < 0.26
    # a different fraction changes the split, hence the fingerprint
    assert build_user_corpus([src], tmp_path / "c3", 0.05)["fingerprint"] != m1["fingerprint"]


def test_every_domain_gets_a_heldout_document(tmp_path):
    src = _write_domains(tmp_path / "src", n_docs=5)
    m = build_user_corpus([src], tmp_path / "c", heldout_fraction=0.0)
    for domain in ("alpha", "num"):
        assert m["domains"][domain]["heldout"]["docs"] == 1
        assert m["domains"][domain]["train"]["docs"] == 4
    held = [d["id"] for d in iter_documents(tmp_path / "c", "heldout")]
    assert sorted(held) == ["src/alpha/doc000.txt", "src/num/doc000.txt"]  # first by id


def test_a_large_file_gives_up_only_the_end_of_its_first_part(tmp_path):
    """One 3.3 MB book, cut into 4 parts of at most 1 Mi characters, none held out by the hash:
    its first part gives up only its end, about the held-out share of the domain (it gave up
    the whole part: a third of this book, two thirds of a 1.5 MB one)."""
    from moelab.data.corpus import FORCED_HELD_MIN

    src = tmp_path / "src" / "prose"
    src.mkdir(parents=True)
    (src / "book.txt").write_text(" ".join(f"word{i}" for i in range(300_000)))
    m = build_user_corpus([src], tmp_path / "c", heldout_fraction=0.02)
    dom = m["domains"]["prose"]
    total = dom["train"]["bytes"] + dom["heldout"]["bytes"]
    assert dom["train"]["docs"] == 4 and dom["heldout"]["docs"] == 1  # four parts, one end
    assert FORCED_HELD_MIN * 0.99 <= dom["heldout"]["bytes"] <= max(0.02 * total,
                                                                    FORCED_HELD_MIN) * 1.01


# ---------------------------------------------------------------------------------------------
# tokenizer


def test_tokenizer_round_trip_and_eos(small, tmp_path):
    tok = small["tok"]
    assert eos_id(tok) == 0 and tok.token_to_id("<|endoftext|>") == 0
    assert tok.get_vocab_size() == 400
    texts = [UNICODE_TEXT, "abc 123", " leading space", "", "x" * 1000]
    ids = encode_batch(tok, texts)
    assert [decode(tok, i) for i in ids] == texts
    assert 0 not in ids[0]  # the separator never appears inside a document
    assert decode(tok, ids[1] + [0]) == "abc 123<|endoftext|>"
    reloaded = load_tokenizer(small["root"] / "tokenizer.json")
    assert encode_batch(reloaded, texts) == ids


def test_load_tokenizer_errors(small, tmp_path):
    with pytest.raises(DataError, match="not found"):
        load_tokenizer(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{ not a tokenizer")
    with pytest.raises(DataError, match="not a valid HF tokenizer.json"):
        load_tokenizer(tmp_path / "bad.json")
    blob = json.loads(small["tok"].to_str())
    blob["added_tokens"] = []
    del blob["model"]["vocab"]["<|endoftext|>"]
    (tmp_path / "noeos.json").write_text(json.dumps(blob))
    with pytest.raises(DataError, match="no end-of-text token"):
        load_tokenizer(tmp_path / "noeos.json")


# ---------------------------------------------------------------------------------------------
# token store


def test_store_equals_direct_tokenization(small):
    store, tok = small["store"], small["tok"]
    assert store.dtype == np.uint16 and store.vocab_size == 400 and store.eos_id == 0
    for split in ("train", "heldout"):
        assert store.domains(split) == ["alpha", "num"]
        for domain in store.domains(split):
            docs = [d for d in iter_documents(small["corpus"], split) if d["domain"] == domain]
            want = [t for ids in encode_batch(tok, [d["text"] for d in docs]) for t in ids + [0]]
            got = store.tokens(split, domain)
            np.testing.assert_array_equal(got, np.array(want))
            assert store.n_tokens(split, domain) == len(want)
            assert store.n_docs(split, domain) == len(docs)
            assert store.n_bytes(split, domain) == sum(len(d["text"].encode()) for d in docs)
            assert np.sum(got == 0) == len(docs)


def test_store_missing_incomplete_and_reuse(small, tmp_path):
    with pytest.raises(DataError, match="moelab data build"):
        TokenStore(tmp_path / "none")
    out = tmp_path / "store"
    s1 = ensure_token_store(small["corpus"], small["tok"], out)
    assert s1.fingerprint == small["store"].fingerprint
    mtime = (out / "train" / "alpha.bin").stat().st_mtime_ns
    ensure_token_store(small["corpus"], small["tok"], out)  # up to date: not rebuilt
    assert (out / "train" / "alpha.bin").stat().st_mtime_ns == mtime
    (out / "index.json").unlink()  # as if interrupted before the index was written
    s2 = ensure_token_store(small["corpus"], small["tok"], out)
    np.testing.assert_array_equal(s2.tokens("train", "num"), s1.tokens("train", "num"))
    assert not list(out.rglob("*.tmp"))


def test_store_is_byte_identical_with_worker_processes(small, tmp_path, capsys):
    """Chunks of whole lines, tokenized by two spawned processes, give the same store as
    this process; a damaged line is named by its number from inside a worker."""
    corpus = small["corpus"]
    data = (corpus / "train.jsonl").read_bytes()
    chunks = list(line_chunks(corpus / "train.jsonl", 4096))
    assert len(chunks) > 4 and chunks[0][0] == 0 and chunks[-1][1] == len(data)
    for (a, b, line), (c, _, nxt) in zip(chunks, chunks[1:]):
        assert b == c and data[b - 1: b] == b"\n" and nxt == line + data[a:b].count(b"\n")
    files = [corpus / f"{s}.jsonl" for s in ("train", "heldout")]
    assert pool_size(2, files, 4096) == 2 and pool_size(2, files) == 1  # small: no pool
    build_token_store(corpus, small["tok"], tmp_path / "pooled", workers=2, chunk_bytes=4096)
    assert "2 workers" in capsys.readouterr().err
    ref = small["root"] / "store"
    names = sorted(p.relative_to(ref) for p in ref.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(tmp_path / "pooled")
                           for p in (tmp_path / "pooled").rglob("*") if p.is_file())
    for name in names:
        assert (ref / name).read_bytes() == (tmp_path / "pooled" / name).read_bytes(), name
    damaged = tmp_path / "damaged"
    shutil.copytree(corpus, damaged)
    lines = data.split(b"\n")
    lines[40] = b"{not json"
    (damaged / "train.jsonl").write_bytes(b"\n".join(lines))
    with pytest.raises(DataError, match=r"train.jsonl line 41: not valid JSON"):
        build_token_store(damaged, small["tok"], tmp_path / "bad", workers=2, chunk_bytes=4096)


def test_data_build_workers_option(small, tmp_path, capsys):
    from moelab.cli import main

    src = small["root"] / "src"
    assert main(["data", "build", str(src), "--out", str(tmp_path / "d"), "--workers", "0"]) == 2
    assert "--workers 0: tokenizer processes: give 1 or more" in capsys.readouterr().err
    assert not (tmp_path / "d").exists()  # refused before anything is made
    assert main(["data", "build", str(src), "--out", str(tmp_path / "d"), "--workers", "1",
                 "--vocab", "300", "--no-progress"]) == 0
    err = capsys.readouterr().err
    assert "MB/s, 1 worker)" in err and "in 2 domains (" in err
    assert main(["data", "build", str(src / "alpha"), "--out", str(tmp_path / "a"), "--workers",
                 "1", "--vocab", "300", "--no-progress"]) == 0
    assert "in 1 domain (" in capsys.readouterr().err  # one domain, not "1 domains"


# ---------------------------------------------------------------------------------------------
# sampler


def _row_domain(tok, row) -> str:
    text = decode(tok, row).replace("<|endoftext|>", "")
    letters, digits = any(c.isalpha() for c in text), any(c.isdigit() for c in text)
    assert letters != digits, f"row mixes domains: {text!r}"
    return "alpha" if letters else "num"


def test_sampler_is_deterministic_and_reads_contiguous_windows(small):
    s = MixtureSampler(small["store"], seq_len=32, batch_size=8, seed=7)
    b = s.batch(3)
    assert b.shape == (8, 33) and b.dtype == np.int32
    np.testing.assert_array_equal(b, s.batch(3))
    assert not np.array_equal(b, s.batch(4))
    assert not np.array_equal(b, MixtureSampler(small["store"], seq_len=32, batch_size=8,
                                                seed=8).batch(3))
    for row, dom in zip(b, s.batch_domains(3)):
        stream = np.asarray(small["store"].tokens("train", dom))
        windows = np.lib.stride_tricks.sliding_window_view(stream, 33)
        assert (windows == row).all(axis=1).any()  # a real contiguous slice of its domain
        assert _row_domain(small["tok"], row) == dom


def test_sampler_resume_gives_the_same_batches(small):
    run = MixtureSampler(small["store"], seq_len=16, batch_size=4, seed=1)
    full = [run.batch(i) for i in range(10)]
    resumed = MixtureSampler(small["store"], seq_len=16, batch_size=4, seed=1)
    for i in range(5, 10):
        np.testing.assert_array_equal(resumed.batch(i), full[i])


def test_mixture_weights_are_respected(small):
    store, tok = small["store"], small["tok"]
    only_num = MixtureSampler(store, seq_len=16, batch_size=16, mixture={"alpha": 0, "num": 1})
    assert {_row_domain(tok, r) for i in range(20) for r in only_num.batch(i)} == {"num"}
    s = only_num.with_mixture({"alpha": 3, "num": 1})
    assert s.probs == {"alpha": 0.75, "num": 0.25}
    rows = [_row_domain(tok, r) for i in range(100) for r in s.batch(i)]
    assert 0.70 < rows.count("alpha") / len(rows) < 0.80
    default = s.with_mixture(None).probs  # proportional to training tokens
    n = {d: store.n_tokens("train", d) for d in ("alpha", "num")}
    assert default["alpha"] == pytest.approx(n["alpha"] / sum(n.values()))
    state = s.state()
    assert state["seed"] == 0 and state["mixture"] == {"alpha": 3, "num": 1}
    assert state["store"] == store.fingerprint


# ---------------------------------------------------------------------------------------------
# epoch sampler


def _windows(sampler, steps) -> list[tuple[str, int]]:
    """(domain, start) of every row of ``steps``, in order."""
    out = []
    for step in steps:
        dom, start = sampler._draw(step)
        out += [(sampler._domains[d], int(s)) for d, s in zip(dom, start)]
    return out


def test_epoch_sampler_draws_every_window_once_per_epoch(small):
    store, L = small["store"], 16
    s = EpochSampler(store, seq_len=L, batch_size=7, seed=3)
    every = {(d, k * L) for d in ("alpha", "num")
             for k in range((store.n_tokens("train", d) - 1) // L)}
    M = s.epoch_rows
    assert M == len(every) and M % 7  # epochs end mid-batch
    rows = _windows(s, range(2 * M // 7 + 1))
    first, second = rows[:M], rows[M: 2 * M]
    assert len(set(first)) == M and set(first) == every  # each window exactly once
    assert set(second) == every and first != second  # the next epoch: another order
    assert abs(s.epoch(M // 7) - 1) < 7 / M
    b = s.batch(5)
    for row, (d, start) in zip(b, _windows(s, [5])):
        np.testing.assert_array_equal(row, store.tokens("train", d)[start: start + L + 1])
    assert not np.array_equal(b, EpochSampler(store, seq_len=L, batch_size=7, seed=4).batch(5))


def test_epoch_sampler_resumes_mid_epoch_with_the_same_batches(small):
    run = EpochSampler(small["store"], seq_len=16, batch_size=32, seed=1)
    assert run.epoch_rows > 32 * 10 and run.epoch_rows % 32  # 10 steps: inside epoch 1
    full = [run.batch(i) for i in range(run.epoch_rows // 32 + 3)]
    resumed = EpochSampler(small["store"], seq_len=16, batch_size=32, seed=1)
    for i in [5, 6, *range(len(full) - 4, len(full))]:  # mid-epoch and across its end
        np.testing.assert_array_equal(resumed.batch(i), full[i])
    assert run.state()["sampler"] == "epoch" and run.state()["epoch_rows"] == run.epoch_rows


def test_epoch_sampler_with_weights_walks_each_domain_through_its_windows(small):
    """alpha weighted 3:1 gets 3/4 of each epoch's rows: more than its windows, so each is
    drawn once or twice; num gets fewer than its windows and goes on where it left off, so
    its windows do not repeat until all were drawn."""
    store, L = small["store"], 16
    s = EpochSampler(store, seq_len=L, batch_size=8, mixture={"alpha": 3, "num": 1})
    M = s.epoch_rows
    rows = _windows(s, range(2 * M // 8))
    first = rows[:M]
    assert abs(sum(d == "alpha" for d, _ in first) / M - 0.75) < 0.01
    n = {d: (store.n_tokens("train", d) - 1) // L for d in ("alpha", "num")}
    alpha = Counter(w for d, w in first if d == "alpha")
    assert set(alpha) == {i * L for i in range(n["alpha"])} and set(alpha.values()) == {1, 2}
    num = [w for d, w in rows if d == "num"]  # two epochs: not yet all of num's windows
    assert n["num"] > len(num) > n["num"] // 2 and len(set(num)) == len(num)
    assert s.with_mixture(None).epoch_rows == EpochSampler(store, seq_len=L, batch_size=8).epoch_rows


def test_epoch_rows_split_over_data_parallel_devices_never_repeat(small):
    """Every process draws the same global batch and keeps its devices' rows (shard_batch):
    within an epoch, no window reaches two devices, or one device twice."""
    import jax

    from moelab.parallel.mesh import make_mesh, shard_batch

    s = EpochSampler(small["store"], seq_len=16, batch_size=8, seed=5)
    mesh = make_mesh(data=4, expert=2)
    seen: dict[tuple, int] = {}
    for step in range(30):
        ids = np.array([hash(w) % 2**31 for w in _windows(s, [step])], dtype=np.int32)
        keys = dict(zip(ids.tolist(), _windows(s, [step])))
        for shard in shard_batch(ids, mesh).addressable_shards:
            for i in np.asarray(shard.data).tolist():
                assert keys[i] not in seen, (step, shard.device, keys[i], seen.get(keys[i]))
                seen[keys[i]] = shard.device.id
    assert len(seen) == 30 * 8 and len(set(seen.values())) == len(jax.devices())


def test_mixture_errors(small):
    with pytest.raises(DataError, match=r"unknown domain\(s\) code; available in train: alpha"):
        MixtureSampler(small["store"], seq_len=16, batch_size=4, mixture={"code": 1.0})
    with pytest.raises(DataError, match="weight > 0"):
        MixtureSampler(small["store"], seq_len=16, batch_size=4, mixture={"alpha": 0.0})


def test_a_mixture_naming_a_domain_as_its_source_did_gets_the_stored_name():
    """A build keeps ASCII domain names (clean_domain): "café" is stored as "cafe-<hash>", so a
    mixture that names it as the source did is told the name to write."""
    from moelab.data.sampler import resolve_mixture

    class Store:  # what resolve_mixture reads of a token store
        def domains(self, split):
            return sorted([clean_domain("café"), clean_domain("日本語"), "prose"])

        def n_tokens(self, split, domain):
            return 1000

    with pytest.raises(DataError) as e:
        resolve_mixture(Store(), "train", 16, {"café": 1.0, "日本語": 1.0, "poetry": 1.0})
    assert str(e.value) == (
        f"data.mixture: unknown domain(s) café, poetry, 日本語; available in train: "
        f"{clean_domain('café')}, {clean_domain('日本語')}, prose; the corpus stores café as "
        f"{clean_domain('café')}, 日本語 as {clean_domain('日本語')}: name them so")
    assert resolve_mixture(Store(), "train", 16, {clean_domain("café"): 1.0}) == {
        clean_domain("café"): 1.0}


# ---------------------------------------------------------------------------------------------
# evaluation


def test_eval_windows_cover_the_stream_once(small):
    store, L = small["store"], 16
    toks = np.asarray(store.tokens("heldout", "alpha"))
    w, bpt = eval_windows(store, "alpha", L, max_tokens=10 * L + 5)
    assert w.shape == (10, L + 1) and w.dtype == np.int32
    np.testing.assert_array_equal(w[:, 1:].reshape(-1), toks[1: 10 * L + 1])  # targets, once
    np.testing.assert_array_equal(w[:-1, -1], w[1:, 0])  # consecutive, non-overlapping targets
    assert bpt == store.n_bytes("heldout", "alpha") / store.n_tokens("heldout", "alpha")
    w_all, _ = eval_windows(store, "alpha", L, max_tokens=10**9)  # capped by the stream
    assert len(w_all) == (len(toks) - 1) // L
    with pytest.raises(DataError, match="fewer than seq_len"):
        eval_windows(store, "alpha", len(toks), max_tokens=10**9)


def test_heldout_text(small):
    docs = [d["text"] for d in iter_documents(small["corpus"], "heldout") if d["domain"] == "num"]
    assert heldout_text(small["corpus"], "num") == "\n".join(docs) and docs
    with pytest.raises(DataError, match="available: alpha, num"):
        heldout_text(small["corpus"], "code")


def test_a_tokenizer_smaller_than_asked_is_said(tmp_path, capsys):
    """--vocab is a ceiling: a small corpus learns fewer merges, and the build says so (the
    file kept the asked size in its name with nothing said)."""
    from moelab.config import DataConfig
    from moelab.data.prepare import prepare_data

    src = tmp_path / "src" / "prose"
    src.mkdir(parents=True)
    for i in range(4):
        (src / f"d{i}.txt").write_text("the cat sat on the mat. " * 40)
    build_user_corpus([src], tmp_path / "data" / "corpus", heldout_fraction=0.2)
    prepare_data(DataConfig(data_dir=str(tmp_path / "data")), 5000, verbose=True)
    err = capsys.readouterr().err
    got = load_tokenizer(tmp_path / "data" / "tokenizer-5000.json").get_vocab_size()
    assert got < 5000 and f": {got:,} tokens, fewer than the 5,000 asked" in err


def test_a_tokenizer_trained_smaller_than_the_model_s_vocabulary_is_noted(tmp_path):
    """data.source with model.vocab_size=0 sizes the model before its tokenizer is trained,
    and a small corpus runs out of merges first: the start-up says how many rows go unused and
    how to size the model to the tokenizer. A folder's own tokenizer is taken at its size."""
    from types import SimpleNamespace

    from moelab.config import DataConfig
    from moelab.data.prepare import unused_rows_note

    tok = SimpleNamespace(get_vocab=lambda with_added_tokens: {"a": 0, "<|endoftext|>": 344})
    dcfg = DataConfig(data_dir=str(tmp_path))
    assert unused_rows_note(dcfg, tok, 4096) == (
        "note: the tokenizer trained on this corpus has 345 tokens, the model 4,096 embedding "
        "rows (its size was set before the tokenizer was trained); for a new run sized to it, "
        "`moelab data build ... --out NEW` gives a new data folder its own tokenizer, whose size "
        "model.vocab_size=0 then takes")
    assert unused_rows_note(dcfg, tok, 345) is None
    (tmp_path / "tokenizer.json").write_text("{}")  # the folder's own
    assert unused_rows_note(dcfg, tok, 4096) is None
