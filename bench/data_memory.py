"""Peak memory of `moelab data build` on one single-line text file: the multiple of its size.

    .venv/bin/python bench/data_memory.py [--mb 50] [--vocab 512] [--no-spaces] [--src PATH]
                                          [--tag NAME]

Writes a deterministic single-line text of ``--mb`` MB (random words from a small vocabulary,
no newline; ``--no-spaces``: letters without any whitespace, one "word"), runs ``moelab data build FILE --out ...`` in a child process and reads the child's
peak resident memory (``ru_maxrss`` of the waited-for children). ``--src`` runs another
checkout's ``src`` (e.g. the code before a change) for a comparison. A limit on the child's
address space (``--cap-gb``, default 16) keeps a runaway build from taking the machine.
Saves bench/results/data_memory[-TAG].json.

Measured (2 shared cores, --mb 50, --vocab 512): before documents were bounded, 9075 MB peak
(181x the file, 118 s); with texts cut at ``user_docs.MAX_DOC_CHARS`` and batches at
``tokenizer.BATCH_CHARS``, 832 MB (17x, 104 s), of which ~200 MB is the interpreter and
libraries. ``--no-spaces``: before the tokenizer trainer got long runs in pieces
(``tokenizer.WORD_CAP``), training alone took 17 s on 0.2 MB and had not finished after 300 s
on 2 MB; after, the whole build took 14.6 s and 901 MB on 10 MB, 78 s and 2767 MB (55x) on
50 MB. BPE training keeps every distinct word: a text whose words never repeat costs memory in
proportion to its size.
"""

from __future__ import annotations

import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import count, parser, print_table, run_main, save

WORDS = ("the of and to in is was that for it with as his on be at by had not are but from or "
         "have an they which one you were her all she there would their we him been has when who "
         "will more no if out so said what up its about into than them can only other new some "
         "could time these two may then do first any my now such like our over man me even most "
         "made after also did many before must through back years where much your way well down "
         "should because each just those people how too little state good very make world still "
         "own see men work long get here between both life being under never day same another "
         "know while last might us great old year off come since against go came right used take "
         "three").split()


def write_single_line(path: Path, mb: float, spaces: bool = True) -> int:
    """A text of ``mb`` MB with no newline (and no whitespace at all unless ``spaces``);
    returns its size in bytes."""
    rng = random.Random(0)
    target = int(mb * 1e6)
    with open(path, "w", encoding="ascii") as f:
        n = 0
        while n < target:
            chunk = (" ".join(rng.choices(WORDS, k=20000)) + " " if spaces
                     else "".join(rng.choices("abcdefgh", k=100000)))
            f.write(chunk)
            n += len(chunk)
    return path.stat().st_size


def run_build(src: Path, text: Path, out: Path, vocab: int, cap_gb: float) -> dict:
    cap = int(cap_gb * 2**30)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))

    env = {**os.environ, "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "moelab.cli", "data", "build", str(text),
                           "--out", str(out), "--vocab", str(vocab), "--no-progress"],
                          env=env, preexec_fn=limit, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024  # KiB on Linux
    last = (proc.stderr.strip().splitlines() or [""])[-1]
    return {"rc": proc.returncode, "seconds": seconds, "peak_rss_mb": peak / 1e6,
            "last_line": last[:200]}


def main() -> None:
    p = parser(__doc__, "data_memory[-TAG].json")
    p.add_argument("--mb", type=float, default=50.0)
    p.add_argument("--vocab", type=count, default=512)
    p.add_argument("--src", default=str(Path(__file__).resolve().parents[1] / "src"))
    p.add_argument("--tag", default="")
    p.add_argument("--cap-gb", type=float, default=16.0)
    p.add_argument("--no-spaces", action="store_true", help="a text without whitespace")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="data_memory-") as tmp:
        text = Path(tmp) / "one_line.txt"
        size = write_single_line(text, args.mb, spaces=not args.no_spaces)
        row = {"input_mb": size / 1e6, **run_build(Path(args.src), text, Path(tmp) / "out",
                                                   args.vocab, args.cap_gb)}
    row["multiple"] = row["peak_rss_mb"] / row["input_mb"]
    print_table([row], [("input_mb", "input MB", ".1f"), ("rc", "exit", "d"),
                        ("seconds", "s", ".1f"), ("peak_rss_mb", "peak RSS MB", ".0f"),
                        ("multiple", "x input", ".1f")])
    if row["rc"]:
        print(f"build failed: {row['last_line']}")
    name = "data_memory" + (f"-{args.tag}" if args.tag else "")
    save(name, [row], device_info=False, src=args.src, vocab=args.vocab,
         no_spaces=args.no_spaces)


if __name__ == "__main__":
    run_main(main)
