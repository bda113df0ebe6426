"""Hugging Face model directories <-> :class:`~burstengine.model.Transformer`, whatever the family.

One home for reading and writing the HF format, shared by training (``init``), inference
(``burstengine prefill --model DIR``) and ``burstengine export``; what differs between families
(config keys, tensor names, fused tensors, rope variants) is their adapters'
(:mod:`burstengine.model.families`):

* :func:`read_config`, :func:`args_from_hf_config`: config.json -> :class:`ModelArgs` through
  the family its architecture names, or a ValueError naming what is not supported;
  :func:`hf_config_from_args` the way back (rope settings and context included).
* :func:`hf_tensors`: a model's HF tensors, each with the parameters of ours it is made of
  (fused ones split by rows).  HF's rotary convention (rotate the two halves of each head) is
  ours, so q/k weights are copied as they are.
* :func:`load_weights`: safetensors (single or sharded with an index) into a model that may be
  FSDP2-sharded: each rank reads only the rows of each tensor it keeps
  (``safe_open(...).get_slice``), so no rank ever holds a whole copy in host or device memory;
  :func:`load_hf_model` an unsharded model on one device from a directory.
* :func:`write_hf_dir`: tensors -> model.safetensors (sharded with an index above a size) +
  config.json + generation_config.json (+ tokenizer files copied from a source directory).
* :func:`write_random_hf_dir`: a random-weight HF directory of a given config (Llama-3.2-3B,
  Llama-3.1-8B, Gemma-3-1B, Phi-3-mini-128k: :data:`CONFIGS`), written a tensor at a time.

Only json and safetensors are needed here; transformers itself is not imported.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import shutil
import time

import torch

from .families import family, from_config, writer
from .families.registry import hf_parameter
from .families.table import HFTensors
from . import tensor_parallel
from .args import ModelArgs
from .decoder import Transformer
from .lora import is_adapter

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja")
SHARD_BYTES = 5 * 2 ** 30  # transformers' default max_shard_size ("5GB")
OPEN_CONTEXT = 1 << 22  # a config's context when the model is meant for any length (RoPE unscaled ignores it)


def hf_to_ours(name: str, arch: str = "llama") -> tuple[str, ...] | None:
    """Our parameters in HF tensor ``name`` of family ``arch`` (None: a buffer we do not keep)."""
    return family(arch).ours_of(name)


def ours_to_hf(name: str, arch: str = "llama") -> str:
    """The HF tensor of family ``arch`` that holds our parameter ``name`` (whole or a part)."""
    return family(arch).hf_of(name)


# --- config.json --------------------------------------------------------------------------------

def read_json(f: str, what: str = "a JSON object") -> dict:
    """The JSON object in file ``f``: ValueError naming the file when it is unreadable, not JSON
    or not an object (every JSON file of a model directory is read through here)."""
    try:
        with open(f) as fh:
            obj = json.load(fh)
    except OSError as e:
        raise ValueError(f"{f}: cannot be read ({e.strerror or e})") from None
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{f} is not valid JSON ({str(e).splitlines()[0][:160]})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{f} is not {what}: it holds a JSON {type(obj).__name__}")
    return obj


def read_config(path: str) -> dict:
    f = os.path.join(path, "config.json")
    if not os.path.isfile(f):
        raise ValueError(f"{path!r} is not an HF model directory: it has no config.json")
    return read_json(f, "an HF config (a JSON object)")


def args_from_hf_config(cfg: dict, where: str = "config.json") -> ModelArgs:
    """ModelArgs for an HF config.json (a dict), or a ValueError saying what is not supported."""
    args = ModelArgs(**from_config(cfg, where).model_fields(cfg, where))
    try:
        args.validate()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return args


def hf_config_from_args(args: ModelArgs, seq_len: int = OPEN_CONTEXT, base: dict | None = None,
                        dtype: str | None = None) -> dict:
    """config.json for our model, written as its family (``args.arch``): ``base`` (the source
    directory's config, keeping its token ids and other keys) with our shape, rope settings and
    context written over it; max_position_embeddings at least ``seq_len`` (by default open, for a
    model run at any length), except under dynamic NTK (see families.base.context_length)."""
    return writer(args).hf_config(args, seq_len, base, dtype)


def hf_tensors(args: ModelArgs) -> HFTensors:
    """The HF tensors of a model with ``args`` as its family writes it (a ValueError for a model
    it cannot write), each with the parameters of ours it is made of (a model built on the meta
    device)."""
    table = writer(args).table
    with torch.device("meta"):
        m = Transformer(args)
    return table.tensors(args, {n: tuple(p.shape) for n, p in m.named_parameters()})


# --- reading weights ----------------------------------------------------------------------------

def tensor_files(path: str) -> dict[str, str]:
    """HF tensor name -> the safetensors file holding it, after checking the directory's files
    (headers only, no weights read): the index is JSON mapping names to files, every file it
    names exists, is a complete safetensors file and holds the tensors the index puts in it.
    Any problem is one ValueError naming the file (the same on every rank that reads it)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        weight_map = read_json(index, "a safetensors index (a JSON object)").get("weight_map")
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise ValueError(f"{index} has no weight_map of tensor name -> file name")
        files = {k: os.path.join(path, v) for k, v in weight_map.items()}
    else:
        single = os.path.join(path, "model.safetensors")
        if not os.path.isfile(single):
            raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r} (only safetensors "
                             f"checkpoints are read)")
        files = {k: single for k in safetensors_names(single)}
        return files
    held: dict[str, list[str]] = {}
    for k, f in files.items():
        held.setdefault(f, []).append(k)
    for f, names in sorted(held.items()):
        if not os.path.isfile(f):
            raise ValueError(f"{f} is missing: {os.path.basename(index)} puts {len(names)} tensor(s) in it, e.g. "
                             f"{sorted(names)[0]}")
        lacking = sorted(set(names) - safetensors_names(f))
        if lacking:
            raise ValueError(f"{f} does not hold {len(lacking)} tensor(s) that {os.path.basename(index)} puts in it, "
                             f"e.g. {lacking[0]} (the index points at the wrong file)")
    return files


