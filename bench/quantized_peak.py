"""The peak resident memory of a whole client process per base dtype, as a user measures it.

    python bench/quantized_peak.py --data-dir ../shared/data/sst2
    python bench/quantized_peak.py --data-dir ../shared/data/sst2 --dtypes int4 --drop torchao,kernels,triton

Each row is one process under ``/usr/bin/time -v`` (its "Maximum resident set size"): first the
runtime's floors (Python with torch, transformers and peft imported, nothing loaded; then with
what a run imports before it loads a model: hiso, the model's transformers code, torchao and
bitsandbytes), then per ``--dtypes`` a ``hiso run`` of ``--rounds`` rounds of SST-2 with LoRA
(``--clients`` clients, 2 sampled a round, one process: hiso's in-process federation), the same
command for every dtype but ``--base-dtype``. Beside each run, ``hiso plan``'s predicted peak
(loading's and the rounds', the larger of the two) and its error. A short name's GGUF is
dequantized once into the cache before the rows (that one-time conversion is not a client's).

``--drop`` runs every row as if the named packages were not installed (a copy of site-packages
without them, Python started with ``-S``): what a user who needs none of them saves (torchao and
bitsandbytes are needed by int8 and int4 bases only; transformers imports whatever it finds).
``--runtime`` runs the same ``hiso run`` per dtype on a tiny 2-layer LM with a word-level
vocabulary instead (tests/lm_fixtures.py; its tensors are a few KiB): the process with no model
to speak of, which ``hiso plan``'s ``RUNTIME_PROCESS`` stands for (plan adds the tokenizer per
vocabulary entry, the model, the state and one answer's transient on top).
One JSON line per row; ``--markdown`` also prints the table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
FLOORS = {
    "floor: import torch, transformers, peft": "import torch, transformers, peft",
    "floor: import torch, transformers, the model's code (no peft)":
        "import torch, transformers, transformers.models.llama.modeling_llama",
    "floor: + hiso, peft, torchao, bitsandbytes (a run before loading)":
        "import importlib.util as u, hiso.cli, torch, transformers, transformers.models.llama.modeling_llama\n"
        "for m in ('peft', 'torchao', 'bitsandbytes'):\n    __import__(m) if u.find_spec(m) else None",
}


def _site_without(drop: list[str], into: Path) -> Path:
    """A directory of links to site-packages' entries, the ``drop`` packages (and their metadata) left out."""
    site = Path(sysconfig.get_paths()["purelib"])
    into.mkdir(parents=True)
    norm = {d.lower().replace("-", "_") for d in drop}
    for entry in site.iterdir():
        top = re.split(r"[-.]", entry.name, maxsplit=1)[0].lower().replace("-", "_")
        if top in norm or entry.suffix == ".pth":
            continue
        (into / entry.name).symlink_to(entry)
    return into


def _timed(cmd: list[str], env: dict, cwd: str) -> tuple[float | None, str]:
    r = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True, env=env, cwd=cwd)
    m = re.search(r"Maximum resident set size \(kbytes\): (\d+)", r.stderr)
    ok = r.returncode == 0 and m
    return (int(m.group(1)) / 1024 if ok else None), ("" if ok else (r.stderr.strip().splitlines() or ["?"])[-1])


