"""A user's method file edited after its runs: which part changed (client, server, fold, or
elsewhere) and whether the model its log gives can differ; ``hiso compare`` refuses the arms made
with the old file, naming them, or runs them again with ``--accept-method-change``."""

import json
import shutil
from pathlib import Path

import pytest

from cli_helpers import run_cli
from hiso.methods.identity import source_of, what_changed

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

HOOKS = '''
import numpy as np
from dataclasses import dataclass
from hiso.core.method import Method


def helper(g):
    return g


@dataclass(frozen=True)
class Mine(Method):
    """Every kind of hook, each the default rule written out."""

    def step_scalars(self, g):
        return helper(g)

    def combine(self, g, w, rule, trim):
        return np.mean(g, axis=0)

    def apply_(self, state, record):
        return None
'''


@pytest.mark.parametrize("old, new, words", [
    ("return helper(g)", "return 0.5 * helper(g)",
     "changed: client (step_scalars): the model its log gives is the same, but a run made now"),
    ("return np.mean(g, axis=0)", "return np.median(g, axis=0)",
     "changed: server (combine): the model its log gives is the same"),
    ("    def apply_(self, state, record):\n        return None", "    def apply_(self, state, record):\n        return 0",
     "changed: fold (apply_): the model its log gives can differ"),
    ("def helper(g):\n    return g", "def helper(g):\n    return -g",
     "changed outside its hooks (a helper, an import, a field), so any part may have: the model its log gives can"),
])
def test_what_changed_names_the_part_and_whether_the_model_can_differ(tmp_path, old, new, words):
    f = tmp_path / "mine.py"
    f.write_text(HOOKS)
    before = source_of(f"{f}:Mine")
    f.write_text(HOOKS.replace(old, new))
    assert what_changed(before, source_of(f"{f}:Mine")).startswith(words)
    digest_only = {k: v for k, v in before.items() if k != "parts"}  # a run recorded before parts were
    assert "cannot be told" in what_changed(digest_only, source_of(f"{f}:Mine"))


def _compare(capsys, conf, out, *extra):
    return run_cli(["compare", "--config", str(conf), "--out", str(out), "--quiet", *extra], capsys)


def test_compare_refuses_the_arms_of_an_edited_method_file_or_runs_them_again(tmp_path, capsys):
    mine = tmp_path / "mine.py"
    shutil.copyfile(EXAMPLES / "clip_method.py", mine)
    conf = tmp_path / "c.toml"
    conf.write_text(f'task = "quadratic"\ndim = 30\nclients = 4\nsampled = 2\nrounds = 3\neval_every = 3\n'
                    f'threads = 1\n\n[compare]\nalgorithms = ["decomfl", "clip"]\nreference = "decomfl"\n'
                    f'lr_grid = {{ decomfl = [0.05], clip = [0.05] }}\n[compare.variants]\n'
                    f'clip = {{ algorithm = "{mine}:ScalarClip", method_opts = {{ c = 0.5 }} }}\n')
    out = tmp_path / "cmp"
    code, _, err = _compare(capsys, conf, out)
    assert code == 0, err
    (arm_dir,) = out.glob("runs/clip/*/seed0")
    made = json.loads((arm_dir / "config.json").read_text())["method_source"]["sha256"]
    history = (arm_dir / "history.bin").read_bytes()
    mine.write_text(mine.read_text().replace("np.clip(", "0.5 * np.clip("))  # the client's step_scalars
    for extra in ([], ["--table-only"]):
        code, _, err = _compare(capsys, conf, out, *extra)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert "arm clip (1 run; mine.py changed: client (step_scalars)" in err and "decomfl" not in err, err
        assert "the model its log gives is the same" in err and "--accept-method-change" in err, err
    assert (arm_dir / "history.bin").read_bytes() == history  # nothing touched
    code, _, err = _compare(capsys, conf, out, "--accept-method-change")
    assert code == 0, err
    now = json.loads((arm_dir / "config.json").read_text())["method_source"]
    assert now["sha256"] != made and "accepted" not in now  # run again from round 0 with the file as it is
    assert (arm_dir / "history.bin").read_bytes() != history
    code, _, err = _compare(capsys, conf, out)  # and now it is the arm's own file: finished
    assert code == 0, err


def test_flower_resume_names_the_changed_part_and_records_an_accepted_change(tmp_path, capsys):
    pytest.importorskip("flwr", reason="the flower extra is not installed")
    from hiso.cli_flower import _record_accepted_method
    from hiso.runners.runfiles import saved_config
    mine = tmp_path / "mine.py"
    shutil.copyfile(EXAMPLES / "clip_method.py", mine)
    out = tmp_path / "r"
    code, _, err = run_cli(["run", "--quiet", "--task", "quadratic", "--dim", "30", "--clients", "4", "--sampled", "2",
                            "--rounds", "3", "--algorithm", f"{mine}:ScalarClip", "--out", str(out)], capsys)
    assert code == 0, err
    (out / "summary.json").unlink()  # as a run whose ServerApp died
    mine.write_text(mine.read_text().replace("np.clip(", "0.5 * np.clip("))
    code, _, err = run_cli(["flower", "--resume", str(out)], capsys)
    assert code == 2 and "client (step_scalars)" in err and "--accept-method-change" in err, err
    assert len(err.strip().splitlines()) == 1
    from hiso.methods.identity import ACCEPT
    token = ACCEPT.set(True)
    try:
        _record_accepted_method(out, saved_config(out)[0])
    finally:
        ACCEPT.reset(token)
    source = json.loads((out / "config.json").read_text())["method_source"]
    assert source["accepted"][0]["until_round"] == 3
    saved_config(out)  # the change is the run's now: read without the flag
