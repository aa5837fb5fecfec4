"""A trained run as an lm-evaluation-harness model (``lm_eval.api.model.LM``).

Log-likelihoods run batched through ``moelab.harness.batching``; generation goes through
``moelab.generate``'s sampler, greedy unless a task asks for sampling.
"""

from __future__ import annotations

from typing import Sequence

from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from moelab.config.errors import require
from moelab.data.tokenizer import decode, encode_batch, eos_id
from moelab.generate import make_sampler
from moelab.harness.batching import Window, make_scorer, make_window, score_windows
from moelab.run.load import LoadedRun

GEN_CHUNK = 32  # tokens sampled between checks for a stop string


class MoelabLM(LM):
    def __init__(self, run: LoadedRun, batch_size: int = 8, max_gen_toks: int = 256):
        super().__init__()
        require(batch_size >= 1, f"--batch-size {batch_size}", "must be >= 1")
        self.run = run
        self.seq_len = run.context  # the trained context: data.seq_len or a stage's
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.eot = eos_id(run.tokenizer)
        self._score = make_scorer(run.cfg.model)
        self._sample = make_sampler(run.cfg.model, self.seq_len)

    # ------------------------------------------------------------------ tokens

    def tok_encode(self, texts: Sequence[str]) -> list[list[int]]:
        return encode_batch(self.run.tokenizer, texts)

    def tok_decode(self, ids: Sequence[int]) -> str:
        return decode(self.run.tokenizer, ids)

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context ids, continuation ids) as the HF model splits them: the context's trailing
        spaces join the continuation, which is read off the whole text's encoding (BPE merges
        across the boundary); an empty context is the end-of-text token."""
        if not context:
            return [self.eot], self.tok_encode([continuation])[0]
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole, ctx = self.tok_encode([context + continuation, context])
        return ctx or [self.eot], whole[len(ctx):]  # a context of spaces only: as if empty

    # ------------------------------------------------------------------ scoring

    def loglikelihood_tokens(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]
                             ) -> list[tuple[float, bool]]:
        """(log-probability, is greedy) of each continuation after its context (token ids)."""
        windows = [make_window(c, x, self.seq_len) for c, x in pairs]
        return self._score_windows(windows)

    def _score_windows(self, windows: Sequence[Window]) -> list[tuple[float, bool]]:
        return score_windows(self._score, self.run.params, self.run.model_state, windows,
                             self.batch_size, self.seq_len)

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self.loglikelihood_tokens([self._encode_pair(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        """Each text's total log-probability over disjoint windows of at most seq_len tokens,
        every token predicted once (the first after the end-of-text token)."""
        texts = [r.args[0] for r in requests]
        windows, owner = [], []
        for i, ids in enumerate(self.tok_encode(texts)):
            for ctx, pred in map(make_disjoint_window, get_rolling_token_windows(
                    ids, prefix_token=self.eot, max_seq_len=self.seq_len, context_len=1)):
                windows.append(make_window(ctx, pred, self.seq_len))
                owner.append(i)
        totals = [0.0] * len(texts)
        for i, (logp, _) in zip(owner, self._score_windows(windows)):
            totals[i] += logp
        return totals

    # ------------------------------------------------------------------ generation

    def generate_until(self, requests) -> list[str]:
        return [self.generate(context, **gen_options(kwargs, self.max_gen_toks, self.eot_text))
                for context, kwargs in (r.args for r in requests)]

    @property
    def eot_text(self) -> str:
        return self.tok_decode([self.eot])

    def generate(self, context: str, until: list[str], max_gen_toks: int, temperature: float,
                 top_p: float, top_k: int = 0, seed: int = 0) -> str:
        """The continuation of ``context``, cut before the first of ``until``. Sampled in
        chunks so a stop string ends generation early (the same tokens for greedy decoding)."""
        ids = self.tok_encode([context])[0] if context else [self.eot]
        out: list[int] = []
        while len(out) < max_gen_toks:
            n = min(GEN_CHUNK, max_gen_toks - len(out))
            new = self._sample(self.run.params, self.run.model_state, (ids + out)[-self.seq_len:],
                               n, temperature=temperature, top_p=top_p, seed=seed + len(out),
                               top_k=min(top_k, self.run.cfg.model.vocab_size) if top_k > 0
                               else None,
                               stop_id=self.eot)
            out += new
            if len(new) < n or cut_at_stop(self.tok_decode(out), until) is not None:
                break  # end of text, or a stop string
        text = self.tok_decode(out)
        cut = cut_at_stop(text, until)
        return text if cut is None else text[:cut]

    def get_model_info(self) -> dict:
        return {"moelab_step": self.run.step, "seq_len": self.seq_len}


def cut_at_stop(text: str, until: Sequence[str]) -> int | None:
    """Index of the earliest stop string in ``text`` (None: none occurs)."""
    hits = [i for i in (text.find(s) for s in until if s) if i >= 0]
    return min(hits) if hits else None


def gen_options(kwargs: dict, default_max: int, eot_text: str) -> dict:
    """A task's generation_kwargs as ``MoelabLM.generate`` arguments: greedy unless
    ``do_sample`` is true (then ``temperature``, default 1, ``top_p`` and ``top_k``: 0 keeps
    every token, as in transformers; so does a task that gives none, where transformers would
    take its generation default, 50)."""
    kwargs = dict(kwargs or {})
    until = kwargs.get("until", [])
    until = [until] if isinstance(until, str) else list(until)
    if not all(isinstance(s, str) for s in until):
        raise ValueError(f"generation_kwargs until={until!r}: must be a string or a list of "
                         "strings")
    max_gen = int(kwargs.get("max_gen_toks", default_max))
    if max_gen < 1:
        raise ValueError(f"generation_kwargs max_gen_toks={max_gen}: must be >= 1")
    sample = bool(kwargs.get("do_sample", False))
    temperature = float(kwargs.get("temperature", 1.0)) if sample else 0.0
    return {"until": until + [eot_text], "max_gen_toks": max_gen, "temperature": temperature,
            "top_p": float(kwargs.get("top_p", 1.0)) if sample else 1.0,
            "top_k": int(kwargs.get("top_k") or 0) if sample else 0,
            "seed": int(kwargs.get("seed", 0))}
