#!/usr/bin/env bash
# Many hiso runs side by side, each stopped after SECONDS and resumed by the next call: runs longer
# than one command's time limit (a lent GPU machine allows 10 minutes a command).
#
#   bench/paper_rows.sh CONFIG RUNS SECONDS "ALGO:LR,LR ALGO:LR" "SEEDS" [hiso run flags...]
#   bench/paper_rows.sh configs/sst2_full_gpu.toml /tmp/runs 540 "decomfl:5e-6 hiso:5e-5" "0 1 2" --data-dir sst2
#
# Every (algorithm, lr, seed) is one `hiso run` process into RUNS/runs/ALGO/lrLR/seedSEED (the layout
# of `hiso compare --out RUNS`, which then finds them finished and only tabulates), all started at
# once (one GPU holds them all; each uses one CPU thread). A run with a config.json is continued
# with `hiso run --resume` (every logged round kept, bit for bit the uninterrupted run), a run with
# a summary.json is skipped. Each process gets SIGINT after SECONDS (then SIGKILL 30 s later: a
# killed run loses at most its round in flight). Prints each run's last logged round and accuracy,
# and "all finished" when nothing is left to run. Each run writes its server state every $CKPT
# (default 2m) to checkpoint.pt, so a resume replays only the rounds after the last one, not the
# whole log. Needs `python3 -m hiso.cli` importable (PYTHONPATH=src) and $PYTHON if python3 is not
# the interpreter to use.
set -u
if [ $# -lt 5 ]; then sed -n 2,17p "$0"; exit 2; fi
config=$1 runs=$2 secs=$3 grid=$4 seeds=$5
shift 5
py=${PYTHON:-python3}
ckpt=${CKPT:-2m}
mkdir -p "$runs"
planned=()
for spec in $grid; do
  algo=${spec%%:*}
  for lr in $(echo "${spec#*:}" | tr ',' ' '); do
    lr=$("$py" -c "print(repr(float('$lr')))")  # compare's spelling: 5e-06
    for seed in $seeds; do planned+=("$algo $lr $seed"); done
  done
done
started=0
for p in "${planned[@]}"; do
  read -r algo lr seed <<<"$p"
  d=$runs/runs/$algo/lr$lr/seed$seed
  mkdir -p "$(dirname "$d")"
  [ -f "$d/summary.json" ] && continue
  if [ -f "$d/config.json" ]; then
    timeout -s INT -k 30 "$secs" "$py" -m hiso.cli run --resume "$d" --checkpoint-every "$ckpt" --quiet >>"$d.log" 2>&1 &
  else
    timeout -s INT -k 30 "$secs" "$py" -m hiso.cli run --config "$config" --algorithm "$algo" --lr "$lr" \
      --seed "$seed" --out "$d" --force --checkpoint-every "$ckpt" --quiet "$@" >>"$d.log" 2>&1 &
  fi
  started=$((started + 1))
done
echo "$(date -u +%H:%M:%S) started $started runs for at most $secs s"
wait 2>/dev/null
left=0
for p in "${planned[@]}"; do
  read -r algo lr seed <<<"$p"
  d=$runs/runs/$algo/lr$lr/seed$seed
  rounds=$(grep -c . "$d/metrics.jsonl" 2>/dev/null)
  acc=$(grep eval_acc "$d/metrics.jsonl" 2>/dev/null | tail -1 | sed -n 's/.*"eval_acc": *\([0-9.]*\).*/\1/p')
  if [ -f "$d/summary.json" ]; then state=finished; else state=unfinished; left=$((left + 1)); fi
  echo "$algo lr $lr seed $seed: $state, $((${rounds:-1} - 1)) rounds logged, last eval_acc ${acc:-?}; $(tail -c 300 "$d.log" 2>/dev/null | tr '\r' '\n' | grep . | tail -1)"
done
[ "$left" -eq 0 ] && echo "all finished"
exit 0
