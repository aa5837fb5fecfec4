"""Streaming (``data.sampler: stream``): a ``memory://`` source tokenized while training, only
its head kept locally; the position saved with each checkpoint; a resume mid-stream gives the
same tokens in the same order as an uninterrupted run."""

from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import fsspec
import numpy as np
import pytest

from helpers import micro_config
from moelab.config import ConfigError, DataConfig, config_from_dict
from moelab.data import DataError, decode, encode_batch, eos_id, load_tokenizer
from moelab.data.corpus import is_heldout, iter_documents, load_manifest
from moelab.data.prepare import prepare_data
from moelab.data.stream import StreamSampler
from moelab.run.checkpoint import Checkpointer
from moelab.run.identity import checkpoint_meta
from moelab.run.logs import read_metrics
from moelab.train.loop import train

WORDS = "alpha beta gamma delta zeta theta kappa lambda sigma omega river stone".split()
N_FILES, N_DOCS = 4, 60


def write_source(root: str, bad_line: int = 0) -> tuple[str, int]:
    """N_FILES JSONL files of N_DOCS documents, each starting with its marker ``d<file>_<i>``;
    (the source's URL, its text bytes). ``bad_line``: part1.jsonl's line of that number is
    malformed JSON."""
    fs, rng, size = fsspec.filesystem("memory"), random.Random(0), 0
    for f in range(N_FILES):
        texts = [f"d{f}_{i} " + " ".join(rng.choices(WORDS, k=rng.randint(30, 80)))
                 for i in range(N_DOCS)]
        size += sum(len(t) for t in texts)
        lines = [json.dumps({"text": t}) + "\n" for t in texts]
        if f == 1 and bad_line:
            lines.insert(bad_line - 1, '{"text": cut off\n')
        fs.pipe(f"/{root}/web/part{f}.jsonl", "".join(lines).encode())
    return f"memory://{root}", size


def stream_config(data_dir: Path, source: str, **kw) -> DataConfig:
    base = dict(data_dir=str(data_dir), source=source, sampler="stream", stream_head_mb=0.006,
                stream_shuffle=8, seq_len=16, batch_size=4)
    return DataConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def streamed(tmp_path_factory):
    """A source, its head prepared in a data folder, and that folder's tokenizer."""
    source, size = write_source("stream-src")
    data = stream_config(tmp_path_factory.mktemp("stream") / "data", source)
    prep = prepare_data(data, 300, verbose=False)
    return {"source": source, "size": size, "data": data, "prep": prep,
            "tok": load_tokenizer(prep.tokenizer_path)}


def sampler(s, **kw) -> StreamSampler:
    data = stream_config(Path(s["data"].data_dir), s["source"], **kw)
    return StreamSampler(data, s["tok"], s["prep"].corpus_dir)


def test_only_the_head_is_kept_locally(streamed):
    corpus = streamed["prep"].corpus_dir
    manifest = load_manifest(corpus)
    kept = sum(v["bytes"] for v in manifest["total"].values())  # text bytes
    assert manifest["head_bytes"] == 6000
    assert 6000 <= kept < 6000 + 700 < streamed["size"] / 10  # the head and one document
    ids = [d["id"] for d in iter_documents(corpus, "train")]
    assert ids[0] == "stream-src/web/part0.jsonl line 1" and all("part0" in i for i in ids)


def test_the_stream_is_every_training_document_in_order_then_again(streamed):
    """In stream order (stream_shuffle 1), consecutive windows overlap by one token and spell
    out the training documents of the whole source, each followed by EOS, held-out ones left
    out; the second pass starts over."""
    tok = streamed["tok"]
    manifest = load_manifest(streamed["prep"].corpus_dir)
    held = {d["id"] for d in iter_documents(streamed["prep"].corpus_dir, "heldout")}
    fs = fsspec.filesystem("memory")
    docs = [(f"stream-src/web/part{f}.jsonl line {i + 1}", json.loads(line)["text"])
            for f in range(N_FILES)
            for i, line in enumerate(fs.cat_file(f"/stream-src/web/part{f}.jsonl").splitlines())]
    trained = [t for i, t in docs if not is_heldout(i, manifest["heldout_fraction"])
               and i not in held]
    assert len(held) >= 1 and len(trained) < len(docs)
    want = [x for ids in encode_batch(tok, trained) for x in ids + [eos_id(tok)]]
    s = sampler(streamed, stream_shuffle=1)
    n_steps = 2 * len(want) // (16 * 4) + 2
    rows = np.concatenate([s.batch(i) for i in range(n_steps)])
    np.testing.assert_array_equal(rows[1:, 0], rows[:-1, -1])  # stride 16, one shared token
    got = np.concatenate([rows[0], rows[1:, 1:].reshape(-1)])
    np.testing.assert_array_equal(got[: len(want)], want)
    np.testing.assert_array_equal(got[len(want): 2 * len(want)], want)  # the second pass
    markers = re.findall(r"d\d_\d+", decode(tok, got[: len(want)]))
    assert markers == [t.split()[0] for t in trained]


