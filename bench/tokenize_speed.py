"""Token-store build speed (MB of text per second) by number of tokenizer processes.

    .venv/bin/python bench/tokenize_speed.py [--mb 8] [--workers 1,2] [--repeats 2]
                                             [--vocab 4096] [--tag NAME]

Builds the built-in corpus (or reuses data/builtin/corpus when it is there), keeps its first
``--mb`` MB of training documents as a corpus of its own, trains a ``--vocab`` BPE on it once,
then builds the token store with each ``--workers`` count (``build_token_store(workers=N)``:
1 tokenizes in this process, with the tokenizers library's threads; N > 1 in N spawned
processes, the pool's start-up included) and keeps the best of ``--repeats``, with the CPU
time of the build (this process and the pool's workers): on a shared machine the wall time
depends on what else runs, CPU time per MB much less. Every build must
give byte-identical arrays (checked: the script fails otherwise). Prints a table and saves
bench/results/tokenize_speed[-TAG].json.

Measured on 2 cores shared with other work (load 6-9), ``--mb 8 --repeats 3``: 1 worker
1.27 MB/s (4.0 CPU s), 2 workers 0.83 MB/s (4.8 CPU s); two earlier runs 0.96 vs 0.70 and
0.87 vs 0.65 MB/s. Stores byte-identical every time. One process's library threads already use
both cores; a second process adds its start-up and its own tokenizer.
"""

from __future__ import annotations

import json
import os
import resource
import tempfile
import time
from pathlib import Path

from common import count, counts, parser, print_table, run_main, save
from moelab.data import build_builtin_corpus, iter_documents, train_tokenizer
from moelab.data.build import BUILTIN_OUT
from moelab.data.corpus import write_corpus
from moelab.data.encode import usable_cores
from moelab.data.store import build_token_store
from moelab.data.user_docs import head

REPO = Path(__file__).resolve().parents[1]


def head_corpus(out: Path, mb: float) -> Path:
    """A corpus of the built-in corpus' first ``mb`` MB of training documents (all held out
    documents dropped: only the build speed is measured)."""
    full = REPO / BUILTIN_OUT / "corpus"
    if not (full / "manifest.json").is_file():
        full = out / "builtin"
        print(f"building the built-in corpus in {full} ...")
        build_builtin_corpus(full)
    corpus = out / "head"
    write_corpus(corpus, head(iter_documents(full, "train"), int(mb * 1e6)), 0.02,
                 {"kind": "bench"})
    return corpus


def store_arrays(store: Path) -> dict:
    """The arrays' recorded hashes: what must not depend on the worker count."""
    index = json.loads((store / "index.json").read_text())
    return {(s, d): e["sha256"] for s, doms in index["splits"].items() for d, e in doms.items()}


def measure(corpus: Path, tok, workers: int, repeats: int, out: Path) -> dict:
    mb = json.loads((corpus / "manifest.json").read_text())["total"]
    mb = sum(v["bytes"] for v in mb.values()) / 1e6
    best, cpu = float("inf"), float("inf")
    for r in range(repeats):
        store = out / f"store-{workers}-{r}"
        c0, t0 = cpu_seconds(), time.perf_counter()
        build_token_store(corpus, tok, store, progress=False, workers=workers)
        best = min(best, time.perf_counter() - t0)
        cpu = min(cpu, cpu_seconds() - c0)
    return {"workers": workers, "text_mb": mb, "seconds": best, "mb_per_s": mb / best,
            "cpu_s": cpu, "mb_per_cpu_s": mb / cpu, "arrays": store_arrays(store)}


def cpu_seconds() -> float:
    """CPU time of this process and its finished children (the pool's workers)."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    p = parser(__doc__, "tokenize_speed[-TAG].json")
    p.add_argument("--mb", type=float, default=8.0, help="MB of the built-in corpus to tokenize")
    p.add_argument("--workers", type=counts, default=[1, 2], help="comma-separated worker counts")
    p.add_argument("--repeats", type=count, default=2)
    p.add_argument("--vocab", type=count, default=4096)
    p.add_argument("--tag", default="")
    args = p.parse_args()
    workers = args.workers
    with tempfile.TemporaryDirectory(prefix="tokenize_speed-") as tmp:
        out = Path(tmp)
        corpus = head_corpus(out, args.mb)
        tok = train_tokenizer(corpus, out / "tokenizer.json", vocab_size=args.vocab)
        rows = [measure(corpus, tok, w, args.repeats, out) for w in workers]
    same = all(r["arrays"] == rows[0]["arrays"] for r in rows)
    for r in rows:
        r["speedup"] = r["mb_per_s"] / rows[0]["mb_per_s"]
        del r["arrays"]
    print_table(rows, [("workers", "workers", "d"), ("text_mb", "text MB", ".1f"),
                       ("seconds", "best s", ".2f"), ("mb_per_s", "MB/s", ".2f"),
                       ("cpu_s", "CPU s", ".1f"), ("mb_per_cpu_s", "MB/CPU s", ".2f"),
                       ("speedup", f"x {workers[0]} worker(s)", ".2f")])
    print(f"token stores byte-identical across worker counts: {same}")
    name = "tokenize_speed" + (f"-{args.tag}" if args.tag else "")
    save(name, rows, device_info=False, cores=usable_cores(), load=os.getloadavg(),
         vocab=args.vocab, repeats=args.repeats, identical=same)
    if not same:
        raise SystemExit("the token stores differ between worker counts")


if __name__ == "__main__":
    run_main(main)
