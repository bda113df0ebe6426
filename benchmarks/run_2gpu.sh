#!/usr/bin/env bash
# The 2xH200 runs of issues 23-25, in stages that each fit one device call (< 10 min):
#
#   bash benchmarks/run_2gpu.sh attention   # 23: correctness matrix, attention beside torch-CP (NVLink and
#                                           #     NCCL off NVLink), the fault test over NCCL
#   bash benchmarks/run_2gpu.sh train       # 23: 3B and 7B training beside torch-CP at 128K total
#   bash benchmarks/run_2gpu.sh finetune    # 24: Llama-3.1-8B config: init on 2 ranks, train, export, compare
#   bash benchmarks/run_2gpu.sh generate    # 25: 8B prefill beside torch-CP and TP, decode with a sharded cache
#   bash benchmarks/run_2gpu.sh profile     # 35: the 7B step profiled at 128K and 256K
#   bash benchmarks/run_2gpu.sh decode      # 37: decode over 2 ranks (CUDA graph with NCCL in it, tensor-parallel
#                                           #     weights), 8B at 128K / 512K / batch 8; prefill cold and warm
#
# Records land in $BURST_RESULTS (default $OUT/results, else ./burst-results) and come back as one
# tarball; every step has its own timeout so one stuck step cannot eat the call, and a failed step
# does not stop the others.  Set BURST_COMMIT to the commit that travelled.
set -u
stage=${1:?stage: attention, train, finetune, generate, profile or decode}
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
# a step under the stage's budget (BUDGET seconds from the start): its timeout is cut to what is left,
# and it is skipped (said so) when less than 30 s are, so the stage ends inside one device call
BUDGET=${BUDGET:-540}
bstep() {
  local t=$1 left=$(( BUDGET - ($(date +%s) - T0) )); shift
  if [ "$left" -lt 30 ]; then echo "=== skipped, ${left}s of the budget left: $*"; return; fi
  [ "$t" -gt "$left" ] && t=$left
  step "$t" "$@"
}

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
decode)  # issue 37 items 1-3 on 2 GPUs, ~8 min on 2xH200 (the expected time of each step beside it; on 2xH100 the
  # 512K prefill is slower and batch 8 at 128K runs out of memory: its cache alone is 69 GB per rank)
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
  # ~20 s: NCCL collectives captured in a CUDA graph here (all-gather + all-reduce x 32 layers), same bits as
  # eager, and the cost of one collective inside the graph
  bstep 45 $TR benchmarks/probe_nccl_graph.py --out "$BURST_RESULTS"
  # ~70 s: the decode path on 2 ranks before timing: the kernel vs float64, and a small model's greedy tokens
  # whole and tensor-parallel, graph (collectives captured) and op by op, vs the float64 model's
  bstep 120 $BE decode --check --model tiny --seqs 1K --batches 1 --tokens 4 --warmup 2 --name decode_check_2gpu
  # ~70 s: 8B at 128K, batch 1: the tensor-parallel step (each rank reads 8 GB of weights + its 8.6 GB of cache)
  # and the whole-model one (16 + 8.6 GB), each from the CUDA graph and op by op (4 prefills of ~6 s);
  # expected: TP + graph ~5-6 ms (its bound ~4 ms at ~4 TB/s: 7.5 GB of weights + 8.6 GB of cache; ~130 small
  # collectives), whole-model graph ~6.5 ms (bound ~6 ms), op by op ~40-80 ms (host-bound)
  bstep 120 $BE decode --model llama-3.1-8b --seqs 128K --batches 1 --tokens 8 --warmup 2 --tp both \
      --name decode_8b_2gpu_128k
  # ~110 s: 7B prefill at 128K and 256K beside torch-CP: each length's first call apart from the warm one
  # (target: first <= 1.1x warm, and >= 1.10x torch-CP warm and cold)
  bstep 160 $BE prefill --models 7b --seqs 131072,262144 --methods burst,torch-cp --cold --warmup 1 --iters 1 \
      --name prefill_7b_2gpu_cold
  # ~100 s: 8B at 512K, batch 1, tensor-parallel from the graph (one ~70 s prefill; op by op is measured at 128K)
  bstep 160 $BE decode --model llama-3.1-8b --seqs 512K --batches 1 --tokens 8 --warmup 2 --tp on --eager-max 1 \
      --name decode_8b_2gpu_512k
  # ~80 s: 8B at 128K, batch 8, tensor-parallel, each rank loading only its slices (8 GB of weights beside a
  # 69 GB cache shard; H200 only)
  bstep 130 $BE decode --model llama-3.1-8b --seqs 128K --batches 8 --tokens 8 --warmup 2 --sliced --eager-max 1 \
      --name decode_8b_2gpu_128k_b8
  ;;
*) echo "unknown stage $stage"; exit 2;;
esac
if [ -n "${OUT:-}" ]; then tar czf "$OUT/results_$stage.tgz" -C "$BURST_RESULTS" . && ls -la "$OUT"; fi
