"""First-token latency of LLaMA 7B/13B prefill: BurstAttention beside Megatron-style tensor
parallelism and torch-native context parallelism, in one launch (BurstAttention Tables 2-3).

    torchrun --nproc_per_node 4 benchmarks/prefill_bench.py --models 7b,13b \\
        --seqs 32768,65536,131072,262144,524288,1048576
    python benchmarks/prefill_bench.py --world 2 --models tiny --seqs 256,512    # CPU/gloo check

The options and what is measured: burstengine/bench/prefill.py (``--help``).
"""
import sys

from burstengine.bench.prefill import main

if __name__ == "__main__":
    sys.exit(main())
