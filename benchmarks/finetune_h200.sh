#!/usr/bin/env bash
# Fine-tuning a pretrained model end to end on one H200 (issue 20, point 9):
#   1. a random-weight HF directory with Llama-3.2-3B's exact config (+ a small tokenizer and a
#      synthetic jsonl corpus of documents of random lengths);
#   2. init -> train at 64K and at 128K tokens with packed documents and doc_mask -> checkpoint;
#   3. export each run -> reload with transformers -> logits vs the engine's;
#   4. Llama-3.1-8B's config: load (sharded init: time, peak host RSS), save the weights, export
#      (SAVE_8B=0: load only).
# Prints a table (from the records) and writes JSON records to $OUT (or benchmarks/results).  Needs the finetune-data
# branch merged (data=jsonl, doc_mask).  Sizes: SEQS, STEPS, SKIP_8B=1 to leave out step 4.
#
#   OUT=/tmp/out bash benchmarks/finetune_h200.sh
set -euo pipefail
OUT=${OUT:-benchmarks/results}
W=${WORK:-/tmp/burst_finetune}
SEQS=${SEQS:-"65536 131072"}
STEPS=${STEPS:-2}
CFG3B=${CFG3B:-llama-3.2-3b}
CFG8B=${CFG8B:-llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
export BURST_RESULTS=$OUT
mkdir -p "$OUT" "$W"
BE="python -m burstengine"
log() { echo "[$(date +%T)] $*"; }

log "1. random $CFG3B directory, tokenizer, corpus"
$BE bench finetune make --config "$CFG3B" --out "$W/m3b" --device "$DEVICE" --record ft_make_3b >"$OUT/ft_make_3b.log"
python - "$W" "$W/m3b" <<'EOF'
import json, random, sys
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
work, model = sys.argv[1:3]
rng = random.Random(0)
words = [f"w{i}" for i in range(6000)]
docs, total = [], 0
while total < 1_600_000:  # enough tokens for the steps at 64K and 128K
    n = int(rng.lognormvariate(8.0, 1.0)) + 16  # documents of ~3K words, some 30K+
    docs.append(" ".join(rng.choice(words) for _ in range(n)))
    total += n
with open(f"{work}/corpus.jsonl", "w") as f:
    for d in docs:
        f.write(json.dumps({"text": d}) + "\n")
tok = Tokenizer(models.BPE(unk_token="<unk>"))
tok.pre_tokenizer = pre_tokenizers.Whitespace()
tok.train_from_iterator(docs[:200], trainers.BpeTrainer(vocab_size=8000, special_tokens=["<unk>", "<s>", "</s>"]))
tok.save(f"{model}/tokenizer.json")
json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, open(f"{model}/tokenizer_config.json", "w"))
print(f"corpus: {len(docs)} documents, {total} words")
EOF

for S in $SEQS; do
  K=$S
  log "2. init -> train at $S tokens with doc_mask"
  torchrun --standalone --nproc_per_node 1 -m burstengine train --config tiny --overwrite \
    --set init="$W/m3b" --set data="$W/corpus.jsonl" --set doc_mask=true --set cp=1 --set seq_len="$S" \
    --set batch_size=1 --set steps="$STEPS" --set warmup_steps=0 --set lr=1e-5 --set activation_checkpoint=auto \
    --set loss=fused --set save_every="$STEPS" --set eval_every=0 --set progress=false \
    --set name="ft3b_$K" --set out_dir="$W/run_$K" --record "ft_train_3b_$K" 2>&1 | tee "$OUT/ft_train_3b_$K.log"
  log "3. export -> transformers vs engine at $S"
  $BE export "$W/run_$K" "$W/export_$K" --dtype bfloat16 --record "ft_export_3b_$K"
  $BE bench finetune compare --model "$W/export_$K" --seq "$S" --rows 256 --record "ft_compare_3b_$K" \
    >"$OUT/ft_compare_3b_$K.log"
  rm -rf "$W/run_$K/checkpoints" "$W/export_$K"  # a 3B checkpoint with AdamW is ~38 GB: the next run needs the disk
