"""Hugging Face checkpoints (config.json + safetensors) -> :class:`burstengine.model.Transformer`
for inference.

The format itself (architectures, name table, rope settings, sliced safetensors reads) lives in
:mod:`burstengine.model.hf`, shared with training's ``init`` and ``burstengine export``; this
module only builds an unsharded model on one device from it.  A checkpoint our model cannot
reproduce exactly is refused with a ValueError naming the field; run such models through
``--impl hf`` instead.
"""
from __future__ import annotations

import torch

from ..model.hf import args_from_hf_config, hf_to_ours, ours_to_hf, read_config  # noqa: F401  (re-exported)
from ..model import Transformer
from ..model.hf import hf_config_from_args as _hf_config
from ..model.hf import load_weights


def hf_config_from_args(args) -> dict:
    """The config.json of an HF model with our model's shape (for ``--impl hf`` on a preset);
    the context is left open (RoPE without scaling does not depend on it)."""
    return _hf_config(args, seq_len=1 << 22)


@torch.no_grad()
def load_hf_llama(path: str, device="cpu", dtype=torch.float32):
    """Our Transformer with the weights of the HF checkpoint in directory ``path`` (any
    architecture of :data:`burstengine.model.hf.SUPPORTED`).

    Parameters are created on the meta device and filled tensor by tensor straight from the
    safetensors files onto ``device``, so a model is never held twice in memory."""
    args = args_from_hf_config(read_config(path), f"{path}/config.json")
    with torch.device("meta"):
        model = Transformer(args)
    model.to(dtype).to_empty(device=device)
    load_weights(model, path)
    return model
