#!/usr/bin/env bash
# One round's cost before and after a change of the round's driver, in one run, interleaved.
#
#   bench/round_before_after.sh XFER BEFORE_SRC [PAIRS] [DEVICE]
#
# XFER as for bench/gpu_session.sh (whl/, sst2/, smollm2-shape/); BEFORE_SRC: the src/ directory
# of the checkout to compare against (e.g. `git archive COMMIT src | tar -x -C DIR`). Builds the
# SmolLM2-shaped model with portable random weights, then runs bench/llm_round.py (full parameters,
# HiSo, batched perturbation on CUDA, hooks on the CPU) PAIRS times for each source, alternating,
# and prints each run's JSON line tagged "before"/"after" and the median round/forwards ratio.
set -u -o pipefail
X=${1:?usage: bench/round_before_after.sh XFER BEFORE_SRC [PAIRS] [DEVICE]}
BEFORE=$(cd "${2:?BEFORE_SRC}" && pwd)
pairs=${3:-3}
dev=${4:-cuda}
OUT=${OUT:-/tmp/round-before-after}
mkdir -p "$OUT"
if ls "$X"/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$X"/whl/*.whl || exit 1
fi
export HISO_CACHE_DIR=/tmp/hiso-cache PYTHONUNBUFFERED=1
site=/tmp/site
M=/tmp/smol
PYTHONPATH=$site:$PWD/src:$PWD/bench python3 bench/lm_shape.py build "$X/smollm2-shape" --out $M --portable ${LAYERS:+--layers $LAYERS} || exit 1
mode=(--perturb-mode batched --batch-memory 8G)
[ "$dev" = cpu ] && mode=(--perturb-mode hooks)
for i in $(seq "$pairs"); do
  for which in before after; do
    src=$PWD/src; [ $which = before ] && src=$BEFORE
    PYTHONPATH=$site:$src:$PWD/bench timeout -k 5 150 python3 bench/llm_round.py --data-dir "$X/sst2" --model $M \
      --device "$dev" --rounds ${ROUNDS:-3} --autocast none --threads ${THREADS:-8} "${mode[@]}" 2>/dev/null \
      | grep '^{' | sed "s/^{/{\"src\": \"$which\", /" | tee -a "$OUT/before_after.jsonl"
  done
done
python3 - "$OUT/before_after.jsonl" <<'PY'
import json, statistics, sys
rows = [json.loads(x) for x in open(sys.argv[1])]
def pick(r):  # the round's seconds against its forwards alone, whatever the bench names it
    return r.get("round_over_forwards_alone")
for w in ("before", "after"):
    v = [pick(r) for r in rows if r["src"] == w and pick(r) is not None]
    s = [r["s_per_round"] for r in rows if r["src"] == w]
    print(w, "round/forwards median", statistics.median(v) if v else None, "runs", [round(x, 3) for x in v],
          "s/round median", statistics.median(s) if s else None)
PY
