"""A run's checkpoint as a Hugging Face model folder (``moelab export RUN --to hf OUT``).

OUT holds ``model.safetensors`` (float32), ``config.json`` (model_type ``moelab``, transformers'
standard names, ``auto_map`` to the bundled code), ``generation_config.json``, the run's
``tokenizer.json`` with ``tokenizer_config.json`` and ``special_tokens_map.json`` (a plain
``PreTrainedTokenizerFast``: no custom code), the PyTorch code copied from ``hf_modeling/``
(``configuration_moelab.py``, ``layers_moelab.py``, ``modeling_moelab.py``), a model card
``README.md`` (``card.py``) and the Apache-2.0 ``LICENSE``, so that
``transformers.AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True)`` and
``AutoTokenizer.from_pretrained(OUT, trust_remote_code=True)`` load it. Everything is written
to a temporary folder first: a new OUT is that folder renamed at the end (complete or absent);
an empty OUT given (the current folder, a mount point, a link) stays and receives the finished
files, config.json last.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
import shutil
import socket
from pathlib import Path

import numpy as np

from moelab.config import ConfigError
from moelab.config.errors import require
from moelab.data.tokenizer import eos_id
from moelab.export.card import LICENSE, model_card
from moelab.util import (
    atomic_write_json,
    atomic_write_text,
    check_writable,
    chmod_as_created,
    extra_command,
    info,
    is_url,
    pid_alive,
)

HF_MODELING = Path(__file__).parent / "hf_modeling"
CODE_FILES = ("configuration_moelab.py", "layers_moelab.py", "modeling_moelab.py")
FORMATS = ("hf",)
# moelab config field -> its config.json name: transformers' standard names (as
# hf_modeling/configuration_moelab.py's STANDARD_NAMES; ``top_k`` would read as a sampling setting)
RENAMED_FIELDS = {
    "d_model": "hidden_size", "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "n_experts": "num_experts",
    "top_k": "num_experts_per_tok", "expert_dim": "intermediate_size",
    "norm_eps": "rms_norm_eps", "rope_fraction": "partial_rotary_factor",
    "aux_loss_coef": "router_aux_loss_coef",
}


def _norm(site: str, path: str) -> dict:
    """An RMSNorm's scale and its GatedNorm projections (moelab ``{site}_norm``, ``gn_{site}_*``)."""
    return {f"{site}_norm": (f"{path}.weight", False),
            f"gn_{site}_down": (f"{path}.gate_down.weight", True),
            f"gn_{site}_up": (f"{path}.gate_up.weight", True)}


# moelab parameter -> (Hugging Face name, transposed?): nn.Linear stores [out, in], moelab
# [in, out]; norms, short convolutions and the routed experts keep moelab's layout.
TOP_NAMES = {
    "embed": ("model.embed_tokens.weight", False),
    "head": ("lm_head.weight", True),
    **_norm("embed", "model.embed_norm"),
    **_norm("final", "model.norm"),
}
BLOCK_NAMES = {  # under model.layers.<i>.
    **_norm("attn", "attn_norm"),
    **_norm("moe", "moe_norm"),
    **{f"w{s}": (f"self_attn.{s}_proj.weight", True) for s in "qkvo"},
    "attn_gate": ("self_attn.gate_proj.weight", True),
    **{f"conv_{s}": (f"self_attn.conv.{s}.weight", False) for s in "qkv"},
    **{f"conv_{s}": (f"conv.{s}.weight", False) for s in ("attn", "moe")},
    "router": ("mlp.router.weight", True),
    **{w: (f"mlp.experts.{w}", False) for w in ("w_gate", "w_up", "w_down")},
    "lat_down": ("mlp.lat_down.weight", True),
    "lat_norm": ("mlp.lat_norm.weight", False),
    "lat_up": ("mlp.lat_up.weight", True),
    **{f"sh_{w}": (f"mlp.shared.{w}_proj.weight", True) for w in ("gate", "up", "down")},
}


def _renamed(table: dict, name: str, a) -> tuple[str, np.ndarray]:
    if name not in table:  # a new model option must be exported on purpose, never dropped
        raise ConfigError(f"export: parameter {name!r} has no Hugging Face name; add it to "
                          "moelab.export.hf and hf_modeling/modeling_moelab.py")
    hf, transpose = table[name]
    a = np.asarray(a, np.float32)
    return hf, np.ascontiguousarray(a.T if transpose else a)


