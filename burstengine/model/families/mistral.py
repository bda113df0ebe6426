"""Mistral (``MistralForCausalLM``): the Llama-like model with one sliding window for every layer
(``sliding_window`` = W: each query sees the W most recent keys, itself included;
``ModelArgs.window``), null for none.
"""
from .base import Family


class Mistral(Family):
    name = model_type = "mistral"
    title = "Mistral"
    architectures = ("MistralForCausalLM",)
    expresses = {"window": "a sliding window"}

    def options(self, cfg):
        return {"window": int(cfg.get("sliding_window") or 0)}

    def write_options(self, args, cfg):
        cfg["sliding_window"] = args.window or None


FAMILY = Mistral()
