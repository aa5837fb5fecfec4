"""Hugging Face config of a moelab MoE language model (copied into each export).

The fields are moelab's ``ModelConfig`` fields that inference reads, under their moelab names
but one: ``top_k`` (experts per token) is ``num_experts_per_tok``, since transformers reads a
config's ``top_k`` as a sampling setting. ``attribute_map`` gives transformers its standard names
(hidden_size, num_hidden_layers, ...).
"""

from transformers import PretrainedConfig

# field -> default (the defaults of moelab.config.ModelConfig)
MOELAB_FIELDS = {
    "vocab_size": 4096, "d_model": 256, "n_layers": 4,
    "n_heads": 4, "n_kv_heads": 2, "head_dim": 64,
    "rope_theta": 10_000.0, "rope_fraction": 1.0,
    "sliding_window": 0, "global_every": 0, "global_kv_heads": 0, "global_rope": True,
    "qk_norm": False, "qk_norm_scale": 1.0, "xsa": False, "attn_gate": False,
    "conv_sites": "", "conv_kernel": 4, "gated_norm_rank": 0, "embed_norm": False,
    "n_experts": 8, "num_experts_per_tok": 2, "expert_dim": 256, "latent_dim": 0,
    "n_shared": 1, "shared_dim": 256,
    "router": "softmax_aux", "combine_sum": 0.0,
    "init_std": 0.0, "norm_eps": 1e-5,
}


class MoelabConfig(PretrainedConfig):
    model_type = "moelab"
    attribute_map = {"hidden_size": "d_model", "num_hidden_layers": "n_layers",
                     "num_attention_heads": "n_heads", "num_key_value_heads": "n_kv_heads"}

    def __init__(self, max_position_embeddings: int = 2048, **kwargs):
        for name, default in MOELAB_FIELDS.items():
            setattr(self, name, kwargs.pop(name, default))
        self.max_position_embeddings = max_position_embeddings
        # no KV cache (modeling_moelab.py): generation recomputes the prefix every step
        kwargs.setdefault("use_cache", False)
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    @property
    def conv_site_set(self) -> frozenset:
        return frozenset(s.strip() for s in self.conv_sites.split(",") if s.strip())

    def layer_kind(self, i: int) -> tuple[int, bool]:
        """(attention window, 0 = full causal; is it a global layer) of layer ``i``, as moelab's
        ModelConfig.layer_windows / layer_is_global: every ``global_every``-th layer is global."""
        is_global = self.global_every > 0 and (i + 1) % self.global_every == 0
        return (0 if is_global or self.sliding_window == 0 else self.sliding_window), is_global
