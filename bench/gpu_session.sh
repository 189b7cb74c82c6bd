#!/usr/bin/env bash
# Issue 21's GPU checks in one device call, most important first, within a time budget.
#
#   bench/gpu_session.sh XFER [BUDGET_S]      (on the device machine, from the repository root)
#
# XFER is the folder prepared here (bench/gpu.md, "One call"): whl/ (pydantic and what it needs,
# which the GPU image lacks), sst2/ (train.tsv, dev.tsv) and smollm2-shape/ (SmolLM2-135M's config
# and tokenizer, `bench/lm_shape.py save`). The model is built there with random weights of that
# shape (timings do not depend on the values; no weights travel). Each step has its own timeout;
# a step is skipped once BUDGET_S (default 330) seconds have passed, so the call ends well inside
# the tool's 10 minutes and leaves device time to run it again. Everything printed goes to
# $OUT/session.log (and the reply's output tail); each bench's JSON line to $OUT/results.jsonl.
# DEVICE=cpu LAYERS=2 runs the same steps on a CPU with a 2-layer model (a check of the script).
set -u -o pipefail
X=${1:?usage: bench/gpu_session.sh XFER [BUDGET_S]}
budget=${2:-330}
OUT=${OUT:-/tmp/gpu-session}
mkdir -p "$OUT"
log=$OUT/session.log
t0=$(date +%s)
exec > >(tee -a "$log") 2>&1

if ls "$X"/whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$X"/whl/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/bench HISO_CACHE_DIR=/tmp/hiso-cache PYTHONUNBUFFERED=1
nvidia-smi -L; python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
lscpu | grep -m1 'Model name'
D=$X/sst2
M=/tmp/smol
dev=${DEVICE:-cuda}

step() {  # step NAME TIMEOUT_S COMMAND...: run it unless the budget is spent; keep its JSON lines
  local name=$1 limit=$2; shift 2
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="a b": just those steps
  local used=$(( $(date +%s) - t0 ))
  if [ "$used" -ge "$budget" ]; then echo "== $name: skipped (budget spent: ${used} s)"; return; fi
  echo "== $name (at ${used} s, limit ${limit} s): $*"
  local s=$(date +%s)
  timeout -k 5 "$limit" "$@" > "$OUT/.step" 2>&1
  local rc=$?
  grep -v '^{' "$OUT/.step" | grep -v 'it/s\]' | tail -n 25
  grep '^{' "$OUT/.step" | sed "s/^{/{\"step\": \"$name\", /" >> "$OUT/results.jsonl"
  echo "== $name: exit $rc in $(( $(date +%s) - s )) s"
}

# --portable: the same weights bytes on any torch, so the runs below can be rebuilt on a CPU elsewhere
step build 90 python3 bench/lm_shape.py build "$X/smollm2-shape" --out $M --portable ${LAYERS:+--layers $LAYERS}
# the kernels and modes on CUDA: the grouped Philox shift has the CPU's bits, batched = hooks
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_philox.py tests/test_device.py tests/test_batched.py
# the "done when": a full-parameter HiSo round against its forwards alone, both modes
step round_hooks 75 python3 bench/llm_round.py --data-dir $D --model $M --device $dev --rounds 3 --autocast none --threads 8
step round_batched 75 python3 bench/llm_round.py --data-dir $D --model $M --device $dev --rounds 3 --autocast none --threads 8 --perturb-mode batched --batch-memory 8G
# a HiSo run on this device (LoRA with checkpoints, then full parameters), its state's digest and
# log into $OUT/rebuild.tgz: rebuilt on a CPU elsewhere, bit for bit (bench/gpu.md, "Rebuilt on a CPU")
runs() {
  local R=$OUT/rebuild; mkdir -p $R
  python3 -m hiso.cli run --task sst2 --model $M --data-dir $D --lora-r 8 --device $dev --rounds ${LORA_ROUNDS:-30} \
    --eval-every 10 --eval-max 128 --checkpoint-every 10 --threads 8 --out $R/lora --quiet || return 1
  python3 bench/state_digest.py $R/lora/model.pt $(ls $R/lora/checkpoint.pt 2>/dev/null) | tee $R/lora/digest.txt
  python3 -m hiso.cli run --task sst2 --model $M --data-dir $D --device $dev --rounds ${FULL_ROUNDS:-4} \
    --eval-every 4 --eval-max 64 --threads 8 --out $R/full --quiet || return 1
  python3 bench/state_digest.py $R/full/model.pt | tee $R/full/digest.txt
  rm -f $R/full/model.pt $R/full/checkpoint.pt
  tar czf $OUT/rebuild.tgz -C $R . && rm -rf $R
}
export M D dev OUT; export -f runs
step gpu_runs 150 bash -c runs
step grouped_shift 45 python3 bench/grouped_shift.py --device $dev --repeat 20 ${LAYERS:+--layers $LAYERS}
step modes_full 75 python3 bench/perturb_modes.py --data-dir $D --model $M --device $dev --reps 5 --threads 8 --batch-memory 8G
step resume_cost 60 python3 bench/resume_cost.py --data-dir $D --model $M --device $dev --threads 8 --rounds 5
step packing 60 python3 bench/llm_packing.py --data-dir $D --model $M --device $dev --lora-r 0 --batches 6
step modes_lora 60 python3 bench/perturb_modes.py --data-dir $D --model $M --device $dev --reps 5 --threads 8 --lora-r 8
step compile 120 python3 bench/llm_compile.py --data-dir $D --model $M --device $dev --mode reduce-overhead --threads 8
rm -f "$OUT/.step"
echo "== done in $(( $(date +%s) - t0 )) s; results: $OUT/results.jsonl"
