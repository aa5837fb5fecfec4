"""The model: a decoder of attention + MoE blocks (``transformer``), its building blocks
(``layers``), the router (``router``), the MoE branch (``moe``), the routed-expert compute and
its kernels (``experts``, ``dispatch``, ``grouped_matmul``, ``grouped_gemm``, ``expert_legs``),
the LM head and its loss (``loss``), cached decoding (``decode``) and the mesh axis names
(``axes``). Functions of a parameter dict and a ``ModelConfig``; the kernels are picked for
the backend JAX runs on (``experts.resolve_impl``, ``layers.resolve_attention``)."""
