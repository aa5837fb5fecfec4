"""What fills XLA's temp memory in one MoE layer's forward + backward, per transport.

    .venv/bin/python bench/transport_buffers.py [--tokens-per-rank 1024] [--top 12]

The program is bench/transport.py's Table 1 step (EP 8 on 8 fake CPU devices, the router
model's shape: 64 experts top-8, H = I = 64, float32) for pooled_wave W=4 (cf_s 1.10, cf_r 1.15)
and pooled_global W=4 G=8 (its default global_sender_cf, cf_r 1.10, the model's grouped kernel:
blocks of 128 rows). Memory depends only on shapes, so the inputs are abstract and no router is
needed. XLA dumps its buffer assignment and live ranges; this finds the instruction where the
temp allocation is fullest and lists the buffers live there, grouped by shape, largest first,
next to ``compiled.memory_analysis()``'s temp bytes. Saved as bench/results/transport_buffers.json.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

# XLA reads its flags once, so they are set on import; it creates the folder when it first
# dumps, and main() removes it (importing alone leaves nothing behind)
DUMP = os.path.join(tempfile.gettempdir(), f"xla-dump-transport-buffers-{os.getpid()}")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_"
                           f"count=8 --xla_dump_to={DUMP} --xla_dump_hlo_as_text "
                           "--xla_dump_hlo_module_re=.*loss.*").strip()

import re  # noqa: E402
import shutil  # noqa: E402
from collections import defaultdict  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402

from common import count, parser, print_table, run_main, save  # noqa: E402
from moelab.config import ParallelConfig  # noqa: E402
from moelab.parallel import transport  # noqa: E402
from moelab.parallel.mesh import batch_spec, expert_weight_spec, make_mesh  # noqa: E402

MiB = 2**20
S, E, K, H, I = 8, 64, 8, 64, 64
CONFIGS = {
    "pooled_wave W=4": (ParallelConfig(transport="pooled_wave", sender_cf=1.10,
                                       receiver_cf=1.15, waves=4), ("blocks", 32)),
    "pooled_global W=4 G=8": (ParallelConfig(transport="pooled_global", receiver_cf=1.10,
                                             waves=4, budget_group=8), ("blocks", 128)),
}
_VALUE = re.compile(r"value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_RANGE = re.compile(r"^\s+(\S+?)(\{[^}]*\})?:(\d+)-(\d+)$")


def compile_step(tcfg: ParallelConfig, kernel, tokens_per_rank: int):
    """bench/transport.py's step: value_and_grad of sum(out * g) over (z, weights, experts)."""
    mesh = make_mesh(expert=S)
    tok, wsh = NamedSharding(mesh, batch_spec(2)), NamedSharding(mesh, expert_weight_spec(3))
    N = S * tokens_per_rank
    f32 = jnp.float32
    z, g = (jax.ShapeDtypeStruct((N, H), f32, sharding=tok) for _ in range(2))
    expert = jax.ShapeDtypeStruct((N, K), jnp.int32, sharding=tok)
    weight = jax.ShapeDtypeStruct((N, K), f32, sharding=tok)
    w = {"w_gate": jax.ShapeDtypeStruct((E, H, I), f32, sharding=wsh),
         "w_up": jax.ShapeDtypeStruct((E, H, I), f32, sharding=wsh),
         "w_down": jax.ShapeDtypeStruct((E, I, H), f32, sharding=wsh)}
    fn = transport.make_transport_fn(mesh, tcfg, kernel)

    def loss(z, expert, weight, w, g):
        out, stats = fn(z, expert, weight, w)
        return jnp.sum(out.astype(f32) * g), stats

    step = jax.value_and_grad(loss, argnums=(0, 2, 3), has_aux=True)
    return jax.jit(step).lower(z, expert, weight, w, g).compile()


def temp_values(assignment: str) -> dict[str, tuple[int, int, str]]:
    """{value name: (size, offset, shape)} of the preallocated temp allocation."""
    out, in_temp = {}, False
    for line in assignment.splitlines():
        if line.startswith("allocation"):
            in_temp = "preallocated-temp" in line
        elif in_temp and (m := _VALUE.search(line)):
            name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
            out[name] = (int(m.group(2)), int(m.group(3)), m.group(4))
    return out


def live_ranges(text: str) -> dict[str, tuple[int, int]]:
    out, on = {}, False
    for line in text.splitlines():
        on = on or line.strip() == "BufferLiveRange:"
        if on and (m := _RANGE.match(line)):
            out[m.group(1) + (m.group(2) or "{}")] = (int(m.group(3)), int(m.group(4)))
    return out


def peak_buffers(values: dict, ranges: dict) -> tuple[int, list[tuple[str, int]]]:
    """Bytes in use at the fullest instruction and the buffers then live: (shape, bytes), one
    per distinct (offset, size) (aliases of one buffer, e.g. bitcasts, counted once)."""
    live_at = defaultdict(set)
    for name, (size, offset, shape) in values.items():
        if name in ranges:
            start, end = ranges[name]
            for t in range(start, end + 1):
                live_at[t].add((offset, size, shape))
    peak_t = max(live_at, key=lambda t: sum(s for _, s, _ in live_at[t]))
    bufs = {(o, s): shape for o, s, shape in live_at[peak_t]}
    return sum(s for _, s in bufs), sorted(((shape, s) for (_, s), shape in bufs.items()),
                                           key=lambda b: -b[1])


def breakdown(name: str, tcfg: ParallelConfig, kernel, tokens_per_rank: int, top: int) -> dict:
    shutil.rmtree(DUMP, ignore_errors=True)  # the previous transport's dumps
    temp = compile_step(tcfg, kernel, tokens_per_rank).memory_analysis().temp_size_in_bytes
    read = lambda suffix: next(Path(DUMP).glob(f"*{suffix}")).read_text()
    live, bufs = peak_buffers(temp_values(read("buffer-assignment.txt")), live_ranges(
        read("live-range.txt")))
    by_shape: dict[str, list[int]] = defaultdict(list)
    for shape, size in bufs:
        by_shape[shape].append(size)
    rows = sorted(({"shape": s, "n": len(v), "mib": sum(v) / MiB} for s, v in by_shape.items()),
                  key=lambda r: -r["mib"])
    print(f"\n{name}: temp {temp / MiB:.2f} MiB (memory_analysis); live at the fullest "
          f"instruction {live / MiB:.2f} MiB in {len(bufs)} buffers")
    print_table(rows[:top], [("shape", "shape", "s"), ("n", "buffers", "d"),
                             ("mib", "MiB", ".2f")])
    return {"transport": name, "temp_mib": temp / MiB, "live_mib": live / MiB,
            "buffers": rows}


def main() -> None:
    ap = parser(__doc__, "transport_buffers_t<TOKENS_PER_RANK>.json")
    ap.add_argument("--tokens-per-rank", type=count, default=1024)
    ap.add_argument("--top", type=count, default=12, help="shapes listed per transport")
    args = ap.parse_args()
    try:
        rows = [breakdown(name, tcfg, kernel, args.tokens_per_rank, args.top)
                for name, (tcfg, kernel) in CONFIGS.items()]
    finally:
        shutil.rmtree(DUMP, ignore_errors=True)
    ratio = rows[1]["temp_mib"] / rows[0]["temp_mib"]
    print(f"\ntemp pooled_global / pooled_wave: {ratio:.2f}")
    save(f"transport_buffers_t{args.tokens_per_rank}", rows, tokens_per_rank=args.tokens_per_rank,
         temp_ratio=ratio)


if __name__ == "__main__":
    run_main(main)
