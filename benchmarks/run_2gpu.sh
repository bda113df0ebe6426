#!/usr/bin/env bash
# The 2xH200 runs of issues 23-25, in stages that each fit one device call (< 10 min):
#
#   bash benchmarks/run_2gpu.sh attention   # 23: correctness matrix, attention beside torch-CP (NVLink and
#                                           #     NCCL off NVLink), the fault test over NCCL
#   bash benchmarks/run_2gpu.sh train       # 23: 3B and 7B training beside torch-CP at 128K total
#   bash benchmarks/run_2gpu.sh finetune    # 24: Llama-3.1-8B config: init on 2 ranks, train, export, compare
#   bash benchmarks/run_2gpu.sh generate    # 25: 8B prefill beside torch-CP and TP, decode with a sharded cache
#   bash benchmarks/run_2gpu.sh profile     # 35: the 7B step profiled at 128K and 256K
#   bash benchmarks/run_2gpu.sh profile2    # 35: the same at 128K with the idle time's causes, 3 plans
#   bash benchmarks/run_2gpu.sh offload-pair  # 35: 7B 128K beside torch-CP, offload on; 41.3: the FP8 cache's check
#   bash benchmarks/run_2gpu.sh prefill-eff   # 37: prefill's parallel efficiency at 256K / 512K, cold and warm
#   bash benchmarks/run_2gpu.sh look        # 37: where the 128K decode step's 2.7 ms over its bound go (profile of
#                                           #     the graphed tensor-parallel step), then prefill-eff's 256K / 512K
#   bash benchmarks/run_2gpu.sh hostfree    # 37: greedy decode with the host out of the loop beside the tree before
#                                           #     ($OLD), 128K and 512K; the 256K prefill profiled (its last 6%)
#   bash benchmarks/run_2gpu.sh fused       # 37: the step's kernel cuts of stop 53 (heads kernel, packed merge send,
#                                           #     SwiGLU in the GEMV) beside the tree before ($OLD), 128K / 512K,
#                                           #     the decode check first, the new step profiled
#   bash benchmarks/run_2gpu.sh heads       # 37: fused's cuts less SwiGLU in the GEMV (slower), 128K beside $OLD, profiled
#   bash benchmarks/run_2gpu.sh home16      # 35: the 7B step at 128K beside torch-CP and profiled after the ring's
#                                           #     last gradient hop went home in bf16 (half the exposed bytes)
#   bash benchmarks/run_2gpu.sh retries     # 35: does planning the reduce-scatter stream's cached gradients (12.6 GiB
#                                           #     on 7B at 128K, profile_7b_2gpu_131072_memtrace.json) out of the
#                                           #     activations remove the allocator's two retries a step, and at what cost
#   bash benchmarks/run_2gpu.sh pool        # 35: FSDP's sharded gradients from the compute stream's pool
#                                           #     (grads_on_compute): 7B 128K beside torch-CP, profiled, and off
#   bash benchmarks/run_2gpu.sh pool256     # 35: pool's 7B pair at 256K, then the 3B preset's at 128K
#   bash benchmarks/run_2gpu.sh plan2       # 35: the planner counting the tiled MLP's recompute (7B at 128K untiled
#                                           #     now) beside torch-CP and beside tiled_mlp=on; the 3B preset's pair
#   bash benchmarks/run_2gpu.sh rule3       # 35: the 3B preset at 128K tiled (plan2's untiled row's other half), then
#                                           #     long2's 7B at 256K
#   bash benchmarks/run_2gpu.sh long2       # 35: 7B at 256K, burst alone (one warm-up, one timed step)
#   bash benchmarks/run_2gpu.sh kern2       # 37 / 41.2: prefill 256K (efficiency, cold and warm) and attention at
#                                           #     128K beside torch-CP with today's kernels
#   bash benchmarks/run_2gpu.sh decode      # 37: decode over 2 ranks (CUDA graph with NCCL in it, tensor-parallel
#                                           #     weights), 8B at 128K / 512K / batch 8; prefill cold and warm
#   bash benchmarks/run_2gpu.sh decode2     # 37: the decode step after its kernel cuts (packed projections, the
#                                           #     GEMV kernel, compiled merge), 128K and 512K, beside the tree in
#                                           #     $OLD (a `git archive` of the commit before: OLD=build/old93)
#   bash benchmarks/run_2gpu.sh longctx-plan     # 36: what llama-8b / the 3B preset need at 1M (the planner's
#                                                #     line, no step), and bytes per token per layer measured
#   bash benchmarks/run_2gpu.sh longctx-speed    # 36: the 3B preset at 128K on 2 GPUs, each new option on / off
#   bash benchmarks/run_2gpu.sh longctx-speed2   #     (the rest of them)
#   bash benchmarks/run_2gpu.sh longctx-proxy    # 36: an 8B-shaped 4-layer model at 1M on 2 GPUs (LoRA, tiled
#                                                #     MLP, layer inputs on the host) beside torch-CP: the per-layer
#                                                #     memory and MFU at the target length inside one call
#   bash benchmarks/run_2gpu.sh longctx          # 36: llama-8b at 1M on 2 GPUs, then --longest (LONG: one 1M step
#                                                #     of the 32-layer model is ~18-25 min at 40% MFU; needs a call
#                                                #     longer than 10 min)
#
# One-GPU commands of issue 36 (H100 or H200: say which; one step at these lengths takes longer than a
# 10-minute call, so each has a 4-layer proxy that fits one, and --memory-plan says what the whole
# model needs in a minute, without a step):
#   TR1="python3 -m torch.distributed.run --standalone --nproc_per_node 1"
#   # llama-8b >= 512K on one H100: LoRA (bf16 base 15 GiB on the device; CPU offload cannot hold AdamW's
#   # 128 GB of states in a 128 GiB host), tiled MLP, layer inputs on the host (~100 GiB pinned)
#   timeout 300 $TR1 -m burstengine train --config llama-8b --memory-plan --set seq_len=524288 \
#       --set lora.rank=16 --set offload_memory_gib=100
#   timeout 1500 $TR1 -m burstengine bench train --model llama-8b --methods burst --seqs 524288 --warmup 0 \
#       --steps 1 --set lora.rank=16 --set offload_memory_gib=100 --name longctx_8b_lora_1gpu_512k
#   timeout 500 $TR1 -m burstengine bench train --model llama-8b --methods burst --seqs 524288 --warmup 0 \
#       --steps 1 --set lora.rank=16 --set model.n_layers=4 --set activation_checkpoint=full-offload \
#       --name longctx_8b4l_lora_1gpu_512k                                # the proxy (~2 min a step)
#   # llama-8b >= 512K on one H200 (141 GB): LoRA alone fits with the default host budget
#   timeout 1500 $TR1 -m burstengine bench train --model llama-8b --methods burst --seqs 524288 --warmup 0 \
#       --steps 1 --set lora.rank=16 --name longctx_8b_lora_1xh200_512k
#   # the 3B preset >= 1M on one H200: LoRA (its full AdamW states, 51 GB, leave the 28 layer inputs of
#   # 6 GiB each no room on a 141 GB card and a 128 GiB host), tiled MLP, ~90 GiB of inputs on the host
#   timeout 300 $TR1 -m burstengine train --config llama-3b --memory-plan --set seq_len=1048576 \
#       --set lora.rank=16 --set offload_memory_gib=96
#   timeout 2400 $TR1 -m burstengine bench train --model llama-3b --methods burst --seqs 1048576 --warmup 0 \
#       --steps 1 --set lora.rank=16 --set offload_memory_gib=96 --name longctx_3b_lora_1xh200_1m
#   timeout 500 $TR1 -m burstengine bench train --model llama-3b --methods burst --seqs 1048576 --warmup 0 \
#       --steps 1 --set lora.rank=16 --set model.n_layers=2 --set activation_checkpoint=full-offload \
#       --name longctx_3b2l_lora_1xh200_1m                               # the proxy (~3 min a step)
#   # the longest on one GPU, beside plain PyTorch (no CP on one GPU): doubling from 256K, then bisecting
#   timeout 3600 $TR1 -m burstengine bench train --model llama-3b --methods burst,plain --seqs 262144 --longest \
#       --warmup 0 --steps 1 --set lora.rank=16 --set offload_memory_gib=96 --name longest_3b_lora_1gpu
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
source "$(dirname "$0")/steps.sh"  # T0, BUDGET, step, bstep, left

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
profile2)  # 35 item 1: the 7B step at 128K again, with the idle time's host-side causes and the allocator's
  # counts: the default plan, activations offloaded to the host (for speed), and 7 GiB less planned than fits
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader; free -g | head -2
  P7="$TR -m burstengine bench profile --model llama-7b --seq 131072 --warmup 1"
  logged p_def 170 $P7 --name profile_7b_2gpu_131072_idle
  logged p_off 170 $P7 --set activation_offload=true --name profile_7b_2gpu_131072_offload
  logged p_66 170 $P7 --set activation_memory_gib=66 --name profile_7b_2gpu_131072_budget66
  ;;
