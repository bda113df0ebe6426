"""Worker functions and models for tests/inference/test_generate.py (run inside the gloo pool).

Tiny random models of four architectures, made with transformers and saved with
save_pretrained, as a user's checkpoint would be: LlamaForCausalLM, Qwen2ForCausalLM (q/k/v
biases), MistralForCausalLM (a sliding window short enough that the prompts cross it) and
Gemma3ForCausalLM (that window on two layers of three, a RoPE base per layer type, untied) and
Phi3ForCausalLM (fused tensors, LongRoPE with an original context the prompts are longer than).
"""
import functools

import torch

from hf_cases import gemma3_overrides

VOCAB = 192
WINDOW = 40  # Mistral's sliding window here: prompts of ~1000 tokens cross it many times
ORIGINAL = 512  # Phi-3's original context here: prompts of ~1000 tokens use LongRoPE's long factors


def longrope(head_dim=16):
    """LongRoPE's factors for ``head_dim``: short ones near 1, long ones far apart."""
    return {"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(head_dim // 2)],
            "long_factor": [1.5 ** i for i in range(head_dim // 2)]}


def tiny_config(arch: str, **overrides):
    from transformers import Gemma3TextConfig, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=8192, rope_theta=10000.0, tie_word_embeddings=False)
    if arch == "mistral":
        kw["sliding_window"] = WINDOW
    if arch == "gemma3":
        kw.update(gemma3_overrides(WINDOW))
    if arch == "phi3":  # Phi3Config's token ids default to Phi-3's 32k vocabulary; no stop token
        kw.update(rope_scaling=longrope(), original_max_position_embeddings=ORIGINAL, bos_token_id=1, eos_token_id=None,
                  pad_token_id=None)
    kw.update(overrides)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig, "gemma3": Gemma3TextConfig,
            "phi3": Phi3Config}[arch](**kw)


def save_tiny(path, arch: str, seed: int = 0, **overrides) -> str:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(arch, **overrides))
    with torch.no_grad():  # random norms and biases, so that a loader that drops them is seen
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)  # Gemma's scale 1 + w: 1.5 to 2.5
            elif name.endswith("bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("embed_tokens.weight") or name.endswith("lm_head.weight"):
                p.normal_(0.0, 1.0)  # logits far apart: greedy choices are not near-ties
    model.save_pretrained(path)
    return str(path)


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in lengths]


@functools.lru_cache(maxsize=4)
def _model(path):
    from burstengine.inference import load_model

    return load_model(path)


def run_generate(group, path, lengths, max_new, seed=0, layout="zigzag", **sampling):
    """Our tokens (and every rank's cache lengths per step) for prompts of ``lengths``."""
    from burstengine.inference import Sampling, generate

    out = generate(_model(path), prompts(lengths, seed), max_new, Sampling(**sampling), group=group, layout=layout)
    return out.tokens, out.shard_lengths


def run_generate_stream(group, path, lengths, max_new, eos):
    """Greedy tokens with stop tokens, and what generation reported on the way: the on_tokens
    calls, the shard lengths per step, the number of timed steps and the on_logits calls (step,
    the logits' greedy tokens; rank 0's, [] elsewhere)."""
    from burstengine.inference import Sampling, generate

    calls, seen = [], []
    out = generate(_model(path), prompts(lengths), max_new, Sampling(eos=eos), group=group,
                   on_tokens=lambda i, tok, done: calls.append((i, tok, done)),
                   on_logits=lambda i, x: seen.append((i, x.argmax(-1).tolist())))
    return out.tokens, out.shard_lengths, calls, len(out.timings["decode_step_s"]), seen


def run_generate_logits(group, path, lengths, max_new, seed=0, prefill=False, **kw):
    """Our greedy tokens and, on rank 0, every decode step's (B, steps, vocab) logits (None
    elsewhere); with ``prefill``, the prefill's first.  ``kw``: generate's options (kv_dtype)."""
    from burstengine.inference import generate

    seen = []
    out = generate(_model(path), prompts(lengths, seed), max_new, group=group,
                   on_logits=lambda i, x: seen.append(x.detach().clone()) if i or prefill else None, **kw)
    return out.tokens, (torch.stack(seen, 1) if seen else None)


def run_generate_flaky_capture(group, path, lengths, max_new, fail_on: int, failures: int, graphs="auto"):
    """Our tokens when the step's CUDA graph capture fails on rank ``fail_on`` the first
    ``failures`` times (as one did on GPUs: an error on one rank only; a second try's cause may
    differ: it may be the first's consequence), the captures each rank tried, whether it decoded
    from the graph, whether each launch replayed one, and the warnings it gave.  A capture that
    works records a stand-in graph whose replay runs the step op by op (CPU has no graphs); a
    capture while one is held refuses, as DecodeStep.capture does."""
    import types
    import warnings

    import torch.distributed as dist

    from burstengine.inference import step as st

    gen = __import__("importlib").import_module("burstengine.inference.generate")  # the package exports the function
    rank = dist.get_rank(group) if group is not None else 0
    tried, replayed = [], []
    saved = (gen.use_graphs, st.DecodeStep.capture, st.DecodeStep.launch)
    causes = ("AcceleratorError: operation failed due to a previous error during capture",
              "AcceleratorError: an illegal memory access was encountered")

    def capture(self, warmup=2, strict=False):
        tried.append(strict)
        if self.graph is not None:
            raise RuntimeError("the decode step is already captured")
        if rank == fail_on and len(tried) <= failures:
            raise RuntimeError(f"capturing the decode step in a CUDA graph failed on rank {rank}: "
                               f"{causes[len(tried) > 1]}")
        self.graph = types.SimpleNamespace(replay=None)

    def launch(self):
        replayed.append(self.graph is not None)
        return self.forward()

    gen.use_graphs = lambda mode, device: True  # as on a GPU
    st.DecodeStep.capture, st.DecodeStep.launch = capture, launch
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = gen.generate(_model(path), prompts(lengths, 0), max_new, group=group, graphs=graphs)
        return out.tokens, tried, out.timings["graphs"], replayed, [str(w.message) for w in caught
                                                                    if "captur" in str(w.message)]
    except RuntimeError as e:
        return None, tried, None, replayed, [str(e)]
    finally:
        gen.use_graphs, (st.DecodeStep.capture, st.DecodeStep.launch) = saved[0], saved[1:]


