"""The exported model as serving and fine-tuning use it: bfloat16 and float16 logits within a
stated tolerance of moelab's, sdpa equal to eager, left-padded batches equal to each row alone,
the KV cache equal to recomputing, `generate` past the trained context keeping the last
max_position_embeddings tokens as `moelab generate` does, gradient checkpointing, inputs_embeds,
hidden states and router logits; the README's loading snippet runs in a terminal without asking
anything."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from export_fixtures import TOL, exports, load, max_diff, module_fixture, moelab_logits

try:  # the hf extra, which ./install.sh installs: a missing one fails the tests, never skips
    import torch
    import transformers
    from transformers.cache_utils import DynamicCache
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
except ImportError as e:  # pragma: no cover
    raise ImportError(f"{e}: the export tests need the hf extra: pip install -e '.[hf]'") from e

exported = module_fixture(exports)
ROOT = Path(__file__).resolve().parents[1]
# largest |logit difference| from moelab's float32 logits (of order 0.3 here) allowed per dtype;
# measured (eager and sdpa): bfloat16 1.3e-2, float16 6.9e-3 (all_options); 8.2e-3, 1.5e-3
# (softmax_router)
DTYPE_TOL = {torch.bfloat16: 0.05, torch.float16: 0.02}


def _prompts(n=(3, 9, 6), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 300, (k,), generator=g) for k in n]


def _left_padded(prompts):
    """input_ids and attention_mask of ``prompts`` padded on the left with token 0."""
    T = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_low_precision_logits(exported, dtype, attn):
    """Loaded in bfloat16 / float16, the logits stay within DTYPE_TOL of moelab's float32 ones;
    the routers stay float32, as moelab keeps them."""
    for name in ("all_options", "softmax_router"):
        ex = exported(name)
        model = load(ex.out, dtype=dtype, attn_implementation=attn)
        assert model.lm_head.weight.dtype == dtype
        for layer in model.model.layers:
            assert layer.mlp.router.weight.dtype == layer.mlp.router_bias.dtype == torch.float32
        tokens = np.random.default_rng(0).integers(0, 300, (2, 20)).astype(np.int32)
        diff = max_diff(ex, model, tokens)
        print(f"{name} {dtype} {attn}: max |logit difference| = {diff:.2e}")
        assert diff < DTYPE_TOL[dtype]


def test_sdpa_equals_eager_and_padding_changes_nothing(exported):
    """Left-padded rows give, at their real positions, the logits of each row alone; sdpa
    gives eager's."""
    ex = exported("all_options")
    eager = load(ex.out, attn_implementation="eager")
    sdpa = load(ex.out, attn_implementation="sdpa")
    assert (eager.config._attn_implementation, sdpa.config._attn_implementation) == \
        ("eager", "sdpa")
    prompts = _prompts()
    ids, mask = _left_padded(prompts)
    with torch.no_grad():
        a = eager(ids, attention_mask=mask).logits
        b = sdpa(ids, attention_mask=mask).logits
        for i, p in enumerate(prompts):
            alone = eager(p[None]).logits[0]
            assert (a[i, -len(p):] - alone).abs().max() < TOL
    assert (a - b)[mask.bool()].abs().max() < TOL


def _new_tokens(out, start: int) -> list[int]:
    """A generated row's new tokens up to (not including) end-of-text (id 0)."""
    row = out[start:].tolist()
    return row[:row.index(0)] if 0 in row else row


def test_generate_batched_and_cached(exported):
    """Greedy `generate`: a left-padded batch gives each prompt's tokens alone; with the KV
    cache (the default) equals without, token for token."""
    model = load(exported("all_options").out)  # sliding windows and short convolutions
    prompts, kw = _prompts(), dict(max_new_tokens=8, do_sample=False)
    alone = [_new_tokens(model.generate(p[None], **kw)[0], len(p)) for p in prompts]
    uncached = [_new_tokens(model.generate(p[None], use_cache=False, **kw)[0], len(p))
                for p in prompts]
    assert alone == uncached and all(alone)
    ids, mask = _left_padded(prompts)
    for use_cache in (True, False):
        out = model.generate(ids, attention_mask=mask, use_cache=use_cache, **kw)
        assert [_new_tokens(row, ids.shape[1]) for row in out] == alone, use_cache


