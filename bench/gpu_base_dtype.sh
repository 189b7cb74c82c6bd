#!/usr/bin/env bash
# Accuracy at equal rounds per base dtype (issue 56, item 3) on one lent GPU, in device calls that
# each carry at most 64 MiB (bench/gpu.md): the wheels the GPU image lacks, SST-2, and each model
# as its GGUF pack (`hiso cache pack --model NAME --gguf --part-size 56M`), a few parts a call.
#
#   bench/gpu_base_dtype.sh wheels DIR                install DIR/whl/*.whl into /tmp/site; copy DIR/sst2
#   bench/gpu_base_dtype.sh part DIR NAME             add DIR's parts (and manifest.json) to /tmp/x/NAME
#   bench/gpu_base_dtype.sh check                     torchao int8 and bitsandbytes NF4 on CUDA, tiny
#   bench/gpu_base_dtype.sh start NAME CONFIG JOBS    unpack /tmp/x/NAME, then `hiso compare` in the background
#   bench/gpu_base_dtype.sh collect WAIT_S            wait for the compares (at most WAIT_S), pack them into $OUT
#
# `start` runs the compare in its own session, so it goes on while later calls carry the
# next model's parts; the machine keeps it while calls follow within its idle release (30 s).
# The compares resume: a `start` again after a lost machine runs only what is missing. $EXTRA is
# added to the compare's command line (a check on a CPU: EXTRA="--device cpu --rounds 1").
set -u -o pipefail
X=${XDIR:-/tmp/x}
REPO=$PWD
mkdir -p "$X"
export PYTHONPATH=/tmp/site:$X/src HISO_CACHE_DIR=${HISO_CACHE_DIR:-/tmp/hiso-cache} PYTHONUNBUFFERED=1
cmd=${1:?usage: bench/gpu_base_dtype.sh wheels|part|check|start|collect ...}
shift
case $cmd in
  wheels)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$1"/whl/*.whl || exit 1
    if [ -d "$1/sst2" ]; then cp -r "$1/sst2" "$X/"; fi
    ls /tmp/site | grep -c dist-info
    ;;
  part)
    mkdir -p "$X/$2" && cp "$1"/* "$X/$2/" && ls "$X/$2" | wc -l
    ;;
  check)
    nvidia-smi -L; lscpu | grep -m1 'Model name'
    python3 - <<'EOF'
import torch, torchao, bitsandbytes as bnb, transformers
from torchao.quantization import Int8WeightOnlyConfig, quantize_
print("torch", torch.__version__, "torchao", torchao.__version__, "bnb", bnb.__version__, "transformers", transformers.__version__)
x = torch.randn(4, 64, device="cuda")
lin = torch.nn.Linear(64, 64).cuda()
ref = lin(x)
q8 = torch.nn.Sequential(torch.nn.Linear(64, 64)).cuda(); q8[0].load_state_dict(lin.state_dict())
quantize_(q8, Int8WeightOnlyConfig())
q4 = bnb.nn.Linear4bit(64, 64, compute_dtype=torch.float32, quant_type="nf4")
q4.load_state_dict(lin.state_dict()); q4 = q4.cuda()
print("int8 err", float((q8(x) - ref).abs().max()), "int4 err", float((q4(x) - ref).abs().max()))
EOF
    ;;
  start)
    name=$1 config=$2 jobs=$3
    rm -rf "$X/src" && cp -r "$REPO/src" "$X/src" && cp "$REPO/configs/$config" "$X/" || exit 1
    if [ -f "$X/$name/manifest.json" ] && [ ! -f "$X/$name.unpacked" ]; then
      python3 -m hiso.cli cache unpack "$X/$name" --quiet && touch "$X/$name.unpacked" || exit 1
    fi
    # a new session with every other descriptor closed: a child holding the tool's pipes would keep
    # the device call open until its timeout (seen: `setsid nohup ... &` held it 60 s)
    cd "$X" && python3 - "$X" "$config" "$name" "$jobs" ${EXTRA:-} <<'PY'
import subprocess, sys
x, config, name, jobs, *extra = sys.argv[1:]
cmd = [sys.executable, "-m", "hiso.cli", "compare", "--config", f"{x}/{config}", "--data-dir", f"{x}/sst2",
       "--out", f"{x}/runs/{name}", "--jobs", jobs, "--quiet", *extra]
subprocess.Popen(cmd, stdout=open(f"{x}/{name}.log", "w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                 start_new_session=True, close_fds=True)
PY
    sleep 5; echo "started $name: $(pgrep -fc 'hiso.cli compare') compare(s) running"
    ;;
  collect)
    wait_s=$1 t0=$(date +%s)
    while pgrep -f 'hiso.cli compare' > /dev/null && [ $(( $(date +%s) - t0 )) -lt "$wait_s" ]; do
      sleep 10
      echo "$(( $(date +%s) - t0 )) s: $(find "$X/runs" -name summary.json 2>/dev/null | wc -l) runs done"
    done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader 2>/dev/null
    for log in "$X"/*.log; do echo "== $log"; tail -n 5 "$log"; done
    mkdir -p "${OUT:-/tmp/out}"
    # the runs' logs, metrics and the compare's tables; not the models (model.pt, checkpoint.pt)
    (cd "$X" && tar czf "${OUT:-/tmp/out}/base_dtype_runs.tgz" --exclude='*.pt' runs ./*.log)
    ls -la "${OUT:-/tmp/out}"
    ;;
  *) echo "unknown step $cmd" >&2; exit 2 ;;
esac