class FakeCuda:
    """The CUDA calls of DecodeStep.capture, on CPU, as torch's source makes them: the real
    torch.cuda.graph (whose exit restores the stream only once capture_end returned) around a
    CUDAGraph whose capture_end raises the first ``fail`` times as an invalidated capture's does:
    under torch 2.11 before it stops the caching allocator serving allocations from the graph's
    pool (``routing_left``), from 2.12 after (pytorch#180395).  ``current``: the current stream
    (``caller``: the one before the capture);
    ``routing``: the pools allocations go to; ``released``: the pools released; ``graphs``: weak
    references to the graphs made; ``logits``: to what each forward returned."""

    def __init__(self, monkeypatch, routing_left: bool, fail: int = 1):
        import weakref

        from burstengine.inference import step as st

        self.routing, self.released, self.graphs, self.logits = set(), [], [], []
        fake, handles = self, iter(range(1, 1000))

        class Stream:
            def __init__(self, device=None):
                pass

            def wait_stream(self, other):
                pass

        class StreamContext:  # torch.cuda.stream: current inside, the one before restored at exit
            def __init__(self, stream):
                self.stream = stream

            def __enter__(self):
                self.before, fake.current = fake.current, self.stream

            def __exit__(self, *exc):
                fake.current = self.before

        class Graph:
            def __init__(self):
                fake.graphs.append(weakref.ref(self))

            def capture_begin(self, pool=None, capture_error_mode="global", **kw):
                # a second routing would be served by the first's filter too
                assert not fake.routing, "the allocator still routes to a failed capture's pool"
                self.pool = pool
                fake.routing.add(pool)

            def capture_end(self):
                if fake.fail and not routing_left:
                    fake.routing.discard(self.pool)
                if fake.fail:
                    fake.fail -= 1
                    raise RuntimeError("CUDA error: operation failed due to a previous error during capture\n"
                                       "Search for `cudaErrorStreamCaptureInvalidated' in the CUDA docs")
                fake.routing.discard(self.pool)

        def end_routing(device, pool):
            if pool not in fake.routing:
                raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
            fake.routing.discard(pool)

        self.caller = self.current = Stream()  # the stream current when the step is captured
        forward = st.DecodeStep.forward

        def watched(step):
            out = forward(step)
            fake.logits.append(weakref.ref(out))
            return out

        self.fail = fail
        for name, value in (("current_stream", lambda device=None: fake.current), ("Stream", Stream),
                            ("stream", StreamContext), ("set_stream", lambda s: setattr(fake, "current", s)),
                            ("CUDAGraph", Graph), ("graph_pool_handle", lambda: (0, next(handles))),
                            ("current_device", lambda: 0), ("synchronize", lambda device=None: None),
                            ("empty_cache", lambda: None)):
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(torch._C, "_host_emptyCache", lambda: None, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_routing, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda device, pool: fake.released.append(pool),
                            raising=False)
        monkeypatch.setattr(torch.cuda.graphs.graph, "default_capture_stream", None)
        monkeypatch.setattr(st.DecodeStep, "forward", watched)
        monkeypatch.setattr(st, "_ABANDONED", [])


def raises(group, path, fn_name, *args, **kwargs):
    """The message of the ValueError generate raises (on this rank), None if it did not."""
    from burstengine.inference import Sampling, generate

    model = _model(path) if path else None
    try:
        if fn_name == "generate":
            prompts_, max_new, s = args
            generate(model, prompts_, max_new, Sampling(**s), group=group, **kwargs)
    except ValueError as e:
        return str(e)
    return None


def run_cli(group, argv):
    from burstengine import cli

    return cli.main(argv)


def run_prefill(group, path, length, layout):
    """prefill() of one prompt of ``length`` tokens: logits, this rank's kept positions and K/V rows."""
    from burstengine.inference import prefill

    out = prefill(_model(path), torch.tensor(prompts((length,), 3)), group=group, layout=layout, keep_kv=True)
    return out.logits, out.positions.tolist(), [k.shape[1] for k, _ in out.kv]


def save_tokenizer(path, vocab=VOCAB):
    """A small BPE tokenizer (Metaspace, so text round-trips) trained on the needle's sentences and
    digits, saved beside a model: a model directory as users have them, tokenizer included."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from burstengine.inference.needle import FILLER, NEEDLE, QUESTION

    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace()
    t.decoder = decoders.Metaspace()
    text = [FILLER * 3, NEEDLE.format(key=12345), QUESTION, " ".join(str(i) for i in range(100)),
            "Hello world, once upon a time there was a model."]
    t.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=t, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(path)
    return str(path)
