"""Hugging Face model directories <-> :class:`~burstengine.model.Transformer`.

One home for everything that reads or writes the HF format, shared by training (``init``),
inference (``burstengine prefill --model DIR``) and ``burstengine export``:

* :func:`args_from_hf_config`: config.json -> :class:`ModelArgs` for the supported
  architectures (:data:`SUPPORTED`), or a ValueError naming what is not supported;
  :func:`hf_config_from_args` the way back (rope settings and context included).
* :func:`hf_to_ours` / :func:`ours_to_hf`: the parameter name table.  HF's rotary convention
  (rotate the two halves of each head) is ours, so q/k weights are copied as they are.
* :func:`load_weights`: safetensors (single or sharded with an index) into a model that may be
  FSDP2-sharded: each rank reads only the rows of each tensor it keeps
  (``safe_open(...).get_slice``), so no rank ever holds a whole copy in host or device memory.
* :func:`write_hf_dir`: tensors -> model.safetensors (sharded with an index above a size) +
  config.json + generation_config.json (+ tokenizer files copied from a source directory).
* :func:`write_random_hf_dir`: a random-weight HF directory of a given config (Llama-3.2-3B,
  Llama-3.1-8B: :data:`CONFIGS`), written a tensor at a time.

Only json and safetensors are needed here; transformers itself is not imported.
"""
from __future__ import annotations

import json
import math
import os
import re
import resource
import shutil
import time

import torch

from .llama import ModelArgs
from .rope import RopeScaling
from .llama import Transformer

# HF architecture -> our arch name (ModelArgs.arch) and HF model_type
SUPPORTED = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
             "MistralForCausalLM": "mistral"}
ARCH_CLASS = {v: k for k, v in SUPPORTED.items()}
ROPE_FROM_HF = {"default": "none", "linear": "linear", "dynamic": "dynamic", "yarn": "yarn", "llama3": "llama3"}

# HF parameter name -> ours; {i} is the layer index
_LAYER = {
    "input_layernorm.weight": "attention_norm.weight",
    "self_attn.q_proj.weight": "attention.wq.weight",
    "self_attn.k_proj.weight": "attention.wk.weight",
    "self_attn.v_proj.weight": "attention.wv.weight",
    "self_attn.q_proj.bias": "attention.wq.bias",
    "self_attn.k_proj.bias": "attention.wk.bias",
    "self_attn.v_proj.bias": "attention.wv.bias",
    "self_attn.q_norm.weight": "attention.q_norm.weight",
    "self_attn.k_norm.weight": "attention.k_norm.weight",
    "self_attn.o_proj.weight": "attention.wo.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "feed_forward.w1.weight",
    "mlp.down_proj.weight": "feed_forward.w2.weight",
    "mlp.up_proj.weight": "feed_forward.w3.weight",
}
_LAYER_BACK = {v: k for k, v in _LAYER.items()}
_TOP = {
    "model.embed_tokens.weight": "tok_embeddings.weight",
    "model.norm.weight": "norm.weight",
    "lm_head.weight": "output.weight",
}
_TOP_BACK = {v: k for k, v in _TOP.items()}
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_OURS_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)$")
# buffers some checkpoints carry that our model recomputes
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
SHARD_BYTES = 5 * 2 ** 30  # transformers' default max_shard_size ("5GB")


def hf_to_ours(name: str) -> str | None:
    """Our parameter name for an HF one (None: a buffer we do not keep)."""
    if not name.startswith(("model.", "lm_head.")):
        name = "model." + name  # a bare base-model checkpoint
    if _IGNORED.search(name):
        return None
    if name in _TOP:
        return _TOP[name]
    m = _LAYER_RE.match(name)
    if m and m.group(2) in _LAYER:
        return f"layers.{m.group(1)}.{_LAYER[m.group(2)]}"
    raise ValueError(f"unexpected tensor {name!r} in the checkpoint: not part of a "
                     f"{'/'.join(SUPPORTED)} model")


def ours_to_hf(name: str) -> str:
    """The inverse of :func:`hf_to_ours`."""
    if name in _TOP_BACK:
        return _TOP_BACK[name]
    m = _OURS_LAYER_RE.match(name)
    if m and m.group(2) in _LAYER_BACK:
        return f"model.layers.{m.group(1)}.{_LAYER_BACK[m.group(2)]}"
    raise ValueError(f"no HF name for {name!r}")


# --- config.json --------------------------------------------------------------------------------

