"""Hugging Face config of a moelab MoE language model (copied into each export).

The fields are moelab's ``ModelConfig`` fields that inference reads. Where transformers has a
standard name for one (``hidden_size``, ``num_hidden_layers``, ``num_experts_per_tok``, ...), the
config stores it under that name, so ``config.json`` itself carries the standard names;
``attribute_map`` keeps the moelab names readable (``config.d_model``). ``layer_types`` says
per layer what transformers' caches and masks need: sliding or full attention, ``hybrid``
when the layer also keeps short-convolution state between decoding steps.
"""

from transformers import PretrainedConfig

# moelab name -> standard transformers name (moelab.export.hf writes config.json with these)
STANDARD_NAMES = {
    "d_model": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "n_experts": "num_experts",
    "top_k": "num_experts_per_tok", "expert_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps", "rope_fraction": "partial_rotary_factor",
    "aux_loss_coef": "router_aux_loss_coef",
}
# field -> default (the defaults of moelab.config.ModelConfig, under the names above);
# sliding_window None = none (moelab's 0)
MOELAB_FIELDS = {
    "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "rope_theta": 10_000.0, "partial_rotary_factor": 1.0,
    "sliding_window": None, "global_every": 0, "global_kv_heads": 0, "global_rope": True,
    "qk_norm": False, "qk_norm_scale": 1.0, "xsa": False, "attn_gate": False,
    "conv_sites": "", "conv_kernel": 4, "gated_norm_rank": 0, "embed_norm": False,
    "num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 256, "latent_dim": 0,
    "n_shared": 1, "shared_dim": 256,
    "router": "softmax_aux", "combine_sum": 0.0, "router_aux_loss_coef": 0.01,
    "init_std": 0.0, "rms_norm_eps": 1e-5,
}
CONV_SITES = ("q", "k", "v", "attn", "moe")  # the order of a layer's conv states in the cache


class MoelabConfig(PretrainedConfig):
    model_type = "moelab"
    # moelab's names read too, but top_k: generate would take it for a sampling setting
    attribute_map = {k: v for k, v in STANDARD_NAMES.items() if k != "top_k"} | {
        "num_local_experts": "num_experts", "moe_intermediate_size": "intermediate_size"}

    def __init__(self, max_position_embeddings: int = 2048, output_router_logits: bool = False,
                 **kwargs):
        for moelab, standard in STANDARD_NAMES.items():  # moelab's names given: the same fields
            if moelab in kwargs:
                kwargs[standard] = kwargs.pop(moelab)
        for name, default in MOELAB_FIELDS.items():
            setattr(self, name, kwargs.pop(name, default))
        self.sliding_window = self.sliding_window or None
        self.max_position_embeddings = max_position_embeddings  # the trained context
        self.output_router_logits = output_router_logits
        self.hidden_act = kwargs.pop("hidden_act", "silu")
        self.use_cache = kwargs.pop("use_cache", True)
        self.layer_types = [self._layer_type(i) for i in range(self.num_hidden_layers)]
        kwargs.pop("layer_types", None)  # derived from the fields above, never read
        kwargs.setdefault("tie_word_embeddings", False)
        super().__init__(**kwargs)

    @property
    def conv_site_list(self) -> list[str]:
        """The configured short-conv sites, in cache-state order."""
        given = {s.strip() for s in self.conv_sites.split(",") if s.strip()}
        return [s for s in CONV_SITES if s in given]

    @property
    def number_of_conv_states(self) -> int:
        """Conv states per layer that decoding carries (transformers' hybrid cache layers); a
        one-tap convolution needs none."""
        return len(self.conv_site_list) if self.conv_kernel > 1 else 0

    def layer_kind(self, i: int) -> tuple[int, bool]:
        """(attention window, 0 = full causal; is it a global layer) of layer ``i``, as moelab's
        ModelConfig.layer_windows / layer_is_global: every ``global_every``-th layer is global."""
        is_global = self.global_every > 0 and (i + 1) % self.global_every == 0
        return (0 if is_global else self.sliding_window or 0), is_global

    def _layer_type(self, i: int) -> str:
        sliding = self.layer_kind(i)[0] > 0
        if self.number_of_conv_states:
            return "hybrid_sliding" if sliding else "hybrid"
        return "sliding_attention" if sliding else "full_attention"