def safetensors_names(f: str) -> set[str]:
    """The tensor names in safetensors file ``f`` (its header only); ValueError naming the file
    when it is not a complete safetensors file (truncated, garbled, empty)."""
    from safetensors import safe_open

    try:
        with safe_open(f, framework="pt") as fh:
            return set(fh.keys())
    except OSError as e:
        raise ValueError(f"{f}: cannot be read ({e.strerror or e})") from None
    except Exception as e:  # SafetensorError: the header does not parse or the data does not fit the file
        raise ValueError(f"{f} is not a complete safetensors file, truncated or corrupt ({_first_line(e)})") from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:200]


def args_from_hf_dir(path: str) -> ModelArgs:
    """ModelArgs of the HF model directory ``path``: its config.json, except that a config that
    ties the embeddings (``tie_word_embeddings``) while the files hold an ``lm_head.weight`` that
    differs from ``model.embed_tokens.weight`` gets an untied head, with a warning, as
    transformers does (it loads such a checkpoint untied).  Checks the weight files' structure
    (:func:`tensor_files`); every path that reads an HF directory builds its model through here."""
    args = args_from_hf_config(read_config(path), os.path.join(path, "config.json"))
    files = tensor_files(path)
    if args.tie_embeddings and "lm_head.weight" in files:
        embed = next((k for k in files if k.endswith("embed_tokens.weight")), None)
        if embed is None or not _same_tensor(files, embed, "lm_head.weight"):
            import warnings

            warnings.warn(UntiedHead(
                f"{path}/config.json ties the embeddings (tie_word_embeddings=true), but {files['lm_head.weight']} "
                f"holds an lm_head.weight that differs from {embed or 'the embeddings'}: using the file's lm_head "
                f"(as transformers does); set tie_word_embeddings=false to silence this"))
            args = dataclasses.replace(args, tie_embeddings=False)
    return args


class UntiedHead(UserWarning):
    """A config says tied embeddings, the files hold a distinct head: it is loaded untied."""