offload-pair)  # 35: the 7B step at 128K beside torch-CP with activation offload on by default (profile2 showed
  # 1.037x over the plan without it); 41.3: the FP8 KV cache's check and its 128K row beside bf16 (fp8kv's first half)
  logged pair 250 $BE train --model llama-7b --methods burst,torch-cp --seqs 131072 --steps 2 --warmup 1 \
      --name train_llama-7b_2gpu_128k_offload
  D8="decode --model llama-3.1-8b --tokens 8 --warmup 2 --sliced --eager-max 1 --batches 1"
  logged check 120 $BE decode --check --model tiny --seqs 1K --batches 1 --tokens 4 --warmup 2 --kv-cache fp8 \
      --name decode_check_2gpu_kvfp8
  logged b128 90 $BE $D8 --seqs 128K --name decode_8b_2gpu_128k_kvbf16
  logged f128 90 $BE $D8 --seqs 128K --kv-cache fp8 --name decode_8b_2gpu_128k_kvfp8
  ;;
prefill-eff)  # 37 item 5 / 38.3: prefill's parallel efficiency (bench prefill --efficiency: rank 0 times the ring's
  # own causal kernel and a projection matmul on one GPU after the timed calls), cold and warm, beside torch-CP
  logged eff256 260 $BE prefill --models 8b --seqs 262144 --methods burst,torch-cp --cold --warmup 1 --iters 1 \
      --efficiency --name prefill_8b_2gpu_256k_eff
  logged eff512 280 $BE prefill --models 8b --seqs 524288 --methods burst --cold --warmup 1 --iters 1 \
      --efficiency --name prefill_8b_2gpu_512k_eff
  ;;