def hf_tensors(params: dict, model_state: dict) -> dict[str, np.ndarray]:
    """Every parameter under its Hugging Face name (block stacks split per layer), plus each
    layer's router balancing bias, float32."""
    out = dict(_renamed(TOP_NAMES, k, v) for k, v in params.items() if k != "blocks")
    for k, stacked in params["blocks"].items():
        for i, a in enumerate(np.asarray(stacked)):
            name, t = _renamed(BLOCK_NAMES, k, a)
            out[f"model.layers.{i}.{name}"] = t
    for i, b in enumerate(np.asarray(model_state["router_bias"], np.float32)):
        out[f"model.layers.{i}.mlp.router_bias"] = b
    return out


def layer_types(m) -> list[str]:
    """transformers' ``layer_types`` of model config ``m``: sliding or full attention, "hybrid"
    where decoding also carries short-convolution state (as configuration_moelab.py derives)."""
    hybrid = bool(m.conv_site_set) and m.conv_kernel > 1
    return [("hybrid_sliding" if w else "hybrid") if hybrid else
            ("sliding_attention" if w else "full_attention") for w in m.layer_windows()]


def hf_config(cfg, eos: int, step: int) -> dict:
    """config.json: the whole moelab model config, under transformers' standard names where
    there is one (``RENAMED_FIELDS``), plus what transformers reads (``cfg``: the RunConfig)."""
    m = cfg.model
    fields = {RENAMED_FIELDS.get(k, k): v for k, v in dataclasses.asdict(m).items()}
    return {
        "architectures": ["MoelabForCausalLM"],
        "model_type": "moelab",
        "auto_map": {"AutoConfig": "configuration_moelab.MoelabConfig",
                     "AutoModel": "modeling_moelab.MoelabModel",
                     "AutoModelForCausalLM": "modeling_moelab.MoelabForCausalLM"},
        **fields,
        "sliding_window": m.sliding_window or None,  # transformers' "no window"
        "layer_types": layer_types(m),
        "hidden_act": "silu",
        # the context it was trained on: data.seq_len, or a longer context stage's
        "max_position_embeddings": cfg.data.trained_context(step),
        "bos_token_id": eos, "eos_token_id": eos, "pad_token_id": eos,  # end-of-text separates
        "dtype": "float32", "use_cache": True, "tie_word_embeddings": False,
        "moelab_step": step,
    }


def tokenizer_files(tok, seq_len: int) -> dict[str, dict]:
    """tokenizer_config.json and special_tokens_map.json for the run's tokenizer.json, so that
    AutoTokenizer loads it as a plain fast tokenizer (no custom code) with its end-of-text
    token, which also pads, on the left as batched generation needs."""
    eos = tok.id_to_token(eos_id(tok))
    return {"tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast",
                                      "eos_token": eos, "bos_token": eos, "pad_token": eos,
                                      "model_max_length": seq_len, "padding_side": "left",
                                      "clean_up_tokenization_spaces": False},
            "special_tokens_map.json": {"eos_token": eos, "bos_token": eos, "pad_token": eos}}


def check_out(out: Path) -> None:
    """OUT must be new or an empty folder, in a place this user can write: refused before the
    checkpoint is read, naming OUT, not the temporary folder written first."""
    what = f"OUT {out}"
    require(not out.exists() or (out.is_dir() and not any(out.iterdir())), what,
            "exists and is not an empty folder; give a new folder (nothing is overwritten)")
    # OUT under a file is said so, not only as "not writable" (what the check below finds)
    above = next((p for p in out.parents if p.is_file()), None)
    require(above is None, what, f"{above} is a file, not a folder; give a folder path")
    # an empty OUT is filled in place (_staging), so it, not its parent, must be writable; a
    # new OUT's nearest existing folder (util.writable looks up to it): a mount point or a
    # folder of one's own in a read-only parent is fine
    check_writable(out if out.is_dir() else out.parent, what,
                   "give a folder in a place you can write")


def _save_file():
    """safetensors' writer for numpy arrays (the hf extra; exporting needs no PyTorch)."""
    try:
        from safetensors.numpy import save_file
    except ImportError:
        raise ConfigError("--to hf: needs the safetensors package; install the hf extra: "
                          f"{extra_command('hf')}") from None
    return save_file