def _same_tensor(files: dict[str, str], a: str, b: str) -> bool:
    from safetensors import safe_open

    got = []
    for name in (a, b):
        with safe_open(files[name], framework="pt") as f:
            got.append(f.get_tensor(name))
    return got[0].shape == got[1].shape and bool(torch.equal(got[0], got[1]))


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
    """Fill ``model``'s parameters (plain, sharded by FSDP2 on any device, or a tensor-parallel
    slice: model/tensor_parallel.py; LoRA adapters aside) from the HF checkpoint in directory
    ``path`` through its family's table, each rank reading only the rows it keeps (of a fused
    tensor: the rows of the parts it keeps; of a slice of wo / w2: its columns).  Returns
    {"load_s", "peak_rss_gib", "read_gib", "read_bytes", "nonfinite"} of this process;
    "nonfinite": one line naming the first tensor (and file) whose part read here holds NaN or
    inf, else None (the caller decides: :func:`load_hf_model` raises it; a sharded load must share
    it between its ranks first).  A directory whose files are damaged is a ValueError naming the
    file (:func:`tensor_files`)."""
    from safetensors import safe_open

    t0 = time.perf_counter()
    files = tensor_files(path)
    params = {n: p for n, p in model.named_parameters() if not is_adapter(n)}  # LoRA's are not in the checkpoint
    split = getattr(model, "tp", None)
    shapes = {n: split.full_shape(n, p.shape, model.args) if split else tuple(p.shape) for n, p in params.items()}
    want = family(model.args.arch).table.tensors(model.args, shapes)
    missing = sorted(set(want.parts) - set(files))
    if missing:
        raise ValueError(f"the checkpoint in {path!r} lacks {len(missing)} tensor(s) the model needs, e.g. {missing[:3]}")
    tied = "output.weight" not in params
    embed = next(hf for hf, ps in want.parts.items() if ps[0].name == "tok_embeddings.weight")
    if tied and "lm_head.weight" in files and not _same_tensor(files, embed, "lm_head.weight"):
        raise ValueError(f"{files['lm_head.weight']}: lm_head.weight differs from the embeddings, but the model ties "
                         f"them: build it with args_from_hf_dir({path!r}), which unties it as transformers does")
    extra = [k for k in files if k not in want.parts and hf_parameter(k) and not (tied and k == "lm_head.weight")]
    if extra:
        raise ValueError(f"the checkpoint in {path!r} holds {len(extra)} tensor(s) its config.json does not describe, "
                         f"e.g. {extra[:3]}")
    by_file: dict[str, list[str]] = {}
    for hf, f in files.items():
        if hf in want.parts:
            by_file.setdefault(f, []).append(hf)
    read, nonfinite = 0, None
    for fname in sorted(by_file):
        with safe_open(fname, framework="pt") as f:
            for hf in sorted(by_file[fname]):
                sl = f.get_slice(hf)
                shape = tuple(sl.get_shape())
                if shape != want.shapes[hf]:
                    raise ValueError(f"{os.path.basename(fname)}: {hf} has shape {shape}, {want.shapes[hf]} expected "
                                     f"from config.json")
                for part in want.parts[hf]:
                    cut = split.cut(part.name, model.args) if split else None
                    try:
                        if cut is not None and cut.dim == 1:  # columns of the part's rows
                            local, t = params[part.name].data, sl[part.start:part.start + part.rows,
                                                                  cut.start:cut.start + cut.size]
                        else:
                            local, lo, hi = local_rows(params[part.name])
                            if cut is not None:
                                lo, hi = cut.start, cut.start + cut.size
                            if hi <= lo:
                                continue
                            t = sl[part.start + lo:part.start + hi]
                    except Exception as e:  # the file changed, or its data does not decode
                        raise ValueError(f"{fname}: {hf} cannot be read ({_first_line(e)})") from None
                    read += t.numel() * t.element_size()
                    if nonfinite is None and t.is_floating_point() and not bool(torch.isfinite(t).all()):
                        nonfinite = f"{fname}: tensor {hf} holds NaN or inf"
                    local.copy_(t)
    return {"load_s": time.perf_counter() - t0, "peak_rss_gib": peak_rss_gib(), "read_gib": read / 2 ** 30,
            "read_bytes": read, "nonfinite": nonfinite}


@torch.no_grad()
def load_hf_model(path: str, device="cpu", dtype=torch.float32, split=None) -> Transformer:
    """Our Transformer with the weights of the HF checkpoint in directory ``path`` (any family of
    the registry), unsharded on ``device``, or only ``split``'s tensor-parallel slices
    (:class:`~.tensor_parallel.Split`).  A checkpoint our model cannot reproduce exactly is
    refused with a ValueError naming the field (run such models through ``--impl hf``); a
    damaged one (files missing, truncated or garbled, a weight holding NaN or inf) with a
    ValueError naming the file and tensor.

    Parameters are created on the meta device and filled tensor by tensor straight from the
    safetensors files onto ``device``, so a model is never held twice in memory."""
    args = args_from_hf_dir(path)
    model = tensor_parallel.empty_model(args, device, dtype, split)
    stats = load_weights(model, path)
    if stats["nonfinite"]:
        raise ValueError(stats["nonfinite"])
    return model


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
                 generation: dict | None = None, tokenizer: str | None = None) -> dict:
    """Write an HF model directory: ``groups`` yields, for each of ``n_files`` files, a dict
    {HF name: tensor} (so a whole model never needs to be in memory); then config.json,
    generation_config.json and the tokenizer files of ``tokenizer`` (a directory, or a
    tokenizer.json file: see :func:`tokenizer_sources`; default ``source_dir``).  Returns
    {"files", "bytes", "tokenizer_files"}."""
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
    for name, src in tokenizer_sources(tokenizer or source_dir).items():
        shutil.copyfile(src, os.path.join(out_dir, name))
        copied.append(name)
    return {"files": n_files, "bytes": total, "tokenizer_files": copied}


