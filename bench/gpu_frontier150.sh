#!/usr/bin/env bash
# Issue 42's 150-round SST-2 rows on a lent GPU, in one device call after the set-up call
# (bench/gpu.md, "The frontier's 150-round rows"). Usage, in the repository root there:
#   bash bench/gpu_frontier150.sh PART_DIR BUDGET_S [SEEDS] [JOBS]
# PART_DIR holds the pack's last part; /tmp/x/pack already holds the others and manifest.json,
# /tmp/x/sst2 the TSVs and /tmp/site the wheels (the set-up call). The compare runs for at most
# BUDGET_S seconds (SIGINT keeps every finished round), then the table at the last round every
# run logged, and $OUT/runs150.tgz (configs, logs, metrics, history: enough to resume) comes back.
set -u
PART_DIR=$1; BUDGET=$2; SEEDS=${3:-0,1,2}; JOBS=${4:-15}
DEVICE=${DEVICE:-cuda}; ROUNDS=${ROUNDS:-150}  # DEVICE=cpu ROUNDS=2: the dry run on a CPU
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site:$PWD/src HISO_CACHE_DIR=/tmp/hiso-cache PYTHONUNBUFFERED=1
LOG=$OUT/session.log
exec > >(tee -a "$LOG") 2>&1
t0=$(date +%s)
echo "== $(date -u) $(nvidia-smi -L 2>/dev/null | head -1); $(nproc) cores"
bash bench/gpu_unpack.sh "$PART_DIR"
echo "== unpacked after $(( $(date +%s) - t0 )) s"
nvidia-smi dmon -s um -d 10 > "$OUT/dmon.txt" 2>&1 &
left=$(( BUDGET - ($(date +%s) - t0) - 45 ))
C="--config configs/frontier_sst2.toml --data-dir /tmp/x/sst2 --out /tmp/runs150"
ARMS="--algorithms decomfl,sketch1d,sketch1t4d,fedavg,ferret --lr-grid decomfl=0.01 --lr-grid sketch1d=0.2
 --lr-grid sketch1t4d=0.1 --lr-grid fedavg=0.1 --lr-grid ferret=0.1"
echo "== compare for at most $left s: seeds $SEEDS, $JOBS jobs"
timeout -s INT "$left" python3 -m hiso.cli compare $C $ARMS --rounds "$ROUNDS" --eval-every 10 --seeds "$SEEDS" \
  --jobs "$JOBS" --device "$DEVICE" --quiet
echo "== compare rc $? after $(( $(date +%s) - t0 )) s"
timeout 30 python3 -m hiso.cli compare --out /tmp/runs150 --table-only --at-round latest || true
kill %1 2>/dev/null
tar czf "$OUT/runs150.tgz" --exclude=model.pt --exclude=checkpoint.pt -C /tmp runs150
for f in /tmp/runs150/runs/*/*/seed*/metrics.jsonl; do
  echo "$f $(tail -1 "$f" | cut -c1-160)"
done
echo "== done after $(( $(date +%s) - t0 )) s"
