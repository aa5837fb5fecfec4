"""`moelab drops RUN`: its options, the transports it compares and its table. The forecast
itself (held-out text routed by the run's model, re-cut at each context and run through each
transport's drop rule) is ``moelab.parallel.forecast``, which a drop-gated context stage uses
too.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moelab.config import ConfigError, ParallelConfig, RunConfig
from moelab.config.errors import require
from moelab.parallel.transport import TRANSPORTS, get
from moelab.util import check_output_file

# Per-rank counts a transport checks against the local experts E_l: a run trained without
# expert parallelism never used them, so a forecast at EP > 1 fits them to E_l (and says so).
PER_RANK_FIELDS = {"pooled_wave": "waves", "pooled_global": "budget_group"}


def check_options(seq_lens: list[int], transport: list[str] | None, ranks: int | None,
                  tokens_per_rank: int | None, batches: int, seed: int,
                  json_out: str | None) -> None:
    """The options of `moelab drops` that need no run, checked before it is loaded; each
    error names the option as typed."""
    for L in seq_lens:
        require(L >= 1, f"--seq-len {L}", "must be >= 1 (a multiple of the run's data.seq_len)")
    for name in transport or []:
        require(name in TRANSPORTS, f"--transport {name}",
                f"unknown; choose from {', '.join(TRANSPORTS)}")
    require(ranks is None or ranks >= 2, f"--ranks {ranks}", "must be >= 2 (an EP group)")
    require(tokens_per_rank is None or tokens_per_rank >= 1, f"--tokens-per-rank "
            f"{tokens_per_rank}", "must be >= 1 (a multiple of every --seq-len)")
    require(batches >= 1, f"--batches {batches}", "must be >= 1")
    require(seed >= 0, f"--seed {seed}", "must be >= 0")
    if json_out is not None:
        check_output_file(json_out, "--json")


def default_ranks(cfg: RunConfig) -> int:
    """The EP degree a forecast uses unless --ranks is given: the run's own, or without
    expert parallelism the largest of 8, 4 and 2 dividing the experts."""
    E = cfg.model.n_experts
    if cfg.parallel.expert > 1:
        return cfg.parallel.expert
    ranks = next((r for r in (8, 4, 2) if E % r == 0), 0)
    require(ranks > 0, f"model.n_experts={E}", "none of 8, 4 or 2 divides it: give --ranks")
    return ranks


def fit_per_rank(par: ParallelConfig, n_local: int) -> tuple[ParallelConfig, str | None]:
    """``par`` with its transport's per-rank count (PER_RANK_FIELDS) lowered to the largest
    divisor of the ``n_local`` local experts, and a note saying so (None: unchanged)."""
    field = PER_RANK_FIELDS.get(par.transport)
    value = getattr(par, field, 0) if field else 0
    if value < 1 or n_local % value == 0:
        return par, None
    fitted = max(d for d in range(1, min(value, n_local) + 1) if n_local % d == 0)
    return replace(par, **{field: fitted}), (
        f"{par.transport}: parallel.{field} {value} -> {fitted} for {n_local} local expert(s) "
        f"per rank (the run trained without expert parallelism; set parallel.{field}=N to "
        "choose)")


def transports(cfg: RunConfig, names: list[str] | None, ranks: int, *, ranks_given: bool = True,
               overridden: frozenset[str] = frozenset(), say=print) -> dict[str, ParallelConfig]:
    """The run's parallel config with each named transport, at ``ranks`` ranks; checked. A run
    trained without expert parallelism gets per-rank counts that fit (``fit_per_rank``) unless
    ``overridden`` names them (``parallel.FIELD``)."""
    out = {}
    n_local = cfg.model.n_experts // ranks
    for name in names or [cfg.parallel.transport]:
        par = replace(cfg.parallel, transport=name, expert=ranks, devices=ranks)
        if cfg.parallel.expert == 1 and f"parallel.{PER_RANK_FIELDS.get(name)}" not in overridden:
            par, note = fit_per_rank(par, n_local)
            if note:
                say(note)
        try:
            get(name).check(par, n_local)
        except ConfigError as e:  # the option typed, when the EP degree was typed
            raise ConfigError(f"--ranks {ranks}: {e}" if ranks_given else str(e)) from None
        out[name] = par
    return out


def check_place_from(run_dir: Path, cfg: RunConfig, old: int, new: int, steps: list[int]) -> None:
    """``--place-from OLD``: a checkpoint before the forecasting one (``new``), whose experts
    sit where they sit at ``new`` (no re-placement in between: the routing's expert ids of
    the two models must name the same experts)."""
    from moelab.run.logs import read_metrics

    require(old in steps and old < new, f"--place-from {old}", "must be a checkpoint of the "
            f"run before step {new}; it has {', '.join(map(str, steps))}")
    moved = [c.step for c in cfg.data.context_stages if c.placement and old < c.step <= new]
    path = Path(run_dir) / "metrics.jsonl"
    if path.is_file():
        moved += [e["step"] for e in read_metrics(path)[1] if e.get("event") == "replace_experts"
                  and e.get("moved") and old < e["step"] <= new]
    require(not moved, f"--place-from {old}", f"the run re-placed its experts at step "
            f"{min(moved) if moved else 0}, after it: the two models number their experts "
            "differently; give a checkpoint from that step on")


def format_rows(rows: list[dict], names: list[str]) -> str:
    head = f"{'seq len':>8} {'x now':>6} {'seqs/rank':>9}" + "".join(
        f" {n + ' (sender + receiver)':>36}" for n in names)
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join(f" {r[n]['drop']:>12.2%} ({100 * r[n]['sender']:.2f} + "
                        f"{100 * r[n]['receiver']:.2f})".rjust(37) for n in names)
        lines.append(f"{r['seq_len']:>8} {r['x_now']:>6.0f} {r['seqs_per_rank']:>9}{cells}")
    return "\n".join(lines)


def run_tokens_per_rank(cfg: RunConfig, visible: int) -> int:
    """Tokens one device holds per (micro-)step in the run's own layout. ``parallel.devices=0``
    trained on every visible device, a count the run does not record: ``visible`` (this
    machine's, as a training start here would take) stands in, not 1, which made the whole
    batch one rank's."""
    d = cfg.data
    tokens = cfg.micro_seqs() * d.seq_len
    return max(tokens // (cfg.parallel.devices or max(visible, 1)), d.seq_len)