def write_folder(folder: Path, run, run_dir: Path, name: str, title: str | None = None) -> int:
    """Every file of the export of ``run`` (loaded from ``run_dir``) into ``folder``, whose model
    card loads it as ``name`` (``title``: the run's name); returns the parameter count."""
    tensors = hf_tensors(run.params, run.model_state)
    _save_file()(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    chmod_as_created(folder / "model.safetensors")
    eos = eos_id(run.tokenizer)
    atomic_write_json(folder / "config.json", hf_config(run.cfg, eos, run.step))
    atomic_write_json(folder / "generation_config.json",
                      {"eos_token_id": eos, "pad_token_id": eos, "use_cache": True})
    shutil.copyfile(run_dir / "tokenizer.json", folder / "tokenizer.json")
    for file, obj in tokenizer_files(run.tokenizer, run.context).items():
        atomic_write_json(folder / file, obj)
    for code in CODE_FILES:
        shutil.copyfile(HF_MODELING / code, folder / code)
    atomic_write_text(folder / "README.md", model_card(run, run_dir, name, title))
    shutil.copyfile(LICENSE, folder / "LICENSE")
    return sum(t.size for k, t in tensors.items() if not k.endswith("router_bias"))


def _staging(out: Path) -> Path:
    """Where the export is written before it moves into place: a sibling of a new OUT (renamed
    to it whole), or inside an empty OUT, which stays (it may be the current folder, a mount
    point or a link, which a rename over it would break). Named by host and process, so that
    one a killed export left is told from one under way (``_left_by_killed``)."""
    tag = f"tmp-{socket.gethostname()}-{os.getpid()}"
    if out.is_dir():
        return out / f".moelab-export.{tag}"
    return out.parent / f".{out.name}.{tag}"


def _left_by_killed(out: Path) -> list[Path]:
    """Staging folders of exports to ``out`` whose process, on this host, is gone (kill -9, a
    lost machine): a whole model's size each, and inside an empty OUT they made it not empty."""
    here = socket.gethostname()
    found = [*(out.glob(".moelab-export.tmp-*") if out.is_dir() else []),
             *out.parent.glob(f".{glob.escape(out.name)}.tmp-*")]
    named = [(p, re.fullmatch(r".*\.tmp-(?:(.+)-)?(\d+)", p.name)) for p in found]
    return [p for p, m in named if m and p.is_dir() and (m[1] or here) == here
            and not pid_alive(int(m[2]))]


def _move_into_place(tmp: Path, out: Path) -> None:
    if tmp.parent != out:
        check_out(out)  # still free: nothing appeared there while we wrote
        tmp.rename(out)
        return
    require(not [p for p in out.iterdir() if p != tmp], f"OUT {out}", "files appeared there "
            "while exporting; give a new folder (nothing is overwritten)")
    moved = []
    try:
        for f in sorted(tmp.iterdir(), key=lambda f: f.name == "config.json"):  # loads last
            f.rename(out / f.name)
            moved.append(out / f.name)
    except BaseException:  # interrupted: OUT empty again, as given
        for f in moved:
            f.unlink(missing_ok=True)
        raise
    tmp.rmdir()


def export_hf(run_dir: Path | str, out: Path, step: int | None = None) -> tuple[int, int]:
    """Export the newest checkpoint (or ``step``) of the run in ``run_dir``, a folder or a run
    URL, to ``out``; returns (step, params)."""
    from moelab.run.load import load_run, run_name  # JAX and orbax: loaded only when exporting

    for stale in _left_by_killed(out):
        shutil.rmtree(stale, ignore_errors=True)
        info(f"{stale}: removed, the unfinished export of a process that is gone")
    check_out(out)
    _save_file()  # a missing extra stops here, before the checkpoint is read
    files = Path(run_dir)  # the run's other files: tokenizer, summary, evaluations
    if is_url(run_dir):
        from moelab.run.remote import fetch_run

        files = fetch_run(str(run_dir), checkpoint=False)
    run = load_run(run_dir, step=step)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = _staging(out)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        # the card loads it as OUT as typed, but a card meant for a hub never names this
        # machine's folders: an absolute OUT is named by its last part
        n = write_folder(tmp, run, files, out.name if out.is_absolute() else str(out),
                         run_name(run_dir))
        _move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return run.step, n


def export(run_dir: Path | str, fmt: str, out: Path, step: int | None = None) -> tuple[int, int]:
    # format names are not case-sensitive: --to HF is hf
    require(fmt.lower() in FORMATS, f"--to {fmt}",
            f"unknown format; use one of {', '.join(FORMATS)}")
    return export_hf(run_dir, out, step)