def test_kv_cache_continues_the_forward(exported):
    """A prefill, then one token at a time through a DynamicCache (past the sliding window,
    with the short convolutions' state), gives the logits of one full forward."""
    model = load(exported("all_options").out)
    ids = torch.randint(1, 300, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = model(ids, use_cache=False)
        assert full.cache is None
        out = model(ids[:, :7])
        cache = out.cache
        assert isinstance(cache, DynamicCache) and cache.get_seq_length() == 7
        steps = [out.logits] + [model(ids[:, t:t + 1], cache=cache).logits for t in range(7, 12)]
    assert cache.get_seq_length() == 12
    assert (torch.cat(steps, 1) - full.logits).abs().max() < TOL


def test_generate_past_the_trained_context_slides_like_moelab(exported):
    """Past max_position_embeddings, each new token's logits are moelab's forward over the last
    seq_len tokens (what `moelab generate` computes), not over the whole text."""
    ex = exported("tiny")
    S = ex.cfg.data.seq_len
    model = load(ex.out)
    prompt = torch.randint(1, 300, (1, S - 1), generator=torch.Generator().manual_seed(3))
    kw = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    gen = model.generate(prompt, output_logits=True, return_dict_in_generate=True, **kw)
    seq = gen.sequences[0].numpy().astype(np.int32)
    got = np.stack([step[0].numpy() for step in gen.logits])  # step j: after S - 1 + j tokens
    ends = range(S - 1, S + 3)
    windows = np.stack([seq[max(0, k - S):k].tolist() + [0] * max(0, S - k) for k in ends])
    ref = moelab_logits(ex, windows)[np.arange(len(ends)), [min(k, S) - 1 for k in ends]]
    assert np.abs(got - ref).max() < TOL
    whole = moelab_logits(ex, seq[None, :-1])[0, S - 2:]  # the text unwindowed
    assert np.abs(whole - ref)[2:].max(-1).min() > 0.1  # past S tokens the two differ
    assert torch.equal(model.generate(prompt, use_cache=False, **kw)[0], gen.sequences[0])


def test_fine_tuning_outputs(exported):
    """With labels and router logits (softmax router): the loss is moelab's cross-entropy plus
    router_aux_loss_coef times moelab's balance loss, in transformers' MoE output."""
    import jax
    import jax.numpy as jnp

    from moelab.model.transformer import forward

    ex = exported("softmax_router")
    model = load(ex.out)
    ids = torch.randint(1, 300, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        out = model(ids, labels=ids, output_router_logits=True)
        plain = model(ids, labels=ids)
    assert isinstance(out, MoeCausalLMOutputWithPast) and plain.aux_loss is None
    L, E = ex.cfg.model.n_layers, ex.cfg.model.n_experts
    assert len(out.router_logits) == L and out.router_logits[0].shape == (20, E)
    logits, routing = jax.jit(forward, static_argnums=3)(
        ex.state["params"], ex.state["model_state"], jnp.asarray(ids.numpy()), ex.cfg.model)
    logp = np.asarray(logits)[:, :-1] - np.log(np.exp(np.asarray(logits)[:, :-1]).sum(-1,
                                                                                 keepdims=True))
    ce = -np.take_along_axis(logp, ids.numpy()[:, 1:, None], -1).mean()
    aux = float(np.mean(routing.aux_loss))
    assert abs(float(plain.loss) - ce) < TOL and abs(float(out.aux_loss) - aux) < TOL
    coef = model.config.router_aux_loss_coef
    assert coef == ex.cfg.model.aux_loss_coef
    assert abs(float(out.loss) - (ce + coef * aux)) < TOL


def test_activation_checkpointing_embeds_and_hidden_states(exported):
    """Activation checkpointing recomputes each block and leaves the gradients as they were;
    inputs_embeds give input_ids' logits and generation; hidden states are the embeddings,
    each block's output and the final normed one; the quantile router's aux_loss is None."""
    model = load(exported("all_options").out)
    ids = torch.randint(1, 300, (2, 10), generator=torch.Generator().manual_seed(5))

    def grads(checkpointing: bool):
        model.train().zero_grad()
        (model.activation_checkpointing_enable if checkpointing
         else model.activation_checkpointing_disable)()
        calls = []
        hook = model.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
        model(ids, labels=ids).loss.backward()
        hook.remove()
        return [p.grad.clone() for p in model.parameters()], len(calls)

    (plain, n_plain), (ckpt, n_ckpt) = grads(False), grads(True)
    assert (n_plain, n_ckpt) == (1, 2)  # the backward ran the block again
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(plain, ckpt))
    model.activation_checkpointing_disable()
    model.eval()
    with torch.no_grad():
        out = model(ids, output_hidden_states=True, output_router_logits=True)
        embeds = model.get_input_embeddings()(ids)
        assert torch.equal(model(inputs_embeds=embeds).logits, out.logits)
        hidden = out.hidden_states
        assert len(hidden) == model.config.num_hidden_layers + 1
        assert torch.equal(hidden[0], model.model.embed_norm(embeds))  # embed_norm is on
        assert torch.equal(model.lm_head(hidden[-1]), out.logits)
        assert all((a - b).abs().max() > 1e-3 for a, b in zip(hidden, hidden[1:]))
    assert out.aux_loss is None and len(out.router_logits) == model.config.num_hidden_layers
    kw = dict(max_new_tokens=4, do_sample=False, eos_token_id=None)
    assert torch.equal(model.generate(inputs_embeds=embeds[:1], **kw)[0],
                       model.generate(ids[:1], **kw)[0, ids.shape[1]:])


def test_tokenizer_loads_without_custom_code(exported, monkeypatch):
    """PreTrainedTokenizerFast.from_pretrained(OUT) never reaches transformers' remote-code
    question (tokenizer_config.json names a library class, no auto_map)."""
    from transformers import dynamic_module_utils

    def asked(*args, **kwargs):
        raise AssertionError("the tokenizer needed the remote-code question")

    monkeypatch.setattr(dynamic_module_utils, "resolve_trust_remote_code", asked)
    tok = transformers.PreTrainedTokenizerFast.from_pretrained(exported("tiny").out)
    assert tok("The lazy fox").input_ids and tok.pad_token == tok.eos_token


def _run_in_terminal(code: str, timeout: float = 180) -> tuple[int, str]:
    """Run ``python -c code`` with stdin, stdout and stderr on a pseudo-terminal, as in a
    user's shell: a question transformers asks shows up in the output and waits for an
    answer. Returns (exit status, output)."""
    master, slave = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=slave, stdout=slave,
                            stderr=slave, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    os.close(slave)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([master], [], [], 1.0)
        try:
            chunk = os.read(master, 65536) if ready else b""
        except OSError:  # the child closed the terminal
            break
        out += chunk
        if not ready and proc.poll() is not None:
            break
    os.close(master)
    if proc.poll() is None:
        proc.kill()
    return proc.wait(), out.decode(errors="replace")


def test_readme_snippet_runs_in_a_terminal(exported):
    """The README's loading snippet (bfloat16, a left-padded batch, the KV cache), run against
    an export in a terminal (8 new tokens rather than 40), finishes without asking anything."""
    section = (ROOT / "README.md").read_text().split("## Hugging Face export", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    assert '"exports/tiny"' in code
    code = code.replace('"exports/tiny"', repr(str(exported("all_options").out)))
    code = code.replace("max_new_tokens=40", "max_new_tokens=8")  # the same paths, sooner
    status, out = _run_in_terminal(code + "\nprint('SNIPPET DONE')\n")
    assert "Do you wish to run the custom code" not in out
    assert status == 0 and "SNIPPET DONE" in out, out