look)
  logged prof128 130 $BE decode --model llama-3.1-8b --seqs 128K --batches 1 --tokens 8 --warmup 2 --sliced \
      --eager-max 1 --profile 8 --name decode_8b_2gpu_128k_profile2
  logged eff256 240 $BE prefill --models 8b --seqs 262144 --methods burst,torch-cp --cold --warmup 1 --iters 1 \
      --efficiency --name prefill_8b_2gpu_256k_eff
  logged eff512 240 $BE prefill --models 8b --seqs 524288 --methods burst --cold --warmup 1 --iters 1 \
      --efficiency --name prefill_8b_2gpu_512k_eff
  ;;
hostfree)
  D8="decode --model llama-3.1-8b --batches 1 --tokens 16 --warmup 4 --sliced --eager-max 1"
  old() {  # python -m puts the working directory first on the path: run from the old tree
    (cd "$OLD" && BURST_COMMIT=${OLD_COMMIT:-} PYTHONPATH=$PWD logged "$@")
  }
  logged new128 80 $BE $D8 --seqs 128K --name decode_8b_2gpu_128k_hostfree
  old old128 80 $BE $D8 --seqs 128K --name decode_8b_2gpu_128k_hostfree_before
  logged new512 110 $BE $D8 --seqs 512K --name decode_8b_2gpu_512k_hostfree
  old old512 110 $BE $D8 --seqs 512K --name decode_8b_2gpu_512k_hostfree_before
  logged pre256 150 $BE prefill --models 8b --seqs 262144 --methods burst --warmup 1 --iters 1 --profile \
      --name prefill_8b_2gpu_256k_profile
  ;;
