"""``moelab eval``: score a trained run on lm-evaluation-harness tasks.

``lm.MoelabLM`` is the harness's model (batched log-likelihoods, rolling perplexity, greedy
generation); ``registry`` finds tasks (moelab's local ones in ``tasks/``, --include-path folders,
the harness's built-ins); ``evaluate`` runs them and writes the results JSON. The local tasks
need no network; Hugging Face offline mode is left to the environment (HF_DATASETS_OFFLINE).
"""
