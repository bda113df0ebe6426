"""Sparse BurstAttention benchmark (sliding windows, packed documents) vs the causal baselines.

    torchrun --nproc_per_node 4 benchmarks/sparse_bench.py              # GPUs, the issue's cases
    torchrun --nproc_per_node 2 benchmarks/sparse_bench.py --device cpu --seq 2048 --doc-seq 1024 \\
        --windows 64,256 --doc-lengths 16,256 --heads 2 --head-dim 16 --iters 2 --warmup 1

See burstengine/bench/sparse.py (``--help``) for what is measured and recorded.
"""
import sys

from burstengine.bench.sparse import main

if __name__ == "__main__":
    sys.exit(main())