fused)  # 37: the step with the heads kernel (unpack, q/k norms, RoPE, K/V write in one), the merge's send
        # without a copy and SwiGLU inside the down projection's GEMV, beside the tree before ($OLD); the
        # decode check on 2 ranks first; the step profiled
  D8="decode --model llama-3.1-8b --batches 1 --tokens 16 --warmup 4 --sliced --eager-max 1"
  old() {  # python -m puts the working directory first on the path: run from the old tree
    (cd "$OLD" && BURST_COMMIT=${OLD_COMMIT:-} PYTHONPATH=$PWD logged "$@")
  }
  logged check 150 $BE decode --check --model tiny --seqs 1K --batches 1 --tokens 4 --warmup 2 \
      --name decode_check_2gpu_fused
  logged new128 80 $BE $D8 --seqs 128K --name decode_8b_2gpu_128k_fused
  old old128 80 $BE $D8 --seqs 128K --name decode_8b_2gpu_128k_fused_before
  logged new512 110 $BE $D8 --seqs 512K --name decode_8b_2gpu_512k_fused
  old old512 110 $BE $D8 --seqs 512K --name decode_8b_2gpu_512k_fused_before
  logged prof 90 $BE decode --model llama-3.1-8b --seqs 128K --batches 1 --tokens 8 --warmup 2 --sliced \
      --eager-max 1 --profile 8 --name decode_8b_2gpu_128k_profile3
  ;;
heads)  # 37: fused's cuts less SwiGLU in the GEMV (it slowed the down projection ~2.5x: the whole GEMV time went
        # 2.15 -> 4.63 ms a step, decode_8b_2gpu_128k_profile3.json), at 128K beside $OLD; the step profiled
  D8="decode --model llama-3.1-8b --batches 1 --tokens 16 --warmup 4 --sliced --eager-max 1"
  old() { (cd "$OLD" && BURST_COMMIT=${OLD_COMMIT:-} PYTHONPATH=$PWD logged "$@"); }
  logged new128 80 $BE $D8 --seqs 128K --name decode_8b_2gpu_128k_heads
  old old128 80 $BE $D8 --seqs 128K --name decode_8b_2gpu_128k_heads_before
  logged prof 80 $BE decode --model llama-3.1-8b --seqs 128K --batches 1 --tokens 8 --warmup 2 --sliced \
      --eager-max 1 --profile 8 --name decode_8b_2gpu_128k_profile4
  ;;
home16)
  logged pair 260 $BE train --model llama-7b --methods burst,torch-cp --seqs 131072 --steps 2 --warmup 1 \
      --name train_llama-7b_2gpu_128k_home16
  logged prof 170 $TR -m burstengine bench profile --model llama-7b --seq 131072 --warmup 1 \
      --name profile_7b_2gpu_131072_home16
  ;;
retries)
  P7="$TR -m burstengine bench profile --model llama-7b --seq 131072 --warmup 1 --memory-trace"
  logged m58 170 $P7 --set activation_memory_gib=58 --name profile_7b_2gpu_131072_budget58
  logged m52 170 $P7 --set activation_memory_gib=52 --name profile_7b_2gpu_131072_budget52
  ;;
pool)  # 35: the 7B step at 128K with FSDP's sharded gradients taken from the compute stream's pool (the default
  # now), beside torch-CP (which gets it too), profiled (the allocator's retries), and the burst row without it
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
  logged pair 260 $BE train --model llama-7b --methods burst,torch-cp --seqs 131072 --steps 2 --warmup 1 \
      --name train_llama-7b_2gpu_128k_pool
  logged prof 170 $TR -m burstengine bench profile --model llama-7b --seq 131072 --warmup 1 \
      --name profile_7b_2gpu_131072_pool
  logged off 130 $BE train --model llama-7b --methods burst --seqs 131072 --steps 2 --warmup 1 \
      --set grads_on_compute=false --name train_llama-7b_2gpu_128k_fsdppool
  ;;
