"""Our Triton attention kernels (LAO: the online-softmax merge and the gradient sums fused into
the kernel): ``kernel.TritonKernel`` behind the Kernel interface; fwd.py, bwd.py and tiles.py
import triton and are imported only when a kernel runs.  decode.py: flash-decoding (one query
token per sequence against a KV cache read in place, split over the sequence), which
``inference.kvcache.shard_attention`` runs on CUDA; it too imports triton, when it runs."""
