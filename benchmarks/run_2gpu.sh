#!/usr/bin/env bash
# The 2xH200 measurement session, in stages that each fit one device call (<10 min):
#
#   bash benchmarks/run_2gpu.sh A   # correctness smoke, attention vs peers (128K, 512K), overlap trace
#   bash benchmarks/run_2gpu.sh B   # NCCL off NVLink, cost-model calibration, D-vs-O error, longest
#   bash benchmarks/run_2gpu.sh C   # sparse masks, 7B training step, 7B prefill
#
# Records land in $BURST_RESULTS (default $OUT/results, else benchmarks/results); each step has a
# timeout so one stuck step cannot eat the session, and a failed step does not stop the others.
set -u
stage=${1:?stage A, B or C}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH=${PYTHONPATH:-$PWD}
out=${OUT:-$PWD/out}
export BURST_RESULTS=${BURST_RESULTS:-$out/results}
mkdir -p "$BURST_RESULTS"
TR="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
BE="$TR -m burstengine bench"
step() { local t=$1; shift; echo "=== [$(date +%T)] $*"; timeout --signal=TERM --kill-after=15 "$t" "$@"; echo "=== rc=$?"; }

case $stage in
A)
  nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv; nvidia-smi topo -m
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  step 150 $TR -m burstengine bench gpu-correctness --seq-local 2048 --heads 8
  step 200 $BE attention --seqs 131072 --mask both --kv-heads 32 --name attention_2gpu_128k \
      --methods burst-zigzag,burst-striped,ringbwd-zigzag,torch-cp-cudnn,torch-cp-flash,ulysses-cudnn,megatron-tp-cudnn,single-gpu-cudnn
  step 90 $BE attention --seqs 131072 --mask causal --kv-heads 8 --name attention_2gpu_128k_gqa8 \
      --methods burst-zigzag,ringbwd-zigzag,torch-cp-cudnn,ulysses-cudnn
  step 60 $BE attention --worlds 1 --seqs 131072 --mask causal --name attention_1gpu_128k --methods burst-zigzag,torch-cp-cudnn
  step 200 $BE attention --seqs 524288 --mask causal --name attention_2gpu_512k --methods burst-zigzag,torch-cp-cudnn \
      --profile 524288
  ;;
B)
  NCCL_P2P_DISABLE=1 step 120 $BE attention --seqs 32768,131072 --mask causal --kv-heads 32,8 --name attention_2gpu_nop2p \
      --methods burst-zigzag,ringbwd-zigzag,torch-cp-cudnn
  step 100 $BE topo --seqs 131072 --name topo_bench_2gpu
  NCCL_P2P_DISABLE=1 step 100 $BE topo --seqs 32768,131072 --name topo_bench_2gpu_nop2p
  step 60 python3 -m burstengine bench delta-error --seq 8192
  step 170 $TR -m burstengine bench longest --methods burst-zigzag,torch-cp-cudnn
  ;;
C)
  step 120 $BE sparse --device cuda --seq 262144 --windows 4096,32768 --doc-seq 262144 --check --check-seq 16384
  step 200 $BE train --model llama-7b --seqs 65536 --steps 3 --warmup 1
  step 150 $BE prefill --models 7b --seqs 32768,131072 --iters 3 --warmup 1
  ;;
esac
if [ -n "${OUT:-}" ]; then tar czf "$OUT/results_$stage.tgz" -C "$BURST_RESULTS" . && ls -la "$OUT"; fi