pool256)  # 35: with the gradients from the compute pool and today's kernels, 7B at 256K beside torch-CP (one
  # warm-up and one timed step each; torch-CP's row needs ~3 min), then the 3B preset at 128K beside torch-CP
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
  logged p256 420 $BE train --model llama-7b --methods burst,torch-cp --seqs 262144 --steps 1 --warmup 1 \
      --name train_llama-7b_2gpu_256k_pool
  logged p3b 200 $BE train --model llama-3b --methods burst,torch-cp --seqs 131072 --steps 2 --warmup 1 \
      --name train_llama-3b_2gpu_128k_pool
  ;;
plan2)  # 35: the planner's tiled/untiled choice by FLOPs (eac1ea3): 7B at 128K beside torch-CP, then the same
  # burst row with tiled_mlp=on (the old auto's plan) in this launch, then the 3B preset at 128K beside torch-CP
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
  logged pair 260 $BE train --model llama-7b --methods burst,torch-cp --seqs 131072 --steps 2 --warmup 1 \
      --name train_llama-7b_2gpu_128k_plan2
  logged tiled 130 $BE train --model llama-7b --methods burst --seqs 131072 --steps 2 --warmup 1 \
      --set tiled_mlp=on --name train_llama-7b_2gpu_128k_tiled
  logged p3b 200 $BE train --model llama-3b --methods burst,torch-cp --seqs 131072 --steps 2 --warmup 1 \
      --name train_llama-3b_2gpu_128k_plan2
  ;;
rule3)  # 35: the 3B preset at 128K with tiled_mlp=on beside plan2's untiled row (auto's choice),
  # then 7B at 256K, burst alone
  logged t3b 130 $BE train --model llama-3b --methods burst --seqs 131072 --steps 2 --warmup 1 --set tiled_mlp=on \
      --name train_llama-3b_2gpu_128k_tiled
  logged b256 300 $BE train --model llama-7b --methods burst --seqs 262144 --steps 1 --warmup 1 \
      --name train_llama-7b_2gpu_256k_plan2
  ;;
long2)  # 35: 7B at 256K with today's planner, kernels and gradient pool, burst alone
  logged b256 330 $BE train --model llama-7b --methods burst --seqs 262144 --steps 1 --warmup 1 \
      --name train_llama-7b_2gpu_256k_plan2
  ;;
kern2)  # 37 / 41 item 2: with today's kernels, prefill at 256K beside torch-CP (efficiency, first call and warm),
  # attention fwd+bwd at 128K beside torch-CP and one GPU
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
  logged eff256 270 $BE prefill --models 8b --seqs 262144 --methods burst,torch-cp --cold --warmup 1 --iters 1 \
      --efficiency --name prefill_8b_2gpu_256k_eff2
  logged att 150 $BE attention --seqs 131072 --mask both --kv-heads 32,8 --name attention_2gpu_128k_kern \
      --methods burst-zigzag,torch-cp-cudnn,single-gpu-cudnn
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
decode2)  # 37: tensor-parallel decode, sliced weights, new step vs the old tree, each in this launch
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
  bstep 80 python3 -m burstengine bench gemv --rows 1,8 --sweep --name gemv_${card}_graph
  D8="decode --model llama-3.1-8b --batches 1 --tokens 8 --warmup 2 --sliced --eager-max 1"
  old() {  # python -m puts the working directory first on the path: run from the old tree
    (cd "$OLD" && BURST_COMMIT=${OLD_COMMIT:-} PYTHONPATH=$PWD bstep "$@")
  }
  bstep 90 $BE $D8 --seqs 128K --gemv on --name decode_8b_2gpu_128k_gemv_on
  bstep 90 $BE $D8 --seqs 128K --gemv off --name decode_8b_2gpu_128k_gemv_off
  old 90 $BE $D8 --seqs 128K --name decode_8b_2gpu_128k_before
  bstep 150 $BE $D8 --seqs 512K --gemv on --name decode_8b_2gpu_512k_gemv_on
  old 150 $BE $D8 --seqs 512K --name decode_8b_2gpu_512k_before
  ;;
