"""PyTorch moelab Mixture-of-Experts language models for transformers (copied into each
export with ``configuration_moelab.py`` and ``layers_moelab.py``).

``MoelabForCausalLM`` is a transformers causal LM: masks come from ``masking_utils``
(padding, sliding windows, what the cache holds), ``generate`` decodes with a ``DynamicCache``
and positions follow the attention mask (left padding), blocks are
``GradientCheckpointingLayer``s, outputs are ``MoeCausalLMOutputWithPast`` (hidden states,
attention probabilities with ``eager``, router logits, the balance loss of the softmax router).
Past the trained context (``max_position_embeddings``), ``generate`` slides a window as
``moelab generate`` does.
"""

import math

import torch
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_outputs import MoeCausalLMOutputWithPast, MoeModelOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from .configuration_moelab import MoelabConfig
from .layers_moelab import (
    MoelabBlock,
    MoelabExperts,
    MoelabMoE,
    MoelabRMSNorm,
    OutputGate,
    ShortConv,
    rope_tables,
)


class MoelabPreTrainedModel(PreTrainedModel):
    config_class = MoelabConfig
    base_model_prefix = "model"
    _no_split_modules = ["MoelabBlock"]
    supports_gradient_checkpointing = True
    _supports_sdpa = True
    _supports_attention_backend = True  # attention only through ALL_ATTENTION_FUNCTIONS
    # routing in float32, as moelab: bf16 router weights change some tokens' experts
    _keep_in_fp32_modules_strict = ["router"]

    def _init_weights(self, module):
        """moelab's init: truncated normal with std 0.5 / sqrt(d_model) (or init_std), norms
        at one, the output gate at zero, short convolutions at the identity."""
        std = self.config.init_std or 0.5 / math.sqrt(self.config.hidden_size)
        with torch.no_grad():
            if isinstance(module, MoelabRMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, ShortConv):
                module.weight.zero_()
                module.weight[-1] = 1.0
            elif isinstance(module, MoelabMoE):
                module.router_bias.zero_()
            elif isinstance(module, OutputGate):
                module.weight.zero_()
            elif isinstance(module, (nn.Linear, nn.Embedding, MoelabExperts)):
                for p in module.parameters(recurse=False):
                    nn.init.trunc_normal_(p, std=std, a=-2 * std, b=2 * std)


def _masks(model, x_BTD, attention_mask, cache, position_ids) -> dict:
    """Per attention window (None: full causal), the mask transformers builds for it: causal,
    padding, the window, what the cache holds."""
    args = (model.config, x_BTD, attention_mask, cache, position_ids)
    windows = {layer.self_attn.sliding_window for layer in model.layers}
    return {w: (create_sliding_window_causal_mask if w else create_causal_mask)(*args)
            for w in windows}