def read_config(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ValueError(f"{path!r} is not an HF model directory: it has no config.json")
    with open(f) as fh:
        return json.load(fh)


def architecture(cfg: dict, where: str = "config.json") -> str:
    """Our arch name for an HF config, or a ValueError listing what is supported."""
    archs = cfg.get("architectures") or []
    name = archs[0] if archs else {v: k for k, v in SUPPORTED.items()}.get(cfg.get("model_type"), cfg.get("model_type"))
    if name not in SUPPORTED:
        raise ValueError(f"{where}: architecture {name!r} is not supported; burstengine's model reproduces "
                         f"{', '.join(SUPPORTED)}")
    return SUPPORTED[name]


def _rope(cfg: dict, where: str) -> tuple[float, RopeScaling]:
    # transformers 5 writes rope_parameters {rope_type, rope_theta, ...}; 4.x wrote rope_theta and
    # rope_scaling at the top level
    params = dict(cfg.get("rope_parameters") or {})
    params.update(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind not in ROPE_FROM_HF:
        raise ValueError(f"{where}: rope type {kind!r} is not supported; expected one of {sorted(ROPE_FROM_HF)}")
    if float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))) != 1.0:
        raise ValueError(f"{where}: partial_rotary_factor != 1 is not supported")
    s = RopeScaling(type=ROPE_FROM_HF[kind])
    if s.type == "none":
        return theta, s
    for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow", "attention_factor",
                "mscale", "mscale_all_dim"):
        if params.get(key) is not None:
            setattr(s, key, float(params[key]))
    if params.get("original_max_position_embeddings") is not None:
        s.original_max_position_embeddings = int(params["original_max_position_embeddings"])
    if params.get("truncate") is not None:
        s.truncate = bool(params["truncate"])
    if s.type == "dynamic":  # transformers' dynamic NTK uses max_position_embeddings as the original length
        s.original_max_position_embeddings = int(cfg.get("max_position_embeddings") or 0)
    return theta, s


def args_from_hf_config(cfg: dict, where: str = "config.json") -> ModelArgs:
    """ModelArgs for an HF config.json (a dict), or a ValueError saying what is not supported."""
    arch = architecture(cfg, where)
    problems = []
    if cfg.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={cfg['hidden_act']!r}")
    if cfg.get("mlp_bias"):
        problems.append("mlp_bias=true")
    if cfg.get("attention_bias") and arch != "qwen2":  # Llama's / Qwen3's also put a bias on o_proj
        problems.append("attention_bias=true")
    if arch in ("qwen2", "qwen3") and cfg.get("use_sliding_window"):
        problems.append("use_sliding_window=true (per-layer windows)")
    if problems:
        raise ValueError(f"{where}: this {arch} checkpoint has {', '.join(problems)}, which burstengine's model does "
                         f"not implement")
    theta, scaling = _rope(cfg, where)
    dim, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    head = cfg.get("head_dim") or dim // heads
    window = cfg.get("sliding_window") if arch == "mistral" else None
    args = ModelArgs(dim=dim, n_layers=cfg["num_hidden_layers"], n_heads=heads,
                     n_kv_heads=cfg.get("num_key_value_heads") or heads, vocab_size=cfg["vocab_size"],
                     ffn_dim=cfg["intermediate_size"], norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                     rope_theta=theta, tie_embeddings=bool(cfg.get("tie_word_embeddings", False)), arch=arch,
                     head_size=0 if head * heads == dim else head, qkv_bias=arch == "qwen2",
                     qk_norm=arch == "qwen3", window=int(window or 0),
                     max_position_embeddings=int(cfg.get("max_position_embeddings") or 0), rope_scaling=scaling)
    try:
        args.validate()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return args


