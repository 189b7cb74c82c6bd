"""The long runs of the crash and hostile-bytes tests: many more kill trials and Hypothesis examples.

Runs tests/test_crash.py's kill-and-resume trials (``--trials``, CI runs 200) and every
tests/test_hostile_bytes.py property with ``--examples`` Hypothesis examples each (CI: 60),
and prints the counts and the time each took. Needs the test extra (hypothesis).

    python bench/hostile_runs.py [--trials 2000] [--examples 5000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=2000)
    ap.add_argument("--examples", type=int, default=5000)
    args = ap.parse_args()
    env = {**os.environ, "HISO_CRASH_TRIALS": str(args.trials), "HISO_FUZZ_EXAMPLES": str(args.examples),
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    rc = 0
    for test, what in (("tests/test_crash.py", f"{args.trials} kill trials"),
                       ("tests/test_hostile_bytes.py", f"{args.examples} examples per property")):
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "pytest", test, "-q", "-s", "-p", "no:cacheprovider"], cwd=ROOT,
                           env=env, capture_output=True, text=True)
        lines = [ln for ln in r.stdout.splitlines() if "crash trials:" in ln or " passed" in ln or " failed" in ln]
        print(f"{test} ({what}): exit {r.returncode}, {time.perf_counter() - t0:.0f} s; " + " | ".join(lines))
        if r.returncode:
            print(r.stdout[-4000:])
        rc = rc or r.returncode
    sys.exit(rc)


if __name__ == "__main__":
    main()