class MoelabModel(MoelabPreTrainedModel):
    def __init__(self, config: MoelabConfig):
        super().__init__(config)
        D, eps, rank = config.hidden_size, config.rms_norm_eps, config.gated_norm_rank
        self.embed_tokens = nn.Embedding(config.vocab_size, D)
        if config.embed_norm:
            self.embed_norm = MoelabRMSNorm(D, eps, rank)
        self.layers = nn.ModuleList(MoelabBlock(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = MoelabRMSNorm(D, eps, rank)
        self.gradient_checkpointing = False
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, use_cache=None, output_hidden_states=None,
                output_attentions=None, output_router_logits=None, **kwargs):
        """``inputs_embeds`` are embedding rows (``embed_tokens``' output, before ``embed_norm``).
        Positions default to each row's count of real tokens in the attention mask (left
        padding), else continue the cache."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("give exactly one of input_ids and inputs_embeds")
        c = self.config
        x = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cache = kwargs.pop("past_key_values", None) if cache is None else cache
        if not (c.use_cache if use_cache is None else use_cache):
            cache = None
        elif cache is None and not (self.gradient_checkpointing and self.training):
            cache = DynamicCache(config=c)
        T, past = x.shape[1], cache.get_seq_length() if cache is not None else 0
        pad = attention_mask if attention_mask is not None and attention_mask.dim() == 2 else None
        valid = None  # the new positions' padding mask, where there is padding
        if pad is not None and not bool(pad.all()):
            valid = pad[:, -T:].bool()
        if position_ids is None and pad is not None:
            position_ids = (pad.long().cumsum(-1) - 1).clamp(min=0)[:, -T:]
        elif position_ids is None:
            position_ids = torch.arange(past, past + T, device=x.device)[None]
        masks = _masks(self, x, attention_mask, cache, position_ids)
        rope_cs = rope_tables(position_ids, int(c.head_dim * c.partial_rotary_factor),
                              c.rope_theta)
        if c.embed_norm:
            x = self.embed_norm(x)
        hidden, probs, router_logits = [x], [], []
        for layer in self.layers:
            x, p, r = layer(x, rope_cs, attention_mask=masks[layer.self_attn.sliding_window],
                            valid=valid, cache=cache, output_attentions=output_attentions,
                            **kwargs)
            hidden.append(x)
            probs.append(p)
            router_logits.append(r)
        hidden[-1] = x = self.norm(x)  # as transformers' models: the last one after the norm

        def kept(values, flag, name):  # as asked: by the argument, else by the config
            return tuple(values) if (getattr(c, name, False) if flag is None else flag) else None
        return MoeModelOutputWithPast(
            last_hidden_state=x, cache=cache,
            hidden_states=kept(hidden, output_hidden_states, "output_hidden_states"),
            attentions=kept(probs, output_attentions, "output_attentions"),
            router_logits=kept(router_logits, output_router_logits, "output_router_logits"))


def balance_loss(router_logits, config: MoelabConfig, attention_mask=None):
    """moelab's softmax-router balance loss over the real tokens, averaged over layers:
    E * sum_e (share of the assignments going to e) * (mean router probability of e)."""
    E, k = config.num_experts, config.num_experts_per_tok
    losses = []
    for logits in router_logits:
        w = (torch.ones(len(logits)) if attention_mask is None
             else attention_mask.reshape(-1).float()).to(logits.device)
        probs = logits.softmax(-1)
        load = torch.zeros(E, device=logits.device).index_add_(
            0, probs.topk(k).indices.reshape(-1), w.repeat_interleave(k))
        n = w.sum().clamp(min=1.0)
        losses.append(E * (load / (n * k) * (probs * w[:, None]).sum(0) / n).sum())
    return torch.stack(losses).mean()


class MoelabForCausalLM(MoelabPreTrainedModel, GenerationMixin):
    def __init__(self, config: MoelabConfig):
        super().__init__(config)
        self.model = MoelabModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, **kwargs):
        """As transformers', but past the trained context ``generate`` keeps the last
        ``max_position_embeddings`` tokens, at positions 0, 1, ..., as ``moelab generate`` does:
        each further token is one forward over that window, into a fresh cache (every cached
        position would change). A prompt given as ``inputs_embeds`` is not windowed."""
        inputs = super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds,
                                                       **kwargs)
        n = self.config.max_position_embeddings
        if input_ids.shape[1] <= n or inputs_embeds is not None:
            return inputs
        mask = inputs.get("attention_mask")
        inputs.update(input_ids=input_ids[:, -n:], position_ids=None,
                      attention_mask=None if mask is None else mask[:, -n:])
        if inputs.get("cache") is not None:
            inputs["cache"] = DynamicCache(config=self.config)
        return inputs

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None,
                logits_to_keep=0, **kwargs):
        """Logits [B, T, V]; with ``labels`` the next-token loss (plus, for the softmax router,
        ``router_aux_loss_coef`` times the balance loss when router logits are asked for, as
        moelab trains it). ``aux_loss`` is None for the bias-balanced routers."""
        c = self.config
        want_router = c.output_router_logits if output_router_logits is None \
            else output_router_logits
        out = self.model(input_ids, attention_mask, position_ids, cache, inputs_embeds,
                         use_cache, output_router_logits=want_router, **kwargs)
        logits = self.lm_head(slice_logits_to_keep(out.last_hidden_state, logits_to_keep))
        loss = aux = None
        if labels is not None:
            loss = self.loss_function(logits, labels, c.vocab_size,
                                      num_items_in_batch=kwargs.get("num_items_in_batch"))
        if want_router and c.router == "softmax_aux":
            T = out.last_hidden_state.shape[1]
            aux = balance_loss(out.router_logits, c,
                               None if attention_mask is None else attention_mask[:, -T:])
            if loss is not None:
                loss = loss + c.router_aux_loss_coef * aux
        return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux, logits=logits, cache=out.cache,
                                         hidden_states=out.hidden_states,
                                         attentions=out.attentions,
                                         router_logits=out.router_logits)