done

if [ "${SKIP_8B:-0}" != 1 ]; then
  log "4. $CFG8B: make, load (sharded init), save, export"
  $BE bench finetune make --config "$CFG8B" --out "$W/m8b" --device "$DEVICE" --record ft_make_8b >"$OUT/ft_make_8b.log"
  rm -rf "$W/m3b" "$W/corpus.jsonl"  # the disk holds at most ~48 GB of 8B files at once below
  if [ "${SAVE_8B:-1}" = 1 ]; then  # HF dir 16 GB + float32 weights-only checkpoint 32 GB, then export 16 GB
    torchrun --standalone --nproc_per_node 1 -m burstengine bench finetune load --init "$W/m8b" --save "$W/run8b" \
      --record ft_load_8b >"$OUT/ft_load_8b.log"
    rm -f "$W"/m8b/*.safetensors "$W"/m8b/*.safetensors.index.json  # export reads only its config.json
    $BE export "$W/run8b" "$W/export8b" --dtype bfloat16 --record ft_export_8b
    du -sh "$W/export8b" "$W/run8b"
    rm -rf "$W/run8b"
    $BE bench finetune compare --model "$W/export8b" --seq 8192 --rows 256 --record ft_compare_8b >"$OUT/ft_compare_8b.log"
  else
    torchrun --standalone --nproc_per_node 1 -m burstengine bench finetune load --init "$W/m8b" \
      --record ft_load_8b >"$OUT/ft_load_8b.log"
  fi
fi

python - "$OUT" <<'EOF'
import glob, json, os, re, sys
out = sys.argv[1]
def rec(name):
    p = os.path.join(out, name + ".json")
    return json.load(open(p)) if os.path.exists(p) else None
def loaded(path):
    if not os.path.exists(path):
        return None
    m = re.search(r"loaded .* in ([\d.]+)s \(rank 0 read ([\d.]+) GiB, peak host RSS ([\d.]+) GiB\)", open(path).read())
    return m.groups() if m else None
rows, summary = [], {}
for log in sorted(glob.glob(os.path.join(out, "ft_train_3b_*.log"))):
    K = log.rsplit("_", 1)[1][:-4]
    t = (rec(f"ft_train_3b_{K}") or {}).get("summary", {})
    c = rec(f"ft_compare_3b_{K}") or {}
    ld = loaded(log)
    row = {"model": "3B", "seq": K, "load_s": ld and float(ld[0]), "load_peak_rss_gib": ld and float(ld[2]),
           "tok_s_gpu": t.get("mean_tokens_per_s_per_gpu"), "mfu": t.get("mean_mfu", t.get("mfu")),
           "peak_gpu_gib": t.get("peak_mem_gib"), "final_loss": t.get("final_loss"),
           "export_s": (rec(f"ft_export_3b_{K}") or {}).get("export_s"),
           "export_peak_rss_gib": (rec(f"ft_export_3b_{K}") or {}).get("peak_rss_gib"),
           "logits_max_rel_err": c.get("max_rel_err"), "argmax_agree": c.get("argmax_agreement")}
    rows.append(row)
l8 = rec("ft_load_8b")
if l8:
    rows.append({"model": "8B", "seq": "load only", "load_s": l8.get("load_s_max_rank"),
                 "load_peak_rss_gib": l8.get("peak_host_rss_gib_max_rank"), "peak_gpu_gib": l8.get("peak_gpu_gib"),
                 "export_s": (rec("ft_export_8b") or {}).get("export_s"),
                 "export_peak_rss_gib": (rec("ft_export_8b") or {}).get("peak_rss_gib"),
                 "logits_max_rel_err": (rec("ft_compare_8b") or {}).get("max_rel_err"),
                 "argmax_agree": (rec("ft_compare_8b") or {}).get("argmax_agreement")})
keys = list(dict.fromkeys(k for r in rows for k in r))
fmt = lambda v: "-" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v)
print(" | ".join(keys))
for r in rows:
    print(" | ".join(fmt(r.get(k)) for k in keys))
EOF