def test_a_malformed_record_past_the_head_is_reported_once(tmp_path):
    """The head's build never saw it; the stream skips it and says so once, not every pass."""
    source, _ = write_source("stream-bad", bad_line=5)
    data = stream_config(tmp_path / "data", source)
    prep = prepare_data(data, 300, verbose=False)
    s = StreamSampler(data, load_tokenizer(prep.tokenizer_path), prep.corpus_dir)
    assert s.new_skips() == []
    for step in range(2 * N_FILES * N_DOCS * 60 // (16 * 4)):  # two passes and more
        s.batch(step)
    assert s.stream.skipped.n >= 2  # met on each pass
    assert s.new_skips() == [("stream-bad/web/part1.jsonl line 5", "not valid JSON")]
    assert s.new_skips() == []
    s.close()


class _FoundWhileRead(list):
    """A skip list to which the reading thread adds a skip while ``new_skips`` reads it."""

    def __getitem__(self, i):
        out = super().__getitem__(i)
        if isinstance(i, slice) and len(self) == 1:
            self.append(("b.jsonl line 2", "not valid JSON"))
        return out


def test_a_skip_found_while_the_skips_are_read_is_said_next_time(streamed):
    s = sampler(streamed)
    s.stream.skipped.found = _FoundWhileRead([("a.jsonl line 1", "not valid JSON")])
    assert s.new_skips() == [("a.jsonl line 1", "not valid JSON")]
    assert s.new_skips() == [("b.jsonl line 2", "not valid JSON")]
    s.close()


def test_shuffled_blocks_hold_the_stream_windows(streamed):
    in_order = sampler(streamed, stream_shuffle=1)
    shuffled = sampler(streamed, stream_shuffle=8)
    a = np.concatenate([in_order.batch(i) for i in range(6)])  # 24 windows = 3 blocks
    b = np.concatenate([shuffled.batch(i) for i in range(6)])
    assert not np.array_equal(a, b)
    for k in range(3):  # each block: the same 8 windows, in another order
        assert sorted(map(bytes, a[8 * k: 8 * k + 8])) == sorted(map(bytes, b[8 * k: 8 * k + 8]))


def test_a_resume_mid_stream_draws_the_same_tokens_in_the_same_order(streamed):
    """Killed after step 23 (mid-block, a checkpoint's state through JSON): a new sampler
    restored there draws what the uninterrupted one draws, across a context stage too."""
    kw = {"context_stages": []}
    full = sampler(streamed, **kw)
    want = [full.batch(i) for i in range(60)]
    for stop in (23, 24):  # mid-block, and at a block's end
        first = sampler(streamed, **kw)
        for i in range(stop):
            first.batch(i)
        state = json.loads(json.dumps(first.state()))
        assert state["sampler"] == "stream" and state["step"] == stop
        resumed = sampler(streamed, **kw)
        resumed.restore(stop, state)
        for i in range(stop, 60):
            np.testing.assert_array_equal(resumed.batch(i), want[i])
    with pytest.raises(DataError, match="read in order"):
        resumed.batch(3)


def test_a_context_stage_starts_a_new_block_and_resumes_across_it(streamed):
    from moelab.config.data import ContextStage

    data = stream_config(Path(streamed["data"].data_dir), streamed["source"],
                         context_stages=[ContextStage(step=5, seq_len=32)])
    full = StreamSampler(data, streamed["tok"], streamed["prep"].corpus_dir)
    want = [full.batch(i) for i in range(12)]
    assert want[4].shape == (4, 17) and want[5].shape == (2, 33)
    assert full.change_at(5) == {"seq_len": 32, "batch_size": 2} and full.change_at(6) is None
    for stop in (5, 7):
        first = StreamSampler(data, streamed["tok"], streamed["prep"].corpus_dir)
        for i in range(stop):
            first.batch(i)
        resumed = StreamSampler(data, streamed["tok"], streamed["prep"].corpus_dir)
        resumed.restore(stop, json.loads(json.dumps(first.state())))
        for i in range(stop, 12):
            np.testing.assert_array_equal(resumed.batch(i), want[i])


def test_a_changed_source_or_a_missing_position_is_refused(tmp_path):
    source, _ = write_source("stream-changing")
    data = stream_config(tmp_path / "data", source, stream_head_mb=0.002)
    prep = prepare_data(data, 300, verbose=False)
    tok = load_tokenizer(prep.tokenizer_path)
    s, step = StreamSampler(data, tok, prep.corpus_dir), 0
    while s.state().get("file") != "stream-changing/web/part1.jsonl":  # into the second file
        s.batch(step)
        step += 1
        assert step < 1000
    state = s.state()
    with pytest.raises(DataError, match="holds no stream position .*another data.sampler"):
        StreamSampler(data, tok, prep.corpus_dir).restore(step, {"sampler": "epoch"})
    fs = fsspec.filesystem("memory")
    fs.pipe("/stream-changing/web/part1.jsonl",
            fs.cat_file("/stream-changing/web/part1.jsonl").replace(b"a", b"o"))
    with pytest.raises(DataError, match="now ends at .*the source changed"):
        StreamSampler(data, tok, prep.corpus_dir).restore(step, state)
    fs.mv("/stream-changing/web/part1.jsonl", "/stream-changing/web/part9.jsonl")
    with pytest.raises(DataError, match="input file 1 is now 'stream-changing/web/part2.jsonl'"):
        StreamSampler(data, tok, prep.corpus_dir).restore(step, state)


def test_a_same_length_edit_inside_the_block_is_refused(tmp_path):
    """The block drawn from at the checkpoint keeps its end when two words of a training
    document in it trade places (the token count unchanged): its tokens' digest refuses the
    resume. Unchanged, it resumes to the same batches; a state without a digest (saved before
    digests were recorded) resumes unchecked."""
    source, _ = write_source("stream-same-length")
    data = stream_config(tmp_path / "data", source, stream_head_mb=0.002, stream_shuffle=64)
    prep = prepare_data(data, 300, verbose=False)
    tok = load_tokenizer(prep.tokenizer_path)

    def new():
        return StreamSampler(data, tok, prep.corpus_dir)

    s, step, name = new(), 0, "stream-same-length/web/part1.jsonl"
    while s.state().get("file") != name or s.state()["taken"] in (0, 64):
        s.batch(step)  # mid-block, the block starting in the second file
        step += 1
        assert step < 1000
    state = json.loads(json.dumps(s.state()))
    want = [s.batch(i) for i in range(step, step + 20)]  # into the next block
    resumed = new()
    resumed.restore(step, state)
    for i, batch in enumerate(want):
        np.testing.assert_array_equal(resumed.batch(step + i), batch)

    start, end = state["start"], state["end"]
    held = {d["id"] for d in iter_documents(prep.corpus_dir, "heldout")}
    fraction = load_manifest(prep.corpus_dir)["heldout_fraction"]
    doc = next(k for k in range(start["doc"] + 1, N_DOCS)  # a training document in the block
               if not is_heldout(f"{name} line {k + 1}", fraction)
               and f"{name} line {k + 1}" not in held)
    assert (1, doc) < (end["file"], end["doc"])
    fs, path = fsspec.filesystem("memory"), "/" + name
    lines = fs.cat_file(path).decode().splitlines(keepends=True)
    words = json.loads(lines[doc])["text"].split()
    i = next(i for i in range(1, len(words) - 1) if words[i] != words[i + 1])
    edited = " ".join(words[:i] + [words[i + 1], words[i]] + words[i + 2:])
    assert len(tok.encode(edited).ids) == len(tok.encode(" ".join(words)).ids)
    lines[doc] = json.dumps({"text": edited}) + "\n"
    fs.pipe(path, "".join(lines).encode())
    with pytest.raises(DataError, match=r"the block the checkpoint of step \d+ was drawing from "
                                        rf"\(.*'{name}'.*\) now holds other tokens .*the source "
                                        "changed since the checkpoint: restore it, or start a "
                                        "new run"):
        new().restore(step, state)
    new().restore(step, {k: v for k, v in state.items() if k != "digest"})  # an old checkpoint

def test_stream_config_errors(tmp_path):
    def cfg(**data):
        return config_from_dict({"data": {"sampler": "stream", **data}})

    with pytest.raises(ConfigError, match="data.source: data.sampler=stream reads"):
        cfg()
    with pytest.raises(ConfigError, match="data.format: hf-files reads a local copy"):
        cfg(source="x", format="hf-files")
    with pytest.raises(ConfigError, match="data.mixture: a stream gives the documents"):
        cfg(source="x", mixture={"a": 1})
    with pytest.raises(ConfigError, match="data.stream_shuffle: must be >= 1"):
        cfg(source="x", stream_shuffle=0)
    with pytest.raises(ConfigError, match="data.sampler: must be one of epoch, random, stream"):
        config_from_dict({"data": {"sampler": "shuffled"}})


def test_a_head_folder_serves_only_the_stream_it_was_made_for(streamed):
    data = streamed["data"]
    with pytest.raises(ConfigError, match=r"data.stream_head_mb=0.01: .* holds the first "
                                          r"0.006 MB of the source; set data.stream_head_mb=0.006"):
        prepare_data(stream_config(Path(data.data_dir), data.source, stream_head_mb=0.01), 300,
                     verbose=False)
    with pytest.raises(ConfigError, match="data.sampler=epoch: .* holds only the first 0.006 MB "
                                          ".*set data.sampler=stream"):
        prepare_data(DataConfig(data_dir=data.data_dir, source=data.source), 300, verbose=False)


def test_training_killed_mid_stream_resumes_to_the_uninterrupted_losses(tmp_path, data_dir):  # noqa: F811
    """A micro run streaming its source, 8 steps with a checkpoint every 3; a copy killed
    after step 5 (its later checkpoints gone) resumes from step 3, mid-block, and trains steps
    4-8 to the same losses. The data folder holds the head only, while training read past it.
    (``data_dir``: the session's compilation cache, shared with the other micro runs.)"""
    source, size = write_source("stream-train", bad_line=2)
    data = {"data_dir": str(tmp_path / "data"), "source": source, "sampler": "stream",
            "stream_head_mb": 0.003, "stream_shuffle": 5}
    cfg = micro_config(tmp_path, data=data, train={"steps": 8, "ckpt_every": 3})
    once = tmp_path / "once"
    train(cfg, once, verbose=False, sample_prompt=None)
    killed = shutil.copytree(once, tmp_path / "killed")
    ckpt = Checkpointer(killed / "checkpoints")
    assert ckpt.steps() == [3, 6, 8]
    for step in (6, 8):  # killed after step 5: what it logged and saved later never was
        shutil.rmtree(ckpt.step_dir(step))
    log = killed / "metrics.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines()
                           if json.loads(line)["step"] <= 5))
    state = checkpoint_meta(killed, 3)[1]["data"]
    assert (state["sampler"], state["step"], state["taken"]) == ("stream", 3, 2)  # 12 rows
    train(cfg, killed, verbose=False, sample_prompt=None)

    def losses(run):
        recs, _ = read_metrics(run / "metrics.jsonl")  # the newest record of a step wins
        return {r["step"]: r["train/loss"] for r in recs if "train/loss" in r}

    assert sorted(losses(once)) == list(range(1, 9)) and losses(killed) == losses(once)
    def skips(run):  # the malformed line past the head: said as it was read
        return [(e["where"], e["reason"]) for e in read_metrics(run / "metrics.jsonl")[1]
                if e["event"] == "data_skipped"]

    bad = ("stream-train/web/part1.jsonl line 2", "not valid JSON")
    assert skips(once) == [bad] and set(skips(killed)) == {bad}  # the resume says it again
    resumed = [e for e in read_metrics(log)[1] if e["event"] == "resume"]
    assert [e["step"] for e in resumed] == [3]
    head = load_manifest(tmp_path / "data" / "corpus")
    assert size > 10 * sum(v["bytes"] for v in head["total"].values())  # never the whole source
    at = checkpoint_meta(once)[1]["data"]["end"]
    assert (at["file"], at["doc"]) > (0, sum(v["docs"] for v in head["total"].values()))
