#!/usr/bin/env bash
# The 2xH200 runs of issues 23-25, in stages that each fit one device call (< 10 min):
#
#   bash benchmarks/run_2gpu.sh attention   # 23: correctness matrix, attention beside torch-CP (NVLink and
#                                           #     NCCL off NVLink), the fault test over NCCL
#   bash benchmarks/run_2gpu.sh train       # 23: 3B and 7B training beside torch-CP at 128K total
#   bash benchmarks/run_2gpu.sh finetune    # 24: Llama-3.1-8B config: init on 2 ranks, train, export, compare
#   bash benchmarks/run_2gpu.sh generate    # 25: 8B prefill beside torch-CP and TP, decode with a sharded cache
#   bash benchmarks/run_2gpu.sh profile     # 35: the 7B step profiled at 128K and 256K
#
# Records land in $BURST_RESULTS (default $OUT/results, else ./burst-results) and come back as one
# tarball; every step has its own timeout so one stuck step cannot eat the call, and a failed step
# does not stop the others.  Set BURST_COMMIT to the commit that travelled.
set -u
stage=${1:?stage: attention, train, finetune or generate}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
export PYTHONPATH=${PYTHONPATH:-$PWD}
out=${OUT:-$PWD/out}
export BURST_RESULTS=${BURST_RESULTS:-$out/results}
mkdir -p "$BURST_RESULTS"
TR="python3 -m torch.distributed.run --standalone --nproc_per_node 2"
BE="$TR -m burstengine bench"
T0=$(date +%s)
step() { local t=$1; shift; echo "=== [+$(( $(date +%s) - T0 ))s] $*"; timeout --signal=TERM --kill-after=10 "$t" "$@"; echo "=== rc=$? [+$(( $(date +%s) - T0 ))s]"; }

case $stage in
attention)  # the first call of issue 23 (its 128K/512K rows ended at their timeouts: see peers below)
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader; nvidia-smi topo -m | head -4
  python3 -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'nccl', torch.cuda.nccl.version())"
  step 110 $BE gpu-correctness --seq-local 2048 --heads 8 --kernels auto,triton --name gpu_correctness_2gpu_auto_triton
  NCCL_P2P_DISABLE=1 step 80 $BE attention --seqs 32768,131072 --mask causal --name attention_2gpu_nop2p_r23 \
      --methods burst-zigzag,torch-cp-cudnn
  ;;
peers)  # attention beside torch-CP and one GPU, the fault test over NCCL, 7B training at 128K
  step 130 $BE attention --seqs 131072 --mask both --kv-heads 32,8 --name attention_2gpu_128k_r23 \
      --methods burst-zigzag,torch-cp-cudnn,single-gpu-cudnn
  step 140 $BE attention --seqs 524288 --mask causal --kv-heads 32 --warmup 1 --iters 2 --name attention_2gpu_512k_r23 \
      --methods burst-zigzag,torch-cp-cudnn,single-gpu-cudnn
  FAULT_DEBUG=1 step 60 python3 -m burstengine bench faults --device cuda --world 2 --faults ring_step --no-fuzz \
      --deadline 10 --limit 40 --out-dir "$BURST_RESULTS" --name faults_2gpu_nccl
  step 240 $BE train --model llama-7b --methods burst,torch-cp --seqs 131072 --steps 2 --warmup 1 \
      --name train_llama-7b_2xh200_128k
  ;;
train)  # 7B at 256K and the 3B preset at 128K beside torch-CP
  step 380 $BE train --model llama-7b --methods burst,torch-cp --seqs 262144 --steps 1 --warmup 1 \
      --name train_llama-7b_2xh200_256k
  step 180 $BE train --model llama-3b --methods burst,torch-cp --seqs 131072 --steps 2 --warmup 1 \
      --name train_llama-3b_2xh200_128k
  ;;
profile)  # issue 35 item 1: where the 2-GPU 7B step's time goes (FSDP's collectives and the ring, exposed)
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
  for S in 131072 262144; do
    step 300 $TR -m burstengine bench profile --model llama-7b --seq $S --warmup 1 --name profile_7b_2gpu_${S}
  done
  ;;
*) echo "unknown stage $stage"; exit 2;;
esac
if [ -n "${OUT:-}" ]; then tar czf "$OUT/results_$stage.tgz" -C "$BURST_RESULTS" . && ls -la "$OUT"; fi