def _predicted(args, dtype: str) -> dict:
    """hiso plan's CPU client peaks (MiB) for the run: loading's, the rounds', which is larger."""
    if str(SRC) not in sys.path:
        sys.path.insert(0, str(SRC))
    from hiso.runners.plan import Deployment, plan
    from hiso.runners.plan_memory import MiB, client_memory, structure

    s = structure(args.model, args.lora_r)
    row = plan([args.algorithm], Deployment(s.lora, args.clients, 2, args.rounds))[0]
    m = client_memory(s, dtype, row["client_bytes"], lora=True)
    return {"plan_loading_mib": m["cpu_loading"] / MiB, "plan_rounds_mib": m["cpu_total"] / MiB,
            "plan_peak_mib": m["cpu_peak"] / MiB, "plan_larger": m["cpu_larger"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtypes", default="float32,bfloat16,int8,int4")
    ap.add_argument("--algorithm", default="decomfl")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--eval-max", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drop", default="", help="packages to run without, comma-separated (e.g. torchao,kernels)")
    ap.add_argument("--no-floor", action="store_true", help="only the runs")
    ap.add_argument("--runtime", action="store_true",
                    help="instead of the model's runs, the same runs of a tiny LM: hiso plan's RUNTIME_PROCESS")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="quantized_peak-"))
    env = dict(os.environ, PYTHONPATH=str(SRC), HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    py = [sys.executable]
    drop = [d for d in args.drop.split(",") if d]
    if drop:
        site = _site_without(drop, tmp / "site")
        env["PYTHONPATH"] = f"{SRC}{os.pathsep}{site}"
        py = [sys.executable, "-S"]
    if args.dtypes:  # the one-time GGUF conversion, if any
        subprocess.run([*py, "-c", f"from hiso.tasks import lm; lm.resolve_model({args.model!r})"], env=env,
                       check=True, capture_output=True)
    rows = []
    if not args.no_floor:
        for label, code in FLOORS.items():
            peak, err = _timed([*py, "-c", code], env, str(tmp))
            rows.append({"row": label, "peak_rss_mib": peak, **({"error": err} if err else {})})
            print(json.dumps(rows[-1] | {"drop": drop}), flush=True)
    def run_cmd(model: str, dtype: str, out: str) -> list[str]:
        return [*py, "-m", "hiso.cli", "run", "--task", "sst2", "--model", model, "--data-dir", args.data_dir,
                "--algorithm", args.algorithm, "--lora-r", str(args.lora_r), "--clients", str(args.clients),
                "--sampled", "2", "--rounds", str(args.rounds), "--lr", "1e-2", "--eval-max", str(args.eval_max),
                "--threads", str(args.threads), "--base-dtype", dtype, "--out", str(tmp / out), "--quiet"]

    if args.runtime:  # what plan's RUNTIME_PROCESS stands for: the same run, of a model of a few KiB
        sys.path.insert(0, str(SRC.parent / "tests"))
        from lm_fixtures import write_tiny_lm

        tiny = write_tiny_lm(tmp / "tiny-lm")
        for dtype in [d for d in args.dtypes.split(",") if d]:
            peak, err = _timed(run_cmd(str(tiny), dtype, f"tiny-{dtype}"), env, str(tmp))
            rows.append({"row": f"runtime: hiso run of a tiny LM (word vocabulary), base {dtype}",
                         "peak_rss_mib": peak, **({"error": err} if err else {})})
            print(json.dumps(rows[-1] | {"drop": drop}), flush=True)
        return
    for dtype in [d for d in args.dtypes.split(",") if d]:
        peak, err = _timed(run_cmd(args.model, dtype, f"run-{dtype}"), env, str(tmp))
        row = {"row": f"hiso run, base {dtype}", "base_dtype": dtype, "peak_rss_mib": peak, **_predicted(args, dtype)}
        if peak:
            row["plan_error_pct"] = 100 * (row["plan_peak_mib"] - peak) / peak
        rows.append(row | ({"error": err} if err else {}))
        print(json.dumps(rows[-1] | {"drop": drop}), flush=True)
    if args.markdown:
        f32 = next((r["peak_rss_mib"] for r in rows if r.get("base_dtype") == "float32"), None)
        print("\n| process | peak RSS | x float32's | plan: loading, rounds (larger) | plan's error |")
        print("|---|---:|---:|---:|---:|")
        for r in rows:
            p = r["peak_rss_mib"]
            cells = [r["row"], f"{p:,.0f} MiB" if p else r.get("error", "?"),
                     f"{p / f32:.2f}" if p and f32 and "base_dtype" in r else "",
                     f"{r['plan_loading_mib']:,.0f}, {r['plan_rounds_mib']:,.0f} ({r['plan_larger']})"
                     if "plan_peak_mib" in r else "",
                     f"{r['plan_error_pct']:+.1f} %" if "plan_error_pct" in r else ""]
            print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
