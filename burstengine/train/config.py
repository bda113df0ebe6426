"""The one configuration of a training job: a dataclass, presets, TOML files, ``--set`` overrides.

A job starts from a preset (``tiny``, ``llama-7b``, ``llama-8b``, ``llama-14b``) or a TOML file,
which may name a preset as its ``base`` and override any field; model shapes live in the
``[model]`` table::

    base = "tiny"
    steps = 400
    [model]
    n_layers = 2

then ``--set key=value`` (``--set model.dim=256``) overrides one field at a time.  Every value is
checked against the field's type and range, and an unknown key names the closest known one.
"""
from __future__ import annotations

import copy
import dataclasses
import difflib
import importlib.util
import inspect
import json
import math
import os
import typing
import warnings
from dataclasses import dataclass, field

from ..layout import LAYOUTS
from ..loss.model_loss import LOSSES
from ..model.lora import LoraArgs, dropout_conflict
from ..model.tiled import MODES as TILED_MODES
from ..model import PRESETS as MODEL_PRESETS
from ..model import ModelArgs, Transformer
from ..model.families import ARCHS
from ..model.hf_dir import args_from_hf_dir
from ..model.recompute import POLICIES
from .corpus import FORMATS, list_files

SCHEDULES = ("cosine", "linear", "constant")
PRECISIONS = ("auto", "fp32", "bf16")
ATTN_BACKWARDS = ("auto", "burst", "ring")
ATTENTIONS = ("burst", "torch-cp", "sdpa")
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass
class TrainConfig:
    """Every knob of ``burstengine train``.  Sizes are global unless they say otherwise.

    The comments below are the help text: ``burstengine train --help`` and ``--print-config``
    show them (a comment at the class's indentation starts a group; one after a field, on its
    line or the lines below it, explains the field)."""

    name: str = "run"                # run name; out_dir may use it as {name}
    model: ModelArgs = field(default_factory=lambda: copy.deepcopy(MODEL_PRESETS["tiny"]))
    # parallelism: world = dp_shard x cp; FSDP shards parameters over all of it
    cp: int = 0                      # context-parallel ranks per sequence; 0 = all ranks
    layout: str = "zigzag"           # how a sequence is split over the cp ranks (zigzag, striped, contiguous)
    attention: str = "burst"         # burst (BurstAttention), torch-cp (torch's context_parallel, CUDA only),
                                     # sdpa (no CP)
    attn_backward: str = "auto"      # BurstAttention backward: burst / ring / auto
    kernel: str = "auto"             # local attention kernel (see burstengine.kernels)
    # memory: activation checkpointing (recompute in backward; saving checkpoints is save_every)
    activation_checkpoint: str = "none"  # policy: none, full, selective, sequence, pointwise (keep the matmuls'
                                     # outputs, recompute the norms and SwiGLU's gate), offload (pointwise,
                                     # kept in host memory), full-offload (full, its input kept in host
                                     # memory), or auto (per layer from activation_memory_gib and
                                     # offload_memory_gib; see burstengine.model.recompute); was "checkpoint"
    activation_checkpoint_split: float = 0.5  # activation_checkpoint="sequence": share of each rank's tokens
                                     # whose attention output is kept (0 = recompute all, 1 = keep all)
    activation_memory_gib: float = 0.0  # activation_checkpoint="auto": GiB of activations the layers may keep,
                                     # planned per layer; 0 = what the device has left after the parameters,
                                     # gradients and optimizer states
    activation_offload: bool = True  # activation_checkpoint="auto" may keep layers' activations in pinned
                                     # host memory between forward and backward (the "offload" policy)
                                     # before recomputing their projections (faster in the one-GPU 3B and
                                     # two-GPU 7B runs: docs/training.md); false keeps host memory unpinned.
                                     # The inputs of layers that recompute everything go to the host
                                     # (full-offload) whatever it says, when the device cannot hold them all
    offload_memory_gib: float = 0.0  # GiB of host memory per rank the host layers may keep; 0 = half the host's
                                     # memory shared by its GPUs (the smallest over the ranks)
    tiled_mlp: str = "auto"          # the MLP run tiled_mlp_chunk tokens at a time in forward and backward, so its
                                     # ffn-wide intermediates exist for one chunk (one more MLP forward per layer):
                                     # on, off, or auto (with activation_checkpoint="auto": on where the plan with it
                                     # recomputes less attention or projections than the plan without; else off)
    tiled_mlp_chunk: int = 8192      # tokens per chunk of the tiled MLP
    cpu_offload: bool = False        # FSDP2's CPU offload: parameters, gradients and AdamW states live in host
                                     # memory and the optimizer steps there; each layer's parameters are copied
                                     # to the device for its forward and backward (a model whose states do not
                                     # fit the device trains on it)
    grads_on_compute: bool = True    # FSDP2's sharded gradients from the compute stream's memory (CUDA, not under
                                     # cpu_offload), not its reduce-scatter stream's: one pool, no allocator retries
                                     # between them (docs/training.md)
    fused_ops: bool = True           # RMSNorm, RoPE and SwiGLU as one compiled kernel each on GPUs
    loss: str = "naive"              # hidden states -> loss: naive, chunked, fused (see burstengine.loss.model_loss)
    precision: str = "auto"          # auto: bf16 params / fp32 reduce on CUDA, fp32 on CPU; or fp32, bf16
    # data
    data: str = "passkey"            # "passkey" (synthetic), a .bin token file, or text: .jsonl / .parquet /
                                     # .txt files or a directory of them (see burstengine.train.corpus)
    tokenizer: str = ""              # tokenizer.json (or its directory) for text data; default: init's
    token_dtype: str = "uint16"      # element type of a .bin token file
    seq_len: int = 1024              # tokens per sequence (global, split over cp ranks)
    batch_size: int = 1              # sequences per step per data-parallel rank
    passkey_len: int = 4             # tokens in the passkey
    passkey_symbols: int = 16        # distinct passkey tokens (chance = 1 / this per token)
    # optimisation (AdamW)
    steps: int = 100                 # optimizer steps of the whole run
    lr: float = 3e-4                 # peak learning rate, in [0, 1] (0: steps that change nothing)
    min_lr_ratio: float = 0.1        # final lr = lr x this (cosine / linear)
    warmup_steps: int = 10           # linear warm-up from 0 to lr
    schedule: str = "cosine"         # lr after warm-up: cosine, linear, constant
    weight_decay: float = 0.1        # AdamW's decoupled weight decay
    beta1: float = 0.9               # AdamW's first-moment decay
    beta2: float = 0.95              # AdamW's second-moment decay
    grad_clip: float = 1.0           # max global grad norm; 0 = no clipping
    seed: int = 0                    # weights, data order and passkeys
    # output, saved checkpoints, metrics
    out_dir: str = "runs/{name}"     # metrics.jsonl and checkpoints/ go here
    save_every: int = 0              # save a checkpoint every K steps (and at the end); 0 = never; was "ckpt_every"
    save_keep: int = 2               # saved checkpoints kept on disk; was "ckpt_keep"
    log_every: int = 1               # a metrics line every K steps
    eval_every: int = 0              # passkey accuracy every K steps (and at the end); 0 = end only
    eval_samples: int = 64           # held-out sequences per evaluation
    peak_tflops: float = 0.0         # per-device peak for MFU; 0 = known GPUs' bf16 dense peak
    progress: bool = True            # progress bar (only ever on an interactive terminal)
    # starting from a pretrained model (see burstengine/model/hf_dir.py)
    init: str = ""                   # an HF model directory (config.json + safetensors); "" = random init.  Its
                                     # config.json gives the model's shape (a preset's [model] table is ignored);
                                     # model.rope_theta, model.rope_scaling.* and model.window may still be set
    lora: LoraArgs = field(default_factory=LoraArgs)  # LoRA adapters ([lora] table; see burstengine/model/lora.py)

    # text corpora, packed documents, accumulation, metrics sinks
    data_format: str = "text"        # text data: "text" (every token a target) or "instruct" (prompt +
                                     # completion rows, loss on the completion and its EOS only)
    text_field: str = "text"         # jsonl key / parquet column of a text document
    prompt_field: str = "prompt"     # instruct rows: the prompt ...
    completion_field: str = "completion"  # ... and the completion
    data_cache: str = ""             # where tokenized corpora are cached; "" = <out_dir's parent>/token_cache
    eos_id: int = -1                 # EOS ending each document; -1 = from the tokenizer's config files
    doc_mask: bool = False           # attention never crosses packed documents; positions restart per document
    grad_accum: int = 1              # micro-batches (of batch_size sequences per dp rank) per optimizer step
    tensorboard: bool = False        # also log to TensorBoard (<run_dir>/tensorboard; the tensorboard extra)
    wandb: bool = False              # also log to Weights & Biases (the wandb extra)
    wandb_project: str = "burstengine"  # the W&B project
    wandb_name: str = ""             # the W&B run's name; "" = name
    wandb_mode: str = ""             # "online" / "offline" (no network) / "disabled"; "" = wandb's default
    # faults
    fault_timeout: float = 0.0       # seconds after which a rank that died, froze or stopped answering counts
                                     # as lost (process-group timeout, ring deadlines, watchdog);
                                     # 0 = $BURST_TIMEOUT, else 600

    @property
    def run_dir(self) -> str:
        return self.out_dir.format(name=self.name)

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        self.model.validate()
        for name in ("norm_eps", "rope_theta"):
            v = getattr(self.model, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"model.{name} must be a finite number > 0, got {v}")
        _choice("layout", self.layout, LAYOUTS)
        _choice("attention", self.attention, ATTENTIONS)
        _choice("attn_backward", self.attn_backward, ATTN_BACKWARDS)
        _choice("activation_checkpoint", self.activation_checkpoint, (*POLICIES, "auto"))
        if not (0.0 <= self.activation_memory_gib < float("inf")):
            raise ValueError(f"activation_memory_gib must be a finite number >= 0 (0 = from the device's memory), "
                             f"got {self.activation_memory_gib}")
        if not (0.0 <= self.offload_memory_gib < float("inf")):
            raise ValueError(f"offload_memory_gib must be a finite number >= 0 (0 = from the host's memory), "
                             f"got {self.offload_memory_gib}")
        _choice("loss", self.loss, tuple(LOSSES))
        _choice("tiled_mlp", self.tiled_mlp, TILED_MODES)
        if self.tiled_mlp_chunk < 1:
            raise ValueError(f"tiled_mlp_chunk must be >= 1, got {self.tiled_mlp_chunk}")
        self.lora.validate(self.model.arch)
        why = dropout_conflict(self.lora, self.activation_checkpoint)
        if why:
            raise ValueError(why)
        if not 0.0 <= self.activation_checkpoint_split <= 1.0:
            raise ValueError(f"activation_checkpoint_split must be in [0, 1] (0 = recompute all attention, 1 = keep "
                             f"all attention outputs), got {self.activation_checkpoint_split}")
        if self.activation_checkpoint == "sequence" and self.attention == "torch-cp":
            raise ValueError("activation_checkpoint='sequence' recomputes part of BurstAttention's ring; with "
                             "attention='torch-cp' use activation_checkpoint='full' or 'selective'")
        _choice("precision", self.precision, PRECISIONS)
        _choice("schedule", self.schedule, SCHEDULES)
        _choice("token_dtype", self.token_dtype, TOKEN_DTYPES)
        for name in ("seq_len", "batch_size", "steps", "log_every", "eval_samples", "passkey_len", "passkey_symbols",
                     "save_keep", "grad_accum"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in ("cp", "warmup_steps", "save_every", "eval_every", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        # floats: NaN passes no comparison, so each test is written to fail on it
        if not (0 <= self.lr <= 1):  # 0: a step that changes nothing (tests that init -> export round-trips)
            raise ValueError(f"lr must be in [0, 1], got {self.lr}")
        if self.model.window and self.attention == "torch-cp":
            raise ValueError(f"model.window={self.model.window} (a sliding window) needs attention='burst': torch's "
                             f"context_parallel attends over the whole causal prefix")
        if self.model.window and self.activation_checkpoint == "sequence":
            raise ValueError(f"activation_checkpoint='sequence' does not support a sliding window (model.window="
                             f"{self.model.window}) yet; use 'full', 'selective' or 'auto'")
        if self.model.rope_scaling.follows_length and self.attention == "torch-cp":
            raise ValueError(f"{self.model.rope_scaling.type} rope scaling needs the global sequence length, which "
                             f"torch's context_parallel hides from the model: use attention='burst'")
        for name in ("min_lr_ratio", "beta1", "beta2"):
            if not 0 <= getattr(self, name) <= 1:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        for name in ("weight_decay", "grad_clip", "peak_tflops", "fault_timeout"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {v}")
        if self.data == "passkey":
            need = 4 + self.passkey_symbols + 2
            if self.model.vocab_size < need:
                raise ValueError(f"the passkey task needs model.vocab_size >= {need} "
                                 f"(4 special + {self.passkey_symbols} passkey symbols + filler), "
                                 f"got {self.model.vocab_size}")
            if self.passkey_len > self.passkey_symbols:
                raise ValueError(f"passkey_len ({self.passkey_len}) must be <= passkey_symbols "
                                 f"({self.passkey_symbols}): passkey tokens are distinct")
            if self.seq_len < 2 * self.passkey_len + 8:
                raise ValueError(f"seq_len {self.seq_len} is too short for a passkey of {self.passkey_len} tokens")
        else:
            if not os.path.exists(self.data):
                raise ValueError(f"data {self.data!r}: no such file or directory (or use data = \"passkey\")")
            if self.tokenizer and not os.path.exists(self.tokenizer):
                raise ValueError(f"tokenizer {self.tokenizer!r}: no such file or directory")
            if not self.data.endswith(".bin"):
                self._validate_corpus()
        if self.eos_id < -1:
            raise ValueError(f"eos_id must be >= 0, or -1 for the tokenizer's own, got {self.eos_id}")
        if self.doc_mask:
            if self.attention == "torch-cp":
                raise ValueError("doc_mask=true needs attention='burst' or 'sdpa' (torch's context_parallel has no "
                                 "document mask)")
            if "cu_seqlens" not in inspect.signature(Transformer.forward).parameters:
                raise ValueError("doc_mask=true needs a model that takes document boundaries (cu_seqlens); this "
                                 "build's Transformer does not")
        self._validate_sinks()
        try:
            self.run_dir
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(f"out_dir {self.out_dir!r}: only {{name}} may be substituted ({e})") from None

    def _validate_corpus(self) -> None:

        _choice("data_format", self.data_format, FORMATS)
        for name in ("text_field", "prompt_field", "completion_field"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        files = list_files(self.data)
        if not (self.tokenizer or getattr(self, "init", "")):
            raise ValueError(f"text data {self.data!r} needs a tokenizer: set tokenizer=PATH/tokenizer.json or "
                             f"init=HF_MODEL_DIR")
        if any(f.endswith(".parquet") for f in files):
            _need("pyarrow", "data", f"parquet data ({self.data})")

    def _validate_sinks(self) -> None:
        if self.tensorboard:
            _need("tensorboard", "tensorboard", "tensorboard=true")
        if self.wandb:
            _need("wandb", "wandb", "wandb=true")
            if self.wandb_mode not in ("", "online", "offline", "disabled"):
                raise ValueError(f"wandb_mode must be one of ['', 'online', 'offline', 'disabled'], got "
                                 f"{self.wandb_mode!r}")

    def check_world(self, world: int) -> tuple[int, int]:
        """(dp, cp) for ``world`` ranks; ValueError if the sizes do not fit."""
        cp = self.cp or world
        if world % cp:
            raise ValueError(f"cp={cp} does not divide the world size {world}")
        unit = 2 * cp if self.layout == "zigzag" else cp
        if self.seq_len % unit:
            raise ValueError(f"seq_len {self.seq_len} is not divisible by {unit} "
                             f"({'2 x ' if self.layout == 'zigzag' else ''}cp={cp}) as layout {self.layout!r} requires")
        return world // cp, cp

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _need(module: str, extra: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{what} needs the {module} package: pip install 'burstengine[{extra}]'")


def _choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{name} must be one of {list(choices)}, got {value!r}")


def _train(model: str, **kw) -> TrainConfig:
    return TrainConfig(name=model, model=copy.deepcopy(MODEL_PRESETS[model]), **kw)


# tiny: the CPU default (2 gloo ranks, CP=2) on the passkey task; the others: GPU nodes, CP over
# all ranks, bf16, activation checkpointing planned per layer from the device's memory (at 100K+
# tokens per GPU even the block inputs of 32 layers take tens of GB), the fused LM head + loss
PRESETS: dict[str, TrainConfig] = {
    "tiny": _train("tiny", cp=2, seq_len=256, batch_size=16, steps=400, lr=3e-3, warmup_steps=20, weight_decay=0.0,
                   passkey_len=1, passkey_symbols=32, eval_every=50, eval_samples=128, save_every=100),
    "llama-3b": _train("llama-3b", seq_len=131072, steps=20, lr=3e-4, activation_checkpoint="auto", loss="fused",
                       log_every=1),
    "llama-7b": _train("llama-7b", seq_len=131072, steps=20, lr=3e-4, activation_checkpoint="auto", loss="fused",
                       log_every=1),
    "llama-8b": _train("llama-8b", seq_len=131072, steps=20, lr=3e-4, activation_checkpoint="auto", loss="fused",
                       log_every=1),
    "llama-14b": _train("llama-14b", seq_len=131072, steps=20, lr=3e-4, activation_checkpoint="auto", loss="fused",
                        log_every=1),
}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)} or a .toml file")
    return copy.deepcopy(PRESETS[name])


# --- setting fields from strings and TOML values -------------------------------------------------

def _fields(cls) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# old names still read for one release (they were easy to confuse: "checkpoint" meant activation
# checkpointing, "ckpt_every" saving checkpoints)
DEPRECATED = {"checkpoint": "activation_checkpoint", "checkpoint_split": "activation_checkpoint_split",
              "ckpt_every": "save_every", "ckpt_keep": "save_keep"}


def _current_name(key: str) -> str:
    if key in DEPRECATED:
        warnings.warn(f"config key {key!r} is deprecated and will be removed in the next release: use "
                      f"{DEPRECATED[key]!r}", FutureWarning, stacklevel=4)
        return DEPRECATED[key]
    return key


def _lookup(cfg: TrainConfig, key: str):
    """(object, field name, field type) for 'name' or 'model.name' (deprecated names map to
    their new ones, with a FutureWarning)."""
    key = _current_name(key)
    parts = key.split(".")
    obj, cls = cfg, TrainConfig
    for i, part in enumerate(parts):
        known = _fields(cls)
        if part not in known:
            prefix = ".".join(parts[:i])
            names = [f"{prefix}.{n}" if prefix else n for n in known]
            nested = [f"{t}.{n}" for t, c in (("model", ModelArgs), ("lora", LoraArgs)) for n in _fields(c)]
            close = difflib.get_close_matches(key, names + (nested if not prefix else []), n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ValueError(f"unknown config key {key!r}{hint}")
        typ = known[part]
        if i == len(parts) - 1:
            if dataclasses.is_dataclass(typ):
                raise ValueError(f"config key {key!r} is a table; set its fields as {key}.<field>")
            return obj, part, typ
        if not dataclasses.is_dataclass(typ):
            raise ValueError(f"config key {'.'.join(parts[:i + 1])!r} is a {typ.__name__}, not a table")
        obj, cls = getattr(obj, part), typ
    raise AssertionError


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _parse(key: str, text: str, typ):
    if typing.get_origin(typ) is list:  # numbers separated by commas (longrope's factors)
        try:
            return [float(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"config key {key!r} expects numbers separated by commas, got {text!r}") from None
    try:
        if typ is bool:
            if text.lower() in _TRUE:
                return True
            if text.lower() in _FALSE:
                return False
            raise ValueError
        if typ is int:
            return int(text)
        if typ is float:
            return float(text)
        if typ is str:
            return text
    except ValueError:
        pass
    else:
        raise ValueError(f"config key {key!r} has unsupported type {typ}")
    raise ValueError(f"config key {key!r} expects {typ.__name__}, got {text!r}")


def _coerce(key: str, value, typ):
    """A TOML value for a field of type ``typ`` (ints are fine for floats, nothing else converts)."""
    if typing.get_origin(typ) is list:  # an array of numbers (longrope's factors)
        if not (isinstance(value, list) and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in value)):
            raise ValueError(f"config key {key!r} expects an array of numbers, got {type(value).__name__} {value!r}")
        return [float(x) for x in value]
    ok = (isinstance(value, bool) if typ is bool else
          isinstance(value, int) and not isinstance(value, bool) if typ is int else
          isinstance(value, (int, float)) and not isinstance(value, bool) if typ is float else
          isinstance(value, str) if typ is str else False)
    if not ok:
        raise ValueError(f"config key {key!r} expects {typ.__name__}, got {type(value).__name__} {value!r}")
    return float(value) if typ is float else value


def set_value(cfg: TrainConfig, assignment: str) -> None:
    """Apply one ``key=value`` override (value parsed by the field's type)."""
    if "=" not in assignment:
        raise ValueError(f"--set expects key=value, got {assignment!r}")
    key, text = assignment.split("=", 1)
    key = key.strip()
    obj, name, typ = _lookup(cfg, key)
    setattr(obj, name, _parse(key, text.strip(), typ))


def _apply_table(cfg: TrainConfig, table: dict, prefix: str = "", keys: set | None = None) -> None:
    for k, v in table.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            if key not in ("model", "model.rope_scaling", "lora"):
                raise ValueError(f"unknown config table {key!r} (only [model], [model.rope_scaling] and [lora] are "
                                 f"tables)")
            _apply_table(cfg, v, prefix=f"{key}.", keys=keys)
            continue
        obj, name, typ = _lookup(cfg, key)
        setattr(obj, name, _coerce(key, v, typ))
        if keys is not None:
            keys.add(key)


# model fields that may be set on top of an init model's config.json: how its context is extended
INIT_OVERRIDES = ("model.rope_theta", "model.rope_scaling.", "model.window")


def _from_init(cfg: TrainConfig, keys: set) -> None:
    """Replace cfg.model by the shape of cfg.init's config.json, keeping the rope / window
    fields the file or --set gave explicitly (any other explicit model field is an error)."""

    user = {}
    for key in sorted(k for k in keys if k.startswith("model.")):
        if not key.startswith(INIT_OVERRIDES):
            raise ValueError(f"{key} is set, but with init={cfg.init!r} the model's shape comes from its config.json; "
                             f"only model.rope_theta, model.rope_scaling.* and model.window may be changed")
        obj, name, _ = _lookup(cfg, key)
        user[key] = getattr(obj, name)
    cfg.model = args_from_hf_dir(cfg.init)  # the files checked too: a damaged directory is refused here
    for key, value in user.items():
        obj, name, _ = _lookup(cfg, key)
        setattr(obj, name, value)


def load(spec: str, overrides: list[str] = ()) -> TrainConfig:
    """The validated config for a preset name or TOML path, then ``key=value`` overrides; with
    ``init``, the model's shape from that directory's config.json."""
    keys: set[str] = set()  # the keys the file and the overrides set explicitly
    if spec.endswith(".toml") or os.sep in spec:
        import tomllib  # only when reading a TOML file

        if not os.path.exists(spec):
            raise ValueError(f"config file {spec!r} does not exist")
        try:
            with open(spec, "rb") as f:
                table = tomllib.load(f)
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {spec!r}: {e}") from None
        base = table.pop("base", "tiny")
        if not isinstance(base, str):
            raise ValueError(f"config file {spec!r}: base must be a preset name, got {base!r}")
        cfg = preset(base)
        try:
            _apply_table(cfg, table, keys=keys)
        except ValueError as e:
            raise ValueError(f"config file {spec!r}: {e}") from None
    else:
        cfg = preset(spec)
    for a in overrides:
        set_value(cfg, a)
        keys.add(a.split("=", 1)[0].strip())
    if cfg.init:
        _from_init(cfg, keys)
    cfg.validate()
    return cfg


# --- help and TOML output ------------------------------------------------------------------------

MODEL_HELP = {
    "dim": "model width (hidden size)",
    "n_layers": "decoder blocks",
    "n_heads": "query heads",
    "n_kv_heads": "key/value heads (GQA when fewer than n_heads)",
    "vocab_size": "tokens in the vocabulary",
    "ffn_dim": "hidden size of the gated MLP",
    "norm_eps": "RMSNorm epsilon",
    "rope_theta": "RoPE base",
    "tie_embeddings": "share the input embedding with the LM head",
    "arch": f"the HF family the weights are written back as: {', '.join(ARCHS)}",
    "head_size": "width of one head; 0 = dim / n_heads (Qwen3 sets it apart)",
    "qkv_bias": "biases on the q, k, v projections (Qwen2)",
    "qk_norm": "RMSNorm over each head of q and k before RoPE (Qwen3)",
    "window": "sliding window: each query sees the W most recent keys, itself included; 0 = none",
    "window_layers": "the layers the window applies to, a letter each: s sliding, f full (Gemma 3); empty = all",
    "local_rope_theta": "RoPE base of the sliding layers, unscaled (Gemma 3); 0 = the global RoPE everywhere",
    "norm_plus_one": "RMSNorms scale by 1 + weight (Gemma)",
    "sandwich_norm": "RMSNorms on the attention and MLP outputs before their residuals (Gemma)",
    "activation": "the MLP's gate: silu (SwiGLU) or gelu_tanh (GeGLU, Gemma)",
    "embed_scale": "embeddings times sqrt(dim), rounded to the weights' dtype (Gemma)",
    "query_pre_attn_scalar": "attention scores scaled by this ** -0.5 (Gemma); 0 = head_dim",
    "max_position_embeddings": "the context the weights were trained for (config.json); 0 = unknown",
    "rope_scaling": "context extension: type none/linear/dynamic/yarn/llama3, longrope (Phi-3) and its parameters "
                    "(model/rope.py; longrope's short_factor / long_factor: head dim / 2 numbers each)",
}


def _source_help(cls) -> list[tuple[str, list[tuple[str, str]]]]:
    """[(group title, [(field, help)])] of dataclass ``cls`` from the comments in its source (see
    TrainConfig's docstring)."""
    import inspect
    import re

    groups: list[tuple[str, list[tuple[str, str]]]] = [("general", [])]
    last = None
    header = False  # the previous line was a group comment (a second one continues it)
    src = inspect.getsource(cls).splitlines()
    start = next(i for i, line in enumerate(src) if line.startswith("class "))
    for line in src[start + 1:]:
        body = line.strip()
        indent = len(line) - len(line.lstrip())
        m = re.match(r"(\w+): [\w\[\]. |]+ = .*?(?:#\s*(.*))?$", body)
        if indent == 4 and body.startswith("#"):
            text = body.lstrip("# ")
            if header:
                groups[-1] = (groups[-1][0] + " " + text, groups[-1][1])
            else:
                groups.append((text, []))
            header, last = True, None
            continue
        header = False
        if indent == 4 and m and not body.startswith(("def ", "@")):
            last = [m.group(1), m.group(2) or ""]
            groups[-1][1].append(last)
        elif indent > 4 and body.startswith("#") and last is not None:
            last[1] = f"{last[1]} {body.lstrip('# ')}".strip()
        elif body.startswith(("def ", "@")):
            break
        else:
            last = None
    return groups


TABLES = ("model", "lora")  # TrainConfig's fields that are tables of their own


def field_help() -> list[tuple[str, list[tuple[str, str]]]]:
    """[(group title, [(field, help)])] of TrainConfig, from the comments in its source (see the
    class docstring), then the [model] and [lora] tables."""
    out = [(title, [(n, h) for n, h in fields if n not in TABLES]) for title, fields in _source_help(TrainConfig)]
    out.append(("[model] table (model.<field>)", [(n, MODEL_HELP.get(n, "")) for n in _fields(ModelArgs)]))
    out.append(("[lora] table (lora.<field>)", [f for _, fs in _source_help(LoraArgs) for f in fs]))
    return [(t, f) for t, f in out if f]


def _table(title: str) -> str | None:
    """The table a field_help group is (``model``, ``lora``), or None for top-level keys."""
    return title[1:title.index("]")] if title.startswith("[") else None


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if v != v else ("inf" if v > 0 else "-inf"))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"no TOML form for {type(v).__name__} {v!r}")


def to_toml(cfg: TrainConfig) -> str:
    """The whole config as a TOML file that ``load`` reads back to the same config: top-level
    keys first (grouped, each with its help as a comment), then the [model] and [lora] tables."""
    d = cfg.to_dict()
    lines = ["# burstengine train config (burstengine train --config THIS_FILE)"]
    for title, fields in field_help():
        table = _table(title)
        lines.append("")
        lines.append(f"[{table}]" if table else f"# {title}")
        src = d[table] if table else d
        nested = []  # dict-valued fields (model.rope_scaling) become tables of their own, after the keys
        for name, text in fields:
            if isinstance(src[name], dict):
                nested.append((f"{table}.{name}" if table else name, src[name], text))
                continue
            entry = f"{name} = {_toml_value(src[name])}"
            lines.append(f"{entry:<34} # {text}" if text else entry)
        for key, sub, text in nested:
            lines += ["", f"[{key}]" + (f"  # {text}" if text else "")]
            lines += [f"{k} = {_toml_value(v)}" for k, v in sub.items()]
    return "\n".join(lines) + "\n"


def help_epilog(defaults: TrainConfig | None = None) -> str:
    """Every config field with its default (the tiny preset's) and meaning, grouped: the tail of
    ``burstengine train --help``."""
    cfg = defaults or preset("tiny")
    d = cfg.to_dict()
    out = ["config fields (--set KEY=VALUE, or KEY = VALUE in a --config TOML file; defaults of the tiny preset):"]
    for title, fields in field_help():
        table = _table(title)
        out.append(f"\n  {title}:")
        for name, text in fields:
            key = f"{table}.{name}" if table else name
            value = (d[table] if table else d)[name]
            val = _toml_value(value) if not isinstance(value, dict) else \
                "{" + ", ".join(f"{k} = {_toml_value(v)}" for k, v in value.items()) + "}"  # an inline table
            out.append(f"    {key + ' = ' + val:<40} {text}")
    old = ", ".join(f"{o} -> {n}" for o, n in DEPRECATED.items())
    out.append(f"\n  renamed (the old names still work this release, with a warning): {old}")
    return "\n".join(out)
