"""Rung planning: derive K smaller runs (the ladder) from a target run by one documented rule.

The rule (after the reference ladder, docs/reference.md#the-scaling-ladder):

* only width, depth and heads change: the head dimension, the number of experts, top-k, the
  router and every other recipe field stay as in the target;
* expert, latent and shared widths keep their ratio to ``d_model`` (the reference: d/2);
* heads = d_model / head_dim; KV heads keep the target's ratio to heads where they can, else
  the largest divisor of the heads not above heads x ratio, at least one (the reference's d768
  rung: 6 heads, 1 KV head, where 6 x 12 / 48 gives 1.5); the global layers' KV heads likewise;
* depth follows width: n_layers = round(L_target * (d / d_target) ** depth_exp), at least
  ``min_layers`` (depth_exp 0.75 by default; ``depths`` sets them by hand);
* tokens per active parameter stay the target's, so a rung trains for
  tokens = (target tokens / target active parameters) x (rung active parameters); with
  ``token_multipliers`` (e.g. 0.5, 1) every width is trained once per multiplier of those
  tokens, so N and D move apart and both exponents of L(N, D) can be identified (with one
  multiplier they move together and the fit cannot tell the N term from the D term);
  ``max_run_share`` drops the (width, multiplier) runs that would cost more than that share of
  the target's FLOPs, so one grid trains the narrow widths long and the wide ones short: N and D
  both spread at a fraction of the cost of the full grid;
  "active parameters" are counted as the reference counts them: attention, router, top-k
  routed experts, latent projections and shared experts, without the embedding and the LM head
  (``moelab.planner.counts.param_counts(...)["active"]``). This N is also the N of the scaling
  laws; tokens trained are ``moelab.planner.counts.run_tokens``, the count `moelab plan` and the
  train loop use;
* ``seeds`` > 1 trains every rung that many times, replicate r with train.seed + 1000 r
  (named ``<rung>-s<r>``): small runs differ by seed by as much as a prediction's tolerance,
  and the fits take every replicate as its own curve;
* the peak learning rate scales with width: lr = lr_target * (d_target / d) ** lr_exp
  (``lr_exp`` 0 by default: the target's LR for every rung; 1 is the rule of Marin's scaling
  recipe, lr proportional to 1 / d_model, which keeps Adam's update size per unit of
  activation roughly constant across widths; with one LR for all, the narrow rungs train below
  their best LR, look worse than their size is, and the law overstates what size buys);
* widths: given by hand, or searched (every multiple of head_dim) so that rung k's training
  FLOPs are closest to top_share x C_target / spacing ** (K - 1 - k): rungs geometrically
  spaced in compute, the largest ``top_share`` of the target's.

Sequence length, batch size, LR schedule shape (warmup fraction, floor) and optimizer stay the
target's (the plan notes rungs that warm up over fewer steps than Adam's second-moment horizon,
1 / (1 - b2): their losses carry more seed noise); ``batch_size`` can override the batch for the rungs. The target's run operations
(context stages, mixture changes, re-timed decays) are not copied: rungs train on its base data
config and schedule.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass, field

from moelab.config import ConfigError, ModelConfig, RunConfig
from moelab.parallel.transport import check_config
from moelab.planner.counts import param_counts, run_tokens, train_flops_per_token

MIN_RUNS = 3  # finished rung runs a ladder fit needs (a plan with fewer could never be fit)


@dataclass(frozen=True)
class LadderRule:
    rungs: int = 4
    top_share: float = 1 / 400  # largest rung's FLOPs / target FLOPs (reference: ~0.3%)
    spacing: float = 4.0  # FLOPs ratio between neighbouring rungs
    depth_exp: float = 0.75
    min_layers: int = 2
    widths: tuple[int, ...] = ()  # explicit d_model per rung (skips the search)
    depths: tuple[int, ...] = ()  # explicit n_layers per rung
    token_multipliers: tuple[float, ...] = (1.0,)  # tokens per parameter, x the target's
    max_run_share: float = 1.0  # runs costing more than this share of the target are left out
    batch_size: int = 0  # 0 = the target's batch size
    evals: int = 8  # held-out evaluations per rung (for the trajectory fit)
    min_steps: int = 20
    seeds: int = 1  # replicates of every rung, train.seed + SEED_STRIDE * r (seed noise)
    lr_exp: float = 0.0  # rung lr = target lr * (d_target / d) ** lr_exp (1: lr ~ 1 / width)

    def validate(self) -> "LadderRule":
        def need(ok: bool, name: str, msg: str) -> None:
            if not ok:
                raise ConfigError(f"ladder.{name}: {msg}")

        need(self.rungs >= 2, "rungs", "must be >= 2 (a law needs at least two sizes)")
        need(0 < self.top_share < 1, "top_share", "must be a fraction of the target in (0, 1)")
        need(self.spacing > 1, "spacing", "must be > 1 (each rung larger than the one before)")
        need(self.depth_exp >= 0, "depth_exp", "must be >= 0")
        need(self.min_layers >= 1, "min_layers", "must be >= 1")
        for name in ("widths", "depths"):
            vals = getattr(self, name)
            need(not vals or len(vals) == self.rungs, name,
                 f"give one value per rung ({self.rungs}), got {len(vals)}")
            need(all(v > 0 for v in vals), name, f"{min(vals, default=1)}: give positive integers")
        need(self.batch_size >= 0, "batch_size", "must be >= 0 (0 = the target's)")
        tm = self.token_multipliers
        for m in tm or (0,):  # each value named
            need(math.isfinite(m) and m > 0, "token_multipliers", f"{m:g}: each multiplies "
                 "the target's tokens per parameter; give finite numbers > 0, e.g. "
                 "--token-multipliers 0.5,1")
        need(len(set(tm)) == len(tm), "token_multipliers", "give each multiplier once")
        need(0 < self.max_run_share <= 1, "max_run_share",
             f"must be a share of the target's FLOPs in (0, 1], got {self.max_run_share:g}")
        need(self.evals >= 2, "evals", "must be >= 2")
        need(self.seeds >= 1, "seeds", "must be >= 1 (replicates of every rung)")
        runs = self.rungs * len(tm) * self.seeds
        need(runs >= MIN_RUNS, "rungs", f"{self.rungs} sizes x {len(tm)} token multiplier(s) x "
             f"{self.seeds} seed(s) = {runs} runs, and a fit needs at least {MIN_RUNS}: add a "
             "rung, a token multiplier (--token-multipliers) or a seed")
        need(math.isfinite(self.lr_exp) and 0 <= self.lr_exp <= 2, "lr_exp",
             "must be in [0, 2] (0: the target's LR for every rung; 1: LR ~ 1 / width)")
        return self


@dataclass(frozen=True)
class Rung:
    name: str
    cfg: RunConfig
    stats: dict = field(default_factory=dict)


# Counting traces the model (jax.eval_shape, ~0.1 s a call); the width search asks for the same
# shapes repeatedly, so the counts are cached per (frozen, hashable) model config.
@functools.lru_cache(maxsize=256)
def _counts(model: ModelConfig) -> dict:
    return param_counts(model)


@functools.lru_cache(maxsize=256)
def _flops_per_token(model: ModelConfig, seq_len: int) -> float:
    return train_flops_per_token(model, seq_len)


def active_params(model: ModelConfig) -> int:
    """N of the ladder: active parameters as published (embedding and LM head excluded)."""
    return _counts(model)["active"]


def run_stats(cfg: RunConfig) -> dict:
    """Total/active parameters, tokens and training FLOPs of a run, all from the planner."""
    c = _counts(cfg.model)
    tokens = run_tokens(cfg)
    fpt = _flops_per_token(cfg.model, cfg.data.seq_len)
    return {"params_total": c["total"], "params_active": c["active"], "tokens": tokens,
            "flops_per_token": fpt, "flops": fpt * tokens, "steps": cfg.train.steps,
            "d_model": cfg.model.d_model, "n_layers": cfg.model.n_layers,
            "n_heads": cfg.model.n_heads}


# what runs must share for their held-out losses (nats per token of one tokenizer, on one data
# set) to be comparable
COMPARABLE = (("model", "vocab_size"), ("data", "data_dir"), ("data", "source"),
              ("data", "tokenizer"))


# of those, where the data are rather than what they are: a run whose recorded data (its
# provenance.json's fingerprints) are a prediction's may read them from another place
DATA_PLACES = ("data.data_dir", "data.source", "data.tokenizer")


def comparable_fields(cfg: RunConfig) -> dict:
    """{"section.field": value} of COMPARABLE, data paths absolute (compared as files)."""
    cfg = cfg.with_absolute_data()
    return {f"{sec}.{field}": getattr(getattr(cfg, sec), field) for sec, field in COMPARABLE}


def recorded_data(run_dir) -> dict | None:
    """The data a run trained on as its provenance.json fingerprints them (corpus, tokenizer);
    None without both (not started yet, an older run, a damaged file)."""
    from moelab.run.identity import DATA_FIELDS, read_provenance

    try:
        rec = read_provenance(run_dir)
    except ValueError:  # ConfigError included: damaged, named where the run itself reads it
        return None
    return {f: rec[f] for f in DATA_FIELDS} if all(rec.get(f) for f in DATA_FIELDS) else None


def _scaled_width(value: int, d: int, d_target: int) -> int:
    """A width that keeps its ratio to d_model, as a multiple of 8 (at least 8)."""
    return max(8, 8 * round(value * d / d_target / 8))


def _divisor_at_most(n: int, k: int) -> int:
    """The largest divisor of n not above k, at least 1."""
    k = max(1, k)
    while n % k:
        k -= 1
    return k


def check_width(target: ModelConfig, d: int) -> None:
    """ConfigError unless ``d`` is a rung width: a multiple of head_dim (heads = d / head_dim)."""
    if d % (hd := target.head_dim):
        raise ConfigError(f"ladder.widths: {d} is not a multiple of head_dim={hd} (heads = "
                          f"d_model / head_dim); the nearest is {max(hd, round(d / hd) * hd)}")


def scale_model(target: ModelConfig, d: int, n_layers: int) -> ModelConfig:
    """The target's model at width ``d`` and depth ``n_layers`` (rule in the module docstring)."""
    check_width(target, d)
    heads = d // target.head_dim
    kv = _divisor_at_most(heads, heads * target.n_kv_heads // target.n_heads)
    gkv = 0
    if target.global_kv_heads:
        gkv = _divisor_at_most(kv, kv * target.global_kv_heads // target.n_kv_heads)
    latent = target.latent_dim
    if target.use_latent:
        latent = _scaled_width(target.latent_dim, d, target.d_model)
    return dataclasses.replace(
        target, d_model=d, n_layers=n_layers, n_heads=heads, n_kv_heads=kv,
        global_kv_heads=gkv,
        expert_dim=_scaled_width(target.expert_dim, d, target.d_model),
        shared_dim=_scaled_width(target.shared_dim, d, target.d_model),
        latent_dim=latent if latent < d else 0)


def _depth(target: ModelConfig, d: int, rule: LadderRule) -> int:
    return max(rule.min_layers, round(target.n_layers * (d / target.d_model) ** rule.depth_exp))


def rung_config(target: RunConfig, d: int, n_layers: int, rule: LadderRule,
                token_mult: float = 1.0) -> RunConfig:
    """A full run config for one rung: scaled model, tokens per active parameter kept (times
    ``token_mult``)."""
    model = scale_model(target.model, d, n_layers)
    per_active = token_mult * run_tokens(target) / active_params(target.model)
    batch = rule.batch_size or target.data.batch_size
    data = dataclasses.replace(target.data, batch_size=batch, context_stages=[],
                               mixture_schedule=[])
    tokens = per_active * active_params(model)
    steps = max(rule.min_steps, round(tokens / (batch * data.seq_len)))
    warm_frac = target.warmup_steps / target.schedule_steps
    lr = target.optim.lr  # scaled LRs to 6 significant digits, so configs read cleanly
    if rule.lr_exp:
        lr = float(f"{lr * (target.model.d_model / d) ** rule.lr_exp:.6g}")
    optim = dataclasses.replace(target.optim, lr=lr, schedule_steps=steps, decays=[],
                                warmup_steps=max(1, round(warm_frac * steps)))
    train = dataclasses.replace(
        target.train, steps=steps, eval_every=max(1, steps // rule.evals),
        log_every=max(1, min(target.train.log_every, steps // 100)),
        ckpt_every=max(1, steps // 4))
    return dataclasses.replace(target, model=model, data=data, optim=optim,
                               train=train).validate()


def _pick_widths(target: RunConfig, rule: LadderRule) -> list[int]:
    """Widths (multiples of head_dim) whose rung FLOPs sit closest (in log) to the geometric
    compute targets, two rungs possibly on one width. FLOPs grow with width (up to depth
    rounding), so each target is bracketed by bisection and the nearer neighbour wins: a few
    dozen counts, not one per width."""
    c_target = run_stats(target)["flops"]
    m = target.model
    heads = list(range(1, m.d_model // m.head_dim + 1))

    @functools.lru_cache(maxsize=None)
    def flops(i: int) -> float:
        d = heads[i] * m.head_dim
        return run_stats(rung_config(target, d, _depth(m, d, rule), rule))["flops"]

    widths = []
    for k in range(rule.rungs):
        want = rule.top_share * c_target / rule.spacing ** (rule.rungs - 1 - k)
        lo, hi = 0, len(heads) - 1
        while lo < hi:  # first candidate whose FLOPs reach ``want``
            mid = (lo + hi) // 2
            lo, hi = (mid + 1, hi) if flops(mid) < want else (lo, mid)
        best = min({max(0, lo - 1), lo}, key=lambda i: abs(math.log(flops(i) / want)))
        widths.append(heads[best] * m.head_dim)
    return widths


def _search_widths(target: RunConfig, rule: LadderRule) -> list[int]:
    """``_pick_widths``, refused with the options that would plan distinct rungs when two land
    on one width (a target too small for the rule, or rungs closer than the width steps)."""
    widths = _pick_widths(target, rule)
    if len(set(widths)) == len(widths):
        return widths
    fixes = []
    for name, field_, factors in (("--top-share", "top_share", (2, 4, 8, 16, 32, 64, 128)),
                                  ("--spacing", "spacing", (1.5, 2, 3, 4))):
        for f in factors:
            value = float(f"{getattr(rule, field_) * f:.2g}")
            if field_ == "top_share" and value >= 1:
                break
            alt = dataclasses.replace(rule, **{field_: value})
            if len(set(found := _pick_widths(target, alt))) == len(found):
                fixes.append(f"{name} {value:g} (widths {', '.join(map(str, found))})")
                break
    raise ConfigError(
        f"ladder: {rule.rungs} rungs {rule.spacing:g}x apart in FLOPs, the largest at "
        f"{rule.top_share:g} of the target's, land on the same width (widths found: "
        f"{', '.join(map(str, widths))}; widths come in steps of head_dim={target.model.head_dim}"
        "): give " + " or ".join(fixes + ["--widths"] + (["fewer --rungs"] if rule.rungs > 2
                                                          else [])))


# replicate r of a rung trains with train.seed + SEED_STRIDE * r: far from the seeds of a
# second ladder planned from the same target with train.seed + 1, so two ladders share no runs
SEED_STRIDE = 1000


def replicate_name(base: str, r: int) -> str:
    return base if r == 0 else f"{base}-s{r}"


def _check_transport(target: RunConfig, rule: LadderRule) -> None:
    """The transport checks of the target and of its rungs (their batch, no context stages,
    the same parallel config), before a plan: not when a rung or the target starts training."""
    check_config(target)
    if rule.batch_size:
        data = dataclasses.replace(target.data, batch_size=rule.batch_size, context_stages=[],
                                   mixture_schedule=[])
        try:
            check_config(dataclasses.replace(target, data=data).validate())
        except ConfigError as e:
            raise ConfigError(f"ladder rungs at --batch-size {rule.batch_size}: {e}") from None


def above(x: float, cap: float) -> str:
    """``x`` (> ``cap``) with the fewest significant digits, two at least, that still read as
    above ``cap``: 0.304 against a cap of 0.3 is 0.304, not 0.3."""
    return next((t for n in range(2, 17) if float(t := f"{x:.{n}g}") > cap), repr(x))


def plan_ladder(target: RunConfig, rule: LadderRule = LadderRule(),
                left_out: list[str] | None = None) -> list[Rung]:
    """The rungs, smallest first, each with its stats and its FLOPs share of the target;
    ``left_out`` gets the runs over ``rule.max_run_share`` (named in the plan, not dropped
    unsaid: a width given by hand may cost more than the target)."""
    for d in (d for d in rule.widths if d > 0):  # before the count of runs they make
        check_width(target.model, d)
    rule.validate()
    _check_transport(target, rule)
    widths = list(rule.widths) or _search_widths(target, rule)
    depths = list(rule.depths) or [_depth(target.model, d, rule) for d in widths]
    t = run_stats(target)
    c_target = t["flops"]
    rungs, over = [], left_out if left_out is not None else []
    for (d, n_layers), m in itertools.product(zip(widths, depths), rule.token_multipliers):
        cfg = rung_config(target, d, n_layers, rule, m)
        stats = run_stats(cfg)
        stats["share"] = stats["flops"] / c_target
        stats["token_multiplier"] = m
        if stats["share"] > rule.max_run_share:
            over.append(f"d{d}" + ("" if m == 1 else f" x{m:g} tokens")
                        + f" {above(stats['share'], rule.max_run_share)}x")
            continue
        base = f"d{d}-L{n_layers}" + ("" if m == 1 else f"-t{m:g}")
        for r in range(rule.seeds):  # seed replicates: the fit averages their noise
            seed = target.train.seed + SEED_STRIDE * r
            rep = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, seed=seed))
            rungs.append(Rung(replicate_name(base, r), rep, {**stats, "replicate": r}))
    left = {r.stats["params_active"] for r in rungs}
    if (len(rungs) < MIN_RUNS or len(left) < 2) and over and rule.max_run_share >= 1:
        raise ConfigError(  # not a cap the user set: rungs that cost more than the target
            "ladder.widths: rungs costing more than the target itself are left out (each "
            f"its cost against the target's: {', '.join(over)}), which leaves {len(rungs)} "
            f"run(s) of {len(left)} width(s), and a fit needs at least {MIN_RUNS} runs of 2 "
            "widths: give widths "
            f"(and depths) below the target's (d_model={target.model.d_model}, "
            f"n_layers={target.model.n_layers})")
    if len(rungs) < MIN_RUNS or len(left) < 2:
        raise ConfigError(
            f"ladder.max_run_share: {rule.max_run_share:g} of the target's FLOPs leaves "
            f"{len(rungs)} run(s) of {len(left)} width(s), and a fit needs at least {MIN_RUNS} "
            "runs of 2 widths" + (f" (left out, each its cost against the target's: "
                                  f"{', '.join(over)})" if over else "")
            + ": give smaller widths, add token multipliers, or raise it")
    if len({r.name for r in rungs}) < len(rungs):
        raise ConfigError("ladder.widths: two rungs have the same shape; give distinct widths")
    per_active = t["tokens"] / t["params_active"]
    for r in rungs:  # raised to min_steps: more tokens per parameter than its multiplier asks
        r.stats["raised"] = r.cfg.train.steps == rule.min_steps and r.stats["tokens"] > 1.01 * (
            r.stats["token_multiplier"] * per_active * r.stats["params_active"])
    seen: dict[str, str] = {}
    for r in rungs:
        if (other := seen.setdefault(r.cfg.hash(), r.name)) != r.name:
            raise ConfigError(
                f"ladder.token_multipliers: rungs {other} and {r.name} are the same run (both "
                f"train {r.cfg.train.steps} steps"
                + (f", the minimum of {rule.min_steps}" if r.stats["raised"] else "")
                + "): give fewer or farther apart multipliers, a smaller --batch-size, or a "
                "target that trains longer")
    return sorted(rungs, key=lambda r: (r.stats["flops"], r.stats["replicate"]))