def rope_parameters(args: ModelArgs) -> dict | None:
    """transformers' rope_scaling dict for our scaling (None: plain RoPE)."""
    s = args.rope_scaling
    if s.type == "none":
        return None
    out = {"rope_type": s.type, "factor": s.factor}
    if s.type == "yarn":
        out.update(original_max_position_embeddings=s.original(args.max_position_embeddings), beta_fast=s.beta_fast,
                   beta_slow=s.beta_slow, truncate=s.truncate)
        for key in ("attention_factor", "mscale", "mscale_all_dim"):
            if getattr(s, key):
                out[key] = getattr(s, key)
    elif s.type == "llama3":
        out.update(original_max_position_embeddings=s.original(args.max_position_embeddings),
                   low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
    return out


def context_length(args: ModelArgs, seq_len: int = 0) -> int:
    """max_position_embeddings to write: the trained length when it is longer than the model's,
    except under dynamic NTK, where transformers reads it as the *original* length."""
    if args.rope_scaling.type == "dynamic":
        return args.rope_scaling.original(args.max_position_embeddings)
    return max(args.max_position_embeddings, seq_len) or seq_len or 4096


def hf_config_from_args(args: ModelArgs, seq_len: int = 0, base: dict | None = None, dtype: str | None = None) -> dict:
    """config.json for our model: ``base`` (the source directory's config, keeping its token ids
    and other keys) with our shape, rope settings and context written over it.  Rope settings are
    written as ``rope_theta`` / ``rope_scaling``, which transformers 4.x and 5.x both read."""
    cfg = dict(base or {})
    for key in ("rope_parameters", "rope_scaling", "rope_theta", "transformers_version", "torch_dtype", "dtype"):
        cfg.pop(key, None)
    cfg.update(architectures=[ARCH_CLASS[args.arch]], model_type=args.arch, hidden_size=args.dim,
               num_hidden_layers=args.n_layers, num_attention_heads=args.n_heads, num_key_value_heads=args.n_kv_heads,
               head_dim=args.head_dim, vocab_size=args.vocab_size, intermediate_size=args.ffn_dim,
               rms_norm_eps=args.norm_eps, hidden_act="silu", tie_word_embeddings=args.tie_embeddings,
               rope_theta=args.rope_theta, rope_scaling=rope_parameters(args),
               max_position_embeddings=context_length(args, seq_len))
    if args.arch == "mistral":
        cfg["sliding_window"] = args.window or None
    elif args.window:
        raise ValueError(f"a sliding window (model.window={args.window}) can only be written as a Mistral model, "
                         f"not {args.arch!r}")
    if args.arch in ("qwen2", "qwen3"):
        cfg.setdefault("use_sliding_window", False)
    if dtype:
        cfg["torch_dtype"] = dtype
    return cfg


# --- reading weights ----------------------------------------------------------------------------

def tensor_files(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {k: os.path.join(path, v) for k, v in json.load(f)["weight_map"].items()}
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r} (only safetensors "
                         f"checkpoints are read)")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def local_rows(p: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(this rank's local tensor, first row, end row) of parameter ``p`` along dim 0: the whole
    tensor for a plain one, the rows this rank keeps for a DTensor sharded on dim 0 (FSDP2:
    torch.chunk's split, ceil(N / world) rows per rank, the last ranks' possibly fewer or none)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(p, DTensor):
        return p.data, 0, p.shape[0]
    local = p.to_local()
    start, size = 0, p.shape[0]
    for mesh_dim, pl in enumerate(p.placements):
        if isinstance(pl, Replicate):
            continue
        if type(pl) is not Shard or pl.dim != 0:
            raise ValueError(f"cannot load into a parameter placed as {p.placements} (only Shard(0) / Replicate)")
        world, coord = p.device_mesh.size(mesh_dim), p.device_mesh.get_local_rank(mesh_dim)
        chunk = math.ceil(size / world)
        lo = min(coord * chunk, size)
        start, size = start + lo, min(chunk, size - lo)
    if local.shape[0] != size:
        raise AssertionError(f"local shard of {tuple(p.shape)} has {local.shape[0]} rows, {size} expected")
    return local, start, start + size


@torch.no_grad()
def load_weights(model, path: str) -> dict:
    """Fill ``model``'s parameters (plain, or sharded by FSDP2 on any device) from the HF
    checkpoint in directory ``path``, each rank reading only the rows it keeps.  Returns
    {"load_s", "peak_rss_gib", "read_gib"} of this process."""
    from safetensors import safe_open

    t0 = time.perf_counter()
    files = tensor_files(path)
    params = dict(model.named_parameters())
    want = {ours_to_hf(n): n for n in params}
    missing = sorted(set(want) - set(files))
    if missing:
        raise ValueError(f"the checkpoint in {path!r} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}")
    tied = "output.weight" not in params
    extra = [k for k in files if k not in want and hf_to_ours(k) is not None and not (tied and k == "lm_head.weight")]
    if extra:
        raise ValueError(f"the checkpoint in {path!r} holds {len(extra)} tensor(s) its config.json does not describe, "
                         f"e.g. {extra[:3]}")
    by_file: dict[str, list[str]] = {}
    for hf, f in files.items():
        if hf in want:
            by_file.setdefault(f, []).append(hf)
    read = 0
    for fname in sorted(by_file):
        with safe_open(fname, framework="pt") as f:
            for hf in sorted(by_file[fname]):
                p = params[want[hf]]
                sl = f.get_slice(hf)
                shape = tuple(sl.get_shape())
                if shape != tuple(p.shape):
                    raise ValueError(f"{os.path.basename(fname)}: {hf} has shape {shape}, {tuple(p.shape)} expected "
                                     f"from config.json")
                local, lo, hi = local_rows(p)
                if hi > lo:
                    t = sl[lo:hi]
                    read += t.numel() * t.element_size()
                    local.copy_(t)
    return {"load_s": time.perf_counter() - t0, "peak_rss_gib": peak_rss_gib(), "read_gib": read / 2 ** 30}


def peak_rss_gib() -> float:
    """This process's peak resident set size (ru_maxrss is in KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20


# --- writing ------------------------------------------------------------------------------------

def shard_plan(sizes: dict[str, int], max_bytes: int = SHARD_BYTES) -> list[list[str]]:
    """Tensor names (in order) cut into consecutive files of at most ``max_bytes`` (a larger
    tensor gets a file of its own)."""
    files, cur, used = [], [], 0
    for name, n in sizes.items():
        if cur and used + n > max_bytes:
            files.append(cur)
            cur, used = [], 0
        cur.append(name)
        used += n
    if cur:
        files.append(cur)
    return files


def write_hf_dir(out_dir: str, config: dict, groups, n_files: int, source_dir: str | None = None,
                 generation: dict | None = None) -> dict:
    """Write an HF model directory: ``groups`` yields, for each of ``n_files`` files, a dict
    {HF name: tensor} (so a whole model never needs to be in memory); then config.json,
    generation_config.json and the tokenizer files of ``source_dir``.  Returns {"files", "bytes"}."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):  # a previous export's shards would confuse the index
        if old.startswith("model") and old.endswith((".safetensors", ".safetensors.index.json")):
            os.remove(os.path.join(out_dir, old))
    weight_map, total = {}, 0
    for i, tensors in enumerate(groups):
        fname = "model.safetensors" if n_files == 1 else f"model-{i + 1:05d}-of-{n_files:05d}.safetensors"
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        save_file(tensors, os.path.join(out_dir, fname), metadata={"format": "pt"})
        for k, v in tensors.items():
            weight_map[k] = fname
            total += v.numel() * v.element_size()
    if n_files > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    gen = None
    if source_dir and os.path.isfile(os.path.join(source_dir, "generation_config.json")):
        with open(os.path.join(source_dir, "generation_config.json")) as f:
            gen = json.load(f)
    if gen is None:
        gen = generation or {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")
                             if config.get(k) is not None}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    copied = []
    if source_dir:
        for name in TOKENIZER_FILES:
            src = os.path.join(source_dir, name)
            if os.path.isfile(src):
                shutil.copyfile(src, os.path.join(out_dir, name))
                copied.append(name)
    return {"files": n_files, "bytes": total, "tokenizer_files": copied}


def param_shapes(args: ModelArgs) -> dict[str, tuple]:
    """HF name -> shape of every tensor of a model with ``args`` (built on the meta device)."""

    with torch.device("meta"):
        m = Transformer(args)
    return {ours_to_hf(n): tuple(p.shape) for n, p in m.named_parameters()}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_random_hf_dir(out_dir: str, config: dict, seed: int = 0, dtype: str = "bfloat16", device="cpu",
                        max_shard_bytes: int = 2 * 2 ** 30) -> dict:
    """A random-weight HF model directory for ``config`` (a config.json dict, e.g. one of
    :data:`CONFIGS`), written a file at a time, so at most ``max_shard_bytes`` of weights are in
    host memory.  Weights ~ N(0, 0.02), norms 1, biases 0; generated on ``device`` (a GPU is much
    faster for 8B)."""
    args = args_from_hf_config(config, "the given config")
    shapes = param_shapes(args)
    dt = DTYPES[dtype]
    sizes = {k: math.prod(s) * dt.itemsize for k, s in shapes.items()}
    plan = shard_plan(sizes, max_shard_bytes)
    g = torch.Generator(device=device).manual_seed(seed)

    def groups():
        for names in plan:
            out = {}
            for k in names:
                if k.endswith("norm.weight"):
                    t = torch.ones(shapes[k], dtype=dt)
                elif k.endswith(".bias"):
                    t = torch.zeros(shapes[k], dtype=dt)
                else:
                    t = torch.empty(shapes[k], device=device, dtype=dt).normal_(0.0, 0.02, generator=g).cpu()
                out[k] = t
            yield out

    cfg = dict(config, torch_dtype=dtype)
    return write_hf_dir(out_dir, cfg, groups(), len(plan))


# exact configs of public models (as their config.json has them), for random-weight stand-ins
CONFIGS = {
    "llama-3.2-3b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 28, "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": True, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02,
        "pretraining_tp": 1, "use_cache": True},
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
        "rope_scaling": {"factor": 8.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 128000, "eos_token_id": 128001, "initializer_range": 0.02,
        "pretraining_tp": 1, "use_cache": True},
}
