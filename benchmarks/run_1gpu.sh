#!/usr/bin/env bash
# One-GPU checks and rows (H100 or H200: the record names the card), one device call (< 10 min):
#
#   bash benchmarks/run_1gpu.sh checks   # kernels vs float64 (lao-check), the decode path's check, every family's
#                                        # bf16 logits beside transformers', 8B decode (regression vs the
#                                        # decode_8b_h200_graphs record), issue 36's bytes per token per layer
#   bash benchmarks/run_1gpu.sh gemv     # 37: the GEMV kernel beside cuBLAS (check, speed, tile sweep), and 8B
#                                        # decode at 128K with it on / off, and with the tree in $OLD (a
#                                        # `git archive` of the commit before it: OLD=build/old93)
#   bash benchmarks/run_1gpu.sh kernels41  # 41: the kernels as they are beside cuDNN on this card (H100's rows
#                                        # are the ones missing): lao-check, the Gluon backward plain and
#                                        # backward_into (chunks included), the forward at d=128 and d=64
#   bash benchmarks/run_1gpu.sh heads41   # 41: head dims 96 and 256 beside cuDNN (H200's rows exist; H100's
#                                        # are missing): the forward at both (plain and forward_into), the
#                                        # d=256 backward plain and backward_into
#   bash benchmarks/run_1gpu.sh untiled  # 35: the 3B preset at 64K, the planner's choice (untiled: pointwise and
#                                        # offload layers only) beside tiled_mlp=on (the old auto's), one launch
#                                        # each; then lao-check (41: d=256 poisoned in 64-row tiles)
set -u
stage=${1:?stage: checks}
export PYTHONUNBUFFERED=1 PYTHONPATH=${PYTHONPATH:-$PWD}
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
out=${OUT:-$PWD/out}
export BURST_RESULTS=${BURST_RESULTS:-$out/results}
mkdir -p "$BURST_RESULTS"
TR1="python3 -m torch.distributed.run --standalone --nproc_per_node 1"
source "$(dirname "$0")/steps.sh"  # T0, BUDGET, step, bstep, left
nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader

case $stage in
checks)
  bstep 120 python3 -m burstengine bench lao-check
  bstep 90 python3 -m burstengine bench decode --check --model tiny --seqs 1K --batches 1 --tokens 4 --warmup 2 \
      --name decode_check_1gpu
  bstep 150 python3 benchmarks/probe_families.py --seq 8192 --layers 2 --name probe_families_1gpu
  # ~90 s: 8B decode from the CUDA graph at 128K and 512K (the record decode_8b_h200_graphs has 9.7 / 22 ms)
  bstep 150 python3 -m burstengine bench decode --graphs on --model llama-3.1-8b --seqs 128K,512K --batches 1 \
      --sdpa-max 128K --tokens 16 --warmup 4 --name decode_8b_1gpu_graphs
  # the MLP's bytes per token per layer, untiled and tiled (docs/training.md's table: 136.1 -> 44.1 KiB)
  for T in off on; do
    bstep 100 $TR1 -m burstengine bench train --model llama-8b --methods burst --seqs 16384,32768 --warmup 1 \
        --steps 1 --set model.n_layers=2 --set lora.rank=16 --set activation_checkpoint=none --set tiled_mlp=$T \
        --name longctx_bytes_8b2l_tiled_$T
  done
  ;;
gemv)
  nvidia-smi --query-gpu=name,memory.total,power.limit --format=csv,noheader
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
  bstep 150 python3 -m burstengine bench gemv --rows 1,8 --sweep --name gemv_$card
  D8="decode --model llama-3.1-8b --seqs 128K --batches 1 --tokens 8 --warmup 2 --eager-max 1 --sdpa-max 1"
  for G in on off; do
    bstep 100 python3 -m burstengine bench $D8 --gemv $G --name decode_8b_1gpu_128k_gemv_$G
  done
  if [ -n "${OLD:-}" ]; then  # python -m puts the working directory first on the path: run from the old tree
    (cd "$OLD" && BURST_COMMIT=${OLD_COMMIT:-} PYTHONPATH=$PWD bstep 100 python3 -m burstengine bench $D8 \
        --name decode_8b_1gpu_128k_before)
  fi
  ;;
kernels41)
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
  bstep 130 python3 -m burstengine bench lao-check
  # the records' names carry the card; auto's rules per card read them (bench/probes/vs_cudnn.py)
  NAME=probe_gluon_bwd_plain_$card bstep 120 python3 benchmarks/probe_gluon_bwd_variants.py \
      8192,16384,65536,131072 128:2 64:3 5
  NAME=probe_gluon_bwd_into_$card bstep 100 python3 benchmarks/probe_gluon_bwd_variants.py \
      8192,16384,65536,131072 128:2 64:3 5 --into
  (export OUT=$BURST_RESULTS/fwd && mkdir -p $OUT && bstep 70 python3 benchmarks/probe_gluon_fwd.py \
      8192,16384,32768,65536,131072 && mv $OUT/gluon_fwd.json $BURST_RESULTS/gluon_fwd_full_$card.json)
  (export OUT=$BURST_RESULTS/hd && mkdir -p $OUT && PYTHONPATH=$PYTHONPATH:$PWD/benchmarks bstep 90 \
      python3 benchmarks/probe_head_dims.py 16384,65536,131072 64 24,32 5 \
      && mv $OUT/probe_head_dims.json $BURST_RESULTS/probe_head_dims_d64_$card.json)
  ;;
untiled)
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
  B3="$TR1 -m burstengine bench train --model llama-3b --methods burst --seqs 65536 --steps 3 --warmup 1"
  logged untiled 110 $B3 --name train_llama-3b_1x${card}_64k_untiled
  logged tiled 110 $B3 --set tiled_mlp=on --name train_llama-3b_1x${card}_64k_tiled
  logged lao 150 python3 -m burstengine bench lao-check
  ;;
heads41)
  card=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | awk '{print tolower($2)}')
  for D in 256 96; do
    (export OUT=$BURST_RESULTS/fwd$D && mkdir -p $OUT && bstep 150 python3 benchmarks/probe_gluon_fwd.py \
        8192,16384,65536,131072 --d $D --into && mv $OUT/gluon_fwd.json $BURST_RESULTS/gluon_fwd_d${D}_$card.json)
  done
  NAME=probe_gluon_bwd_d256_sdp_$card bstep 120 python3 benchmarks/probe_gluon_bwd_variants.py 16384,65536 256:2 5
  NAME=probe_gluon_bwd_d256_into_$card bstep 100 python3 benchmarks/probe_gluon_bwd_variants.py 16384,65536 256:2 5 \
      --into
  ;;
*) echo "unknown stage $stage"; exit 2;;
esac
ls -la "$BURST_RESULTS"
