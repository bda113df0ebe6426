"""Calibrate the multi-node cost model and check it against measured fwd+bwd runs (see
burstengine/bench/topo.py for what it does):

    torchrun --nproc_per_node 2 benchmarks/topo_bench.py                              # NVLink
    NCCL_P2P_DISABLE=1 torchrun --nproc_per_node 2 benchmarks/topo_bench.py --name topo_bench_2gpu_nop2p
    torchrun --nproc_per_node 4 benchmarks/topo_bench.py --topology 2x2 --seqs 131072,524288
    torchrun --nproc_per_node 4 benchmarks/topo_bench.py --device cpu --seqs 256 --heads 4 --head-dim 16
"""
import sys

from burstengine.bench.topo import main

if __name__ == "__main__":
    sys.exit(main())
