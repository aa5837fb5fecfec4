"""``moelab eval``: score a trained run on lm-evaluation-harness tasks, offline.

``lm.MoelabLM`` is the harness's model (batched log-likelihoods, rolling perplexity, greedy
generation); ``registry`` finds tasks (moelab's local ones in ``tasks/``, --include-path folders,
the harness's built-ins); ``evaluate`` runs them and writes the results JSON.
"""

import os

# Evaluation never touches the network: datasets and huggingface_hub read these when they are
# first imported, which happens below this package (lm_eval imports them), so set them first.
os.environ["HF_DATASETS_OFFLINE"] = "1"
os.environ["HF_HUB_OFFLINE"] = "1"
