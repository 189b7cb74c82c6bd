"""Accuracy at equal rounds per base dtype, from `hiso compare` directories (issue 56, item 3).

    python bench/base_dtype_accuracy.py runs/base_dtype_sst2 runs/base_dtype_sst2_gemma --plot docs/img/base_dtype_acc.png

Each run is read from its own config.json (model, algorithm, base_dtype), so arm names do not
matter. Prints one markdown row per model x method x dtype: seeds, accuracy at the last round
(mean, each seed in seed order), its mean gap to the same method on a float32 base over the seeds
both have, the best accuracy over the
evaluated rounds, the evaluation loss before training and at the end, and seconds a round. The
plot draws mean accuracy against rounds, a panel per model x method, a line per dtype.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

DTYPES = ("float32", "bfloat16", "int8", "int4")


def read_runs(roots: list[Path]) -> dict:
    """(model, method, dtype) -> list of (metrics rows, summary) over the seeds found."""
    runs = defaultdict(list)
    for root in roots:
        for summary in sorted(root.glob("runs/*/*/seed*/summary.json")):
            cfg = json.loads((summary.parent / "config.json").read_text())
            cfg = cfg.get("config", cfg)
            bits = (cfg.get("method_opts") or {}).get("sketch_bits", cfg.get("sketch_bits"))  # (flat before schema 4)
            method = cfg["algorithm"] + ("1" if cfg["algorithm"] == "sketch" and bits == 1 else "")
            rows = [json.loads(x) for x in (summary.parent / "metrics.jsonl").read_text().splitlines() if x.strip()]
            s = json.loads(summary.read_text())
            s["seed"] = cfg["seed"]
            runs[(cfg["model"], method, cfg.get("base_dtype", "float32"))].append((rows, s))
    return runs


def _evals(rows: list[dict], key: str) -> dict[int, float]:
    return {r["round"]: r[key] for r in rows if r.get(key) is not None}


def table(runs: dict) -> str:
    """The markdown table (mean over the seeds each cell has; gaps against float32's mean)."""
    out = ["| model | method | base | seeds | accuracy at the last round | gap to float32, same seeds | best | "
           "eval loss before -> after | s / round |", "|---|---|---|---:|---|---:|---:|---|---:|"]
    for key in sorted(runs, key=lambda k: (k[0], k[1], DTYPES.index(k[2]))):
        model, method, dtype = key
        v = sorted(runs[key], key=lambda x: x[1]["seed"])
        accs = [s["final"]["eval_acc"] * 100 for _, s in v]
        ref = {s["seed"]: s["final"]["eval_acc"] * 100 for _, s in runs.get((model, method, "float32"), [])}
        pairs = [(s["final"]["eval_acc"] * 100, ref[s["seed"]]) for _, s in v if s["seed"] in ref]
        gap = "" if not pairs or dtype == "float32" else \
            f"{statistics.mean(a - b for a, b in pairs):+.1f} ({len(pairs)})"
        loss0 = statistics.mean(_evals(r, "eval_loss").get(0, float("nan")) for r, _ in v)
        loss1 = statistics.mean(s["final"].get("eval_loss", float("nan")) for _, s in v)
        best = statistics.mean(s["best"]["eval_acc"] for _, s in v) * 100
        spr = statistics.mean(s["s_per_round"] for _, s in v)
        each = ", ".join(f"{a:.1f}" for a in accs)
        out.append(f"| {model} | {method} | {dtype} | {len(v)} | {statistics.mean(accs):.1f} ({each}) | {gap} | "
                   f"{best:.1f} | {loss0:.3f} -> {loss1:.3f} | {spr:.2f} |")
    return "\n".join(out)


def plot(runs: dict, path: Path) -> None:
    """Mean accuracy against rounds: a panel per model x method, a line per dtype."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(m, a) for m, a, _ in runs})
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.0), sharey=True, squeeze=False)
    for ax, (model, method) in zip(axes[0], panels):
        for dtype in DTYPES:
            v = runs.get((model, method, dtype))
            if not v:
                continue
            curves = [_evals(r, "eval_acc") for r, _ in v]
            rounds = sorted(set.intersection(*(set(c) for c in curves)))
            ax.plot(rounds, [100 * statistics.mean(c[t] for c in curves) for t in rounds], marker=".",
                    color=f"C{DTYPES.index(dtype)}", label=f"{dtype} ({len(v)})")
        ax.set_title(f"{model}\n{method}", fontsize=9)
        ax.set_xlabel("round")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("eval accuracy (%), mean over seeds")
    for ax in axes[0]:
        ax.legend(fontsize=6, title="base (seeds)", title_fontsize=6)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dirs", nargs="+", type=Path, help="hiso compare --out directories")
    ap.add_argument("--plot", type=Path, help="write the accuracy curves here (PNG)")
    args = ap.parse_args()
    runs = read_runs(args.dirs)
    if not runs:
        raise SystemExit(f"no runs under {', '.join(map(str, args.dirs))}")
    print(table(runs))
    if args.plot:
        plot(runs, args.plot)


if __name__ == "__main__":
    main()