def tokenizer_sources(tokenizer: str | None) -> dict[str, str]:
    """{file name in a model directory: its source} of a tokenizer: a directory's
    TOKENIZER_FILES; a file named tokenizer.json with the files of TOKENIZER_FILES beside it (an
    HF tokenizer's folder); any other .json file alone, as tokenizer.json."""
    if not tokenizer:
        return {}
    if os.path.isfile(tokenizer) and os.path.basename(tokenizer) != "tokenizer.json":
        return {"tokenizer.json": tokenizer}
    folder = tokenizer if os.path.isdir(tokenizer) else os.path.dirname(tokenizer)
    return {n: os.path.join(folder, n) for n in TOKENIZER_FILES if os.path.isfile(os.path.join(folder, n))}


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def write_random_hf_dir(out_dir: str, config: dict, seed: int = 0, dtype: str = "bfloat16", device="cpu",
                        max_shard_bytes: int = 2 * 2 ** 30) -> dict:
    """A random-weight HF model directory for ``config`` (a config.json dict, e.g. one of
    :data:`CONFIGS`), written a file at a time, so at most ``max_shard_bytes`` of weights are in
    host memory.  Weights ~ N(0, 0.02), norms scaling by 1 (a weight of 0 where the family's norm
    scales by 1 + weight: Gemma), biases 0; generated on ``device`` (a GPU is much faster for 8B)."""
    args = args_from_hf_config(config, "the given config")
    shapes = hf_tensors(args).shapes
    dt = DTYPES[dtype]
    sizes = {k: math.prod(s) * dt.itemsize for k, s in shapes.items()}
    plan = shard_plan(sizes, max_shard_bytes)
    g = torch.Generator(device=device).manual_seed(seed)

    def groups():
        for names in plan:
            out = {}
            for k in names:
                if k.endswith("norm.weight"):
                    t = torch.full(shapes[k], 0.0 if args.norm_plus_one else 1.0, dtype=dt)
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
    # google/gemma-3-1b-pt's config.json (transformers 4.50's keys; tied embeddings by the class default):
    # a sliding window of 512 on five layers of every six, the sixth global
    "gemma-3-1b": {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 1152,
        "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_local_base_freq": 10000, "rope_scaling": None, "sliding_window": 512,
        "sliding_window_pattern": 6, "query_pre_attn_scalar": 256, "hidden_activation": "gelu_pytorch_tanh",
        "attn_logit_softcapping": None, "final_logit_softcapping": None, "attention_bias": False,
        "attention_dropout": 0.0, "bos_token_id": 2, "eos_token_id": [1, 106], "pad_token_id": 0,
        "initializer_range": 0.02, "cache_implementation": "hybrid", "use_cache": True},
    # Phi-3-mini-128k-instruct (the June 2024 revision): LongRoPE's 48 long / short factors (head dim 96)
    "phi-3-mini-128k": {
        "architectures": ["Phi3ForCausalLM"], "model_type": "phi3", "hidden_size": 3072, "intermediate_size": 8192,
        "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32064,
        "max_position_embeddings": 131072, "original_max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "rope_scaling": {"type": "longrope", "long_factor": [
            1.0700000524520874, 1.1200000047683716, 1.149999976158142, 1.4199999570846558, 1.5699999332427979,
            1.7999999523162842, 2.129999876022339, 2.129999876022339, 3.009999990463257, 5.910000324249268,
            6.950000286102295, 9.070000648498535, 9.930000305175781, 10.710000038146973, 11.130000114440918,
            14.609999656677246, 15.409998893737793, 19.809999465942383, 37.279998779296875, 38.279998779296875,
            38.599998474121094, 40.12000274658203, 46.20000457763672, 50.940006256103516, 53.66000747680664,
            54.9373893737793, 56.89738845825195, 57.28738784790039, 59.98738479614258, 60.86738586425781,
            60.887386322021484, 61.71739196777344, 62.91739273071289, 62.957393646240234, 63.41739273071289,
            63.8173942565918, 63.83739471435547, 63.897396087646484, 63.93739700317383, 64.06739807128906,
            64.11434936523438, 64.12435150146484, 64.15435028076172, 64.19435119628906, 64.24435424804688,
            64.57435607910156, 64.69000244140625, 64.76000213623047],
            "short_factor": [1.1, 1.1, 1.1, 1.3000000000000003, 1.3500000000000003, 1.3500000000000003,
                             1.4000000000000004, 1.5500000000000005] + [2.000000000000001] * 17
            + [2.0500000000000007] * 6 + [2.1000000000000005] * 2 + [2.1500000000000004] + [2.25] * 5
            + [2.3999999999999995, 2.4499999999999993, 2.499999999999999, 2.6999999999999984, 2.6999999999999984,
               2.7499999999999982, 2.799999999999998, 2.8999999999999977, 3.049999999999997]},
        "sliding_window": 262144, "tie_word_embeddings": False, "hidden_act": "silu", "attention_bias": False,
        "attention_dropout": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "bos_token_id": 1, "eos_token_id": 32000,
        "pad_token_id": 32000, "initializer_range": 0.02, "use_cache": True},
}
