"""Llama 2, 3, 3.1 and 3.2 (``LlamaForCausalLM``): the Llama-like mapping and table as they are.

Rope: plain, or scaled (linear, dynamic NTK, YaRN, Llama 3.1's ``llama3``); a head width apart
from hidden / heads through ``head_dim``; 3.2's tied embeddings through ``tie_word_embeddings``.
"""
from .base import Family


class Llama(Family):
    name = model_type = "llama"
    title = "Llama"
    architectures = ("LlamaForCausalLM",)


FAMILY = Llama()