decode3)  # 37: the decode step with the GEMV tiles of the sweep; the decode check on 2 ranks; each log kept
  D8="decode --model llama-3.1-8b --batches 1 --tokens 8 --warmup 2 --sliced --eager-max 1"
  logged check 150 $BE decode --check --model tiny --seqs 1K --batches 1 --tokens 4 --warmup 2 --name decode_check_2gpu_gemv
  logged off128 90 $BE $D8 --seqs 128K --gemv off --name decode_8b_2gpu_128k_gemv_off
  logged on128 90 $BE $D8 --seqs 128K --gemv on --name decode_8b_2gpu_128k_tiles
  logged on512 150 $BE $D8 --seqs 512K --gemv on --name decode_8b_2gpu_512k_tiles
  ;;
fp8kv)  # 41.3 / 37: decode from an FP8 KV cache beside the bf16 one, tensor-parallel over 2 ranks, each length in
  # its own launch (bench decode runs one cache dtype a launch); --check first: the kernel against float64
  D8="decode --model llama-3.1-8b --tokens 8 --warmup 2 --sliced --eager-max 1 --batches 1"
  logged check 120 $BE decode --check --model tiny --seqs 1K --batches 1 --tokens 4 --warmup 2 --kv-cache fp8 \
      --name decode_check_2gpu_kvfp8
  logged b128 90 $BE $D8 --seqs 128K --name decode_8b_2gpu_128k_kvbf16
  logged f128 90 $BE $D8 --seqs 128K --kv-cache fp8 --name decode_8b_2gpu_128k_kvfp8
  logged f512 150 $BE $D8 --seqs 512K --kv-cache fp8 --name decode_8b_2gpu_512k_kvfp8
  ;;
batch8)  # 37: batch 8 at 128K after the capture's retry (its capture failed at 713227f); 36: tokens/s at 128K with
  # each option on beside off (the 3B preset), the rows of longctx-speed that fit what is left
  logged b8 150 $BE decode --model llama-3.1-8b --tokens 8 --warmup 2 --sliced --eager-max 1 --batches 8 --seqs 128K \
      --name decode_8b_2gpu_128k_b8_cuts
  B3="$BE train --model llama-3b --methods burst --seqs 131072 --warmup 1 --steps 2"
  logged base 120 $B3 --set tiled_mlp=off --name longctx_speed_3b_128k_base
  logged lora 120 $B3 --set tiled_mlp=off --set lora.rank=16 --name longctx_speed_3b_128k_lora
  logged tiled 120 $B3 --set tiled_mlp=on --name longctx_speed_3b_128k_tiled
  ;;
decode4)  # 37: the step with q/k roped in the gather's unpacking, beside the tree before the cuts ($OLD), batch 8
  # at 128K (a 69 GB cache shard: H200), and a 1M prompt (a ~4 min prefill; the cache is 64 GB a rank)
  D8="decode --model llama-3.1-8b --tokens 8 --warmup 2 --sliced --eager-max 1"
  logged new128 90 $BE $D8 --batches 1 --seqs 128K --name decode_8b_2gpu_128k_raw
  (cd "$OLD" && BURST_COMMIT=${OLD_COMMIT:-} PYTHONPATH=$PWD logged old128 90 $BE $D8 --batches 1 --seqs 128K \
      --name decode_8b_2gpu_128k_before2)
  logged b8 120 $BE $D8 --batches 8 --seqs 128K --name decode_8b_2gpu_128k_b8_raw
  logged m1 330 $BE $D8 --batches 1 --seqs 1M --name decode_8b_2gpu_1m_raw
  ;;
