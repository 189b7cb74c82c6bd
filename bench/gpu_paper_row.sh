#!/usr/bin/env bash
# Issue 58 on a lent GPU, in one device call after the set-up call (bench/gpu.md, "The paper row
# with real weights"): the grouped fold against the per-tensor fold, a round against its forwards,
# and the paper's SST-2 full-parameter row (SmolLM2-135M, real weights) for the rest of the budget.
#
#   bash bench/gpu_paper_row.sh PART_DIR BUDGET_S
#
# PART_DIR holds the pack's last part; /tmp/x/pack already holds the others and manifest.json,
# /tmp/x/sst2 the TSVs, /tmp/site the wheels (the set-up call). The rows run side by side
# (bench/paper_rows.sh: DeComFL at the authors' 5e-6 and the 1e-5 control, HiSo at 5e-5, seed 0,
# evaluation on 200 dev sentences every 25 rounds, as the CPU rows of docs/results/language.md),
# each stopped by SIGINT before the budget ends with a checkpoint at most a minute old; the CUDA
# tests run beside them. $OUT/row.tgz brings back each run's config, log, metrics, history and
# its checkpoint's digest (bench/state_digest.py): rebuilt on a CPU at the checkpoint's round, the
# digests must match. A later call resumes the rows with the same command (after unpacking
# row.tgz into /tmp/row). DEVICE=cpu LAYERS=... is not supported: this needs the real weights.
#
# MODEL (default smollm2-135m), GRID (default "decomfl:5e-6,1e-5 hiso:5e-5"), SEEDS (default 0) and
# ROW (default /tmp/row) choose the row; BENCHES=0 skips the fold and round benches (their ~2 min go
# to the rows); TAIL_S (default 50) is what the stop, the digests and the tar get at the end.
# Gemma-3-270M's row: MODEL=gemma3-270m GRID="decomfl:5e-6,2e-5 hiso:5e-5" BENCHES=0.
set -u
PART_DIR=$1; BUDGET=$2
DEVICE=${DEVICE:-cuda}
MODEL=${MODEL:-smollm2-135m}; GRID=${GRID:-"decomfl:5e-6,1e-5 hiso:5e-5"}; SEEDS=${SEEDS:-0}
ROW=${ROW:-/tmp/row}; BENCHES=${BENCHES:-1}; TAIL_S=${TAIL_S:-50}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench HISO_CACHE_DIR=/tmp/hiso-cache PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/session.log") 2>&1
t0=$(date +%s)
el() { echo $(( $(date +%s) - t0 )); }
echo "== $(date -u) $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null); $(nproc) cores"
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__)"
bash bench/gpu_unpack.sh "$PART_DIR"
echo "== unpacked at $(el) s"
D=/tmp/x/sst2
if [ "$BENCHES" = 1 ]; then
  timeout 60 python3 bench/fold_grouped.py --device "$DEVICE" --rounds 12 | tee -a "$OUT/results.txt"
  echo "== fold bench done at $(el) s"
  timeout 75 python3 bench/llm_round.py --data-dir $D --model "$MODEL" --device "$DEVICE" --rounds 3 --autocast none \
    --threads 8 --perturb-mode batched --batch-memory 8G 2>&1 | grep -v 'it/s\]' | tail -n 30 | tee -a "$OUT/results.txt"
  echo "== round bench done at $(el) s"
fi
left=$(( BUDGET - $(el) - TAIL_S ))
echo "== rows for $left s"
nvidia-smi dmon -s um -d 10 > "$OUT/dmon.txt" 2>&1 &
dmon=$!
CKPT=1m bash bench/paper_rows.sh configs/sst2_full_gpu.toml "$ROW" "$left" "$GRID" "$SEEDS" \
  --model "$MODEL" --data-dir $D --eval-every 25 --eval-max 200 --device "$DEVICE" > "$OUT/rows.txt" 2>&1 &
rows=$!
timeout $(( left - 10 )) python3 -m pytest -q -p no:cacheprovider tests/test_fold_grouped.py tests/test_philox.py \
  tests/test_device.py tests/test_batched.py 2>&1 | tail -n 15
echo "== tests done at $(el) s"
wait $rows
kill $dmon 2>/dev/null
cat "$OUT/rows.txt"
for d in "$ROW"/runs/*/*/seed*/; do
  d=${d%/}
  [ -f "$d/checkpoint.pt" ] || { echo "$d: no checkpoint"; continue; }
  python3 bench/state_digest.py "$d/checkpoint.pt" | tee "$d/digest.txt"
  python3 -c "import torch,sys; print('checkpoint round', torch.load(sys.argv[1], map_location='cpu', weights_only=True)['state']['round'])" "$d/checkpoint.pt" | tee -a "$d/digest.txt"
done
tar czf "$OUT/row.tgz" --exclude=model.pt --exclude=checkpoint.pt -C "$(dirname "$ROW")" "$(basename "$ROW")"
echo "== done at $(el) s"
