"""Our Triton attention kernels (LAO: the online-softmax merge and the gradient sums fused into
the kernel): ``kernel.TritonKernel`` behind the Kernel interface; fwd.py, bwd.py and tiles.py
import triton and are imported only when a kernel runs."""