longctx-plan)  # 36: the planner's line for each target (a model built, no step) and measured bytes/token/layer
  nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; free -g | head -2
  # llama-8b at 1M on 2 GPUs: LoRA (bf16 base, 7.5 GiB a GPU), or every state CPU-offloaded (fits 2 x H200 only)
  step 240 $TR -m burstengine train --config llama-8b --memory-plan --set seq_len=1048576 --set lora.rank=16 \
      --set offload_memory_gib=96
  step 240 $TR -m burstengine train --config llama-8b --memory-plan --set seq_len=1048576 --set cpu_offload=true \
      --set offload_memory_gib=64
  # the MLP's bytes per token per layer, untiled and tiled: 2 layers of llama-8b, everything kept (none), at two
  # lengths on one GPU: (peak(32K) - peak(16K)) / 16K / 2 against docs/training.md's table (136.1 -> 44.1 KiB)
  for T in off on; do
    step 150 python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m burstengine bench train \
        --model llama-8b --methods burst --seqs 16384,32768 --warmup 1 --steps 1 --set model.n_layers=2 \
        --set lora.rank=16 --set activation_checkpoint=none --set tiled_mlp=$T --name longctx_bytes_8b2l_tiled_$T
  done
  ;;
longctx-speed)  # 36: tokens/s at 128K, each new option on beside off (the 3B preset, 2 GPUs, BurstAttention)
  step 150 $BE train --model llama-3b --methods burst --seqs 131072 --warmup 1 --steps 2 --set tiled_mlp=off \
      --name longctx_speed_3b_128k_base
  step 150 $BE train --model llama-3b --methods burst --seqs 131072 --warmup 1 --steps 2 --set tiled_mlp=on \
      --name longctx_speed_3b_128k_tiled
  step 150 $BE train --model llama-3b --methods burst --seqs 131072 --warmup 1 --steps 2 --set tiled_mlp=off \
      --set lora.rank=16 --name longctx_speed_3b_128k_lora
  ;;
longctx-speed2)
  step 200 $BE train --model llama-3b --methods burst --seqs 131072 --warmup 1 --steps 2 --set tiled_mlp=off \
      --set cpu_offload=true --name longctx_speed_3b_128k_cpu_offload
  step 150 $BE train --model llama-3b --methods burst --seqs 131072 --warmup 1 --steps 2 --set tiled_mlp=off \
      --set activation_checkpoint=full --name longctx_speed_3b_128k_full
  step 150 $BE train --model llama-3b --methods burst --seqs 131072 --warmup 1 --steps 2 --set tiled_mlp=off \
      --set activation_checkpoint=full-offload --name longctx_speed_3b_128k_full_offload
  ;;
longctx-proxy)  # 36: 8B-shaped, 4 layers, 1M tokens on 2 GPUs: LoRA, tiled MLP, every layer input on the host,
                # beside torch-CP (which runs out of memory there: its layers keep their inputs on the device)
  for M in burst torch-cp; do  # ~4 min a step each (~1.2e17 FLOPs at ~35% MFU, plus the recompute)
    step 280 $BE train --model llama-8b --methods $M --seqs 1048576 --warmup 0 --steps 1 \
        --set model.n_layers=4 --set lora.rank=16 --set activation_checkpoint=full-offload --set tiled_mlp=on \
        --name longctx_proxy_8b4l_lora_2gpu_1m_$M
  done
  ;;
longctx)  # 36: llama-8b at 1M on 2 GPUs with LoRA, beside torch-CP, then the longest (doubling, then bisecting)
  step 2400 $BE train --model llama-8b --methods burst,torch-cp --seqs 1048576 --warmup 0 --steps 1 \
      --set lora.rank=16 --set offload_memory_gib=96 --name longctx_8b_lora_2gpu_1m
  step 7200 $BE train --model llama-8b --methods burst,torch-cp --seqs 524288 --longest --max-seq 2097152 \
      --warmup 0 --steps 1 --set lora.rank=16 --set offload_memory_gib=96 --name longest_8b_lora_2gpu
  ;;
*) echo "unknown stage $stage"; exit 2;;
esac
if [ -n "${OUT:-}" ]; then tar czf "$OUT/results_$stage.tgz" -C "$BURST_RESULTS" . && ls -la "$OUT"; fi
