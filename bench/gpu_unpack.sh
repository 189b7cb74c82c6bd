#!/usr/bin/env bash
# The model pack in /tmp/x/pack (the set-up call's parts plus PART_DIR's) unpacked into hiso's
# cache on a lent GPU machine: checked against the weights' fingerprint, or, where that machine's
# transformers dequantizes to other numbers, used anyway with both fingerprints printed (say so
# beside the results). Run by bench/gpu_frontier150.sh and bench/gpu_paper_row.sh.
#   bash bench/gpu_unpack.sh PART_DIR
set -u
cp "$1"/* /tmp/x/pack/
if ! python3 -m hiso.cli cache unpack /tmp/x/pack --quiet; then
  python3 - <<'EOF'
import shutil
from pathlib import Path
from hiso.tasks import lm, lm_pack
src = Path("/tmp/x/pack"); m = lm_pack.verify(src, True)
tmp = Path("/tmp/unp"); lm_pack.reassemble(src, m, tmp / "pack", True)
dest = lm_pack.default_target(m); dest.parent.mkdir(parents=True, exist_ok=True)
lm.dequantize_gguf(tmp / "pack" / m["gguf"], dest)
for e in m["files"]:
    if e["path"] != m["gguf"]:
        shutil.copyfile(tmp / "pack" / e["path"], dest / e["path"])
print("UNCHECKED WEIGHTS: fingerprint here", lm_pack.weights_fingerprint(dest), "packed", m["weights_fingerprint"])
EOF
fi
