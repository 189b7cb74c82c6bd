"""Eval accuracy and loss against rounds of runs laid out by ``bench/paper_rows.sh``, as one PNG,
with the paper's rounds for a row drawn as vertical lines; prints the rounds-to-reach table.

    python bench/row_curves.py /tmp/row --out docs/img/sst2_full_gpu_curves.png --paper "DeComFL=2125,HiSo=1025"

Runs still going are fine: each curve ends at its last evaluation. "Reaches" is the first
evaluated round at which HiSo's value is at least the reference's best so far (accuracy) or at
most it (loss), over the reference's logged rounds.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def curves(root: Path) -> dict[str, dict[int, tuple[float, float]]]:
    out = {}
    for m in sorted(root.glob("runs/*/*/seed*/metrics.jsonl")):
        algo, lr, seed = m.parts[-4], m.parts[-3][2:], m.parts[-2]
        rows = (json.loads(line) for line in m.read_text().splitlines() if line.strip())
        ev = {r["round"]: (r["eval_acc"], r["eval_loss"]) for r in rows if r.get("eval_acc") is not None}
        out[f"{'HiSo' if algo == 'hiso' else 'DeComFL' if algo == 'decomfl' else algo} {float(lr):g} ({seed})"] = ev
    return out


def reach(ev: dict, best: float, higher: bool, k: int) -> int | None:
    return next((r for r in sorted(ev) if (ev[r][k] >= best if higher else ev[r][k] <= best)), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--out", required=True)
    ap.add_argument("--paper", default="", help="NAME=ROUND,... drawn as vertical lines")
    ap.add_argument("--title", default="SST-2, SmolLM2-135M, all parameters, seed 0")
    args = ap.parse_args()
    data = curves(args.root)
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for name, ev in data.items():
        rs = sorted(ev)
        axes[0].plot(rs, [100 * ev[r][0] for r in rs], label=name)
        axes[1].plot(rs, [ev[r][1] for r in rs], label=name)
    for spec in filter(None, args.paper.split(",")):
        name, r = spec.split("=")
        for ax in axes:
            ax.axvline(int(r), ls=":", c="gray")
            ax.text(int(r), ax.get_ylim()[1], f" paper {name}", rotation=90, va="top", fontsize=7, c="gray")
    axes[0].set(xlabel="round", ylabel="eval accuracy (%)")
    axes[1].set(xlabel="round", ylabel="eval loss")
    axes[0].legend(fontsize=8)
    fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    hiso = next((ev for n, ev in data.items() if n.startswith("HiSo")), None)
    print("| reference | logged to | best accuracy (round) | HiSo reaches it | best loss (round) | HiSo reaches it |")
    print("|---|---:|---|---:|---|---:|")
    for name, ev in data.items():
        if name.startswith("HiSo") or hiso is None:
            continue
        acc = max(v[0] for v in ev.values())
        loss = min(v[1] for v in ev.values())
        ra, rl = min(r for r in ev if ev[r][0] == acc), min(r for r in ev if ev[r][1] == loss)
        ha, hl = reach(hiso, acc, True, 0), reach(hiso, loss, False, 1)
        fa = f"{ha} ({ra / ha:.2f}x)" if ha else "not yet"
        fl = f"{hl} ({rl / hl:.2f}x)" if hl else "not yet"
        print(f"| {name} | {max(ev)} | {100 * acc:.1f} % ({ra}) | {fa} | {loss:.3f} ({rl}) | {fl} |")


if __name__ == "__main__":
    main()
