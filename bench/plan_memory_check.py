"""``hiso plan``'s client memory against ``bench/base_dtype.py``'s measured peaks.

    python bench/base_dtype.py ... > measured.jsonl
    python bench/plan_memory_check.py measured.jsonl [more.jsonl ...]

For each JSON line (model x base dtype x algorithm): plan's CPU estimate (runtime + the base at
that dtype + the method's state + the transient) beside the peak resident memory of the rounds
(``peak_rss_rounds_mb``, what plan models), the working set after them and loading's peak, in
MiB, and plan's error against the rounds' peak. Prints a markdown table.
"""

from __future__ import annotations

import json
import sys

from hiso.runners.plan import Deployment, plan
from hiso.runners.plan_memory import MiB, client_memory, structure


def main(paths: list[str]) -> None:
    print("| model | base | method | plan: model + state | plan: total | measured: rounds' peak | error "
          "| after the rounds | loading's peak |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|")
    cache = {}
    for path in paths:
        for line in open(path):
            r = json.loads(line)
            if "error" in r or "peak_rss_rounds_mb" not in r:
                continue
            key = (r["model"], r["lora_r"])
            s = cache.get(key) or cache.setdefault(key, structure(r["model"], r["lora_r"]))
            row = plan([r["algorithm"]], Deployment(s.lora, 6, 2, r["rounds"]))[0]
            m = client_memory(s, r["base_dtype"], row["client_bytes"], lora=True)
            est, got = m["cpu_total"] / MiB, r["peak_rss_rounds_mb"]
            print(f"| {r['model']} | {r['base_dtype']} | {r['algorithm']} | {m['held'] / MiB:,.0f} | {est:,.0f} "
                  f"| {got:,.0f} | {100 * (est - got) / got:+.1f} % | {r['rss_after_rounds_mb']:,.0f} "
                  f"| {r['peak_rss_after_load_mb']:,.0f} |")


if __name__ == "__main__":
    main(sys.argv[1:])
