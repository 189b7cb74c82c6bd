"""``hiso export``: the exported model is hiso's model (logits of transformers' and peft's loads equal
hiso's), at any round, names its run and base, and bad input writes nothing. Tiny LM, no downloads."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("safetensors")

from lm_fixtures import write_sst2, write_tiny_lm  # noqa: E402

from cli_helpers import run_cli  # noqa: E402
from hiso.cli import main  # noqa: E402
from hiso.runners.runmodel import load_run_model  # noqa: E402

IDS = torch.tensor([[9, 10, 11, 12, 13, 14], [15, 16, 17, 18, 19, 20]])


def _lm_run(files, out, *extra):
    args = ["run", "--task", "sst2", "--model", files["lm"], "--data-dir", files["sst2"],
            "--label-words", " terrible, great", "--clients", "3", "--sampled", "2", "--rounds", "4",
            "--eval-every", "2", "--min-size", "2", "--mu", "1e-2", "--batch-size", "4", "--out", str(out),
            "--quiet", *extra]
    assert main(args) == 0
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    files = {"lm": str(write_tiny_lm(d / "lm")), "sst2": str(write_sst2(d / "sst2"))}
    return {"files": files, "root": d,
            "lora": _lm_run(files, d / "lora", "--lora-r", "2", "--lr", "0.5"),
            "full": _lm_run(files, d / "full", "--lr", "0.05")}


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(input_ids=ids).logits


def _hiso_logits(run, rnd=None):
    return _logits(load_run_model(run, rnd).model)


@pytest.mark.parametrize("kind,rnd", [("lora", None), ("lora", 2), ("full", None)])
def test_merged_export_loaded_by_transformers_gives_hisos_logits(runs, tmp_path, capsys, kind, rnd):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "merged"
    code, stdout, err = run_cli(["export", str(runs[kind]), "--out", str(out), "--format", "merged",
                                 *(["--round", str(rnd)] if rnd is not None else [])], capsys)
    assert code == 0 and f"round {rnd or 4}" in stdout, err
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    ours = _hiso_logits(runs[kind], rnd)
    assert torch.allclose(_logits(loaded), ours, atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(runs["files"]["lm"]).eval()
    assert not torch.allclose(_logits(base), ours, atol=1e-4)  # training moved it: the check bites
    assert AutoTokenizer.from_pretrained(out)("a good film").input_ids
    info = json.loads((runs[kind] / "config.json").read_text())["task_info"]
    meta = json.loads((out / "config.json").read_text())["hiso"]
    assert meta["base_fingerprint"] == info["base_fingerprint"] and meta["round"] == (rnd or 4)
    assert meta["algorithm"] == "hiso" and len(meta["config_sha256"]) == 64
    assert info["base_fingerprint"] in (out / "README.md").read_text()
    written = json.loads((out / "hiso.json").read_text())
    assert written.pop("files") == sorted(p.name for p in out.iterdir()) and written == meta
    assert not any(p.name.startswith(".merged") for p in tmp_path.iterdir())  # no temp dir left


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_the_model_of_round_r_is_the_rebuilt_x_r(runs, kind):
    from hiso.core.state import trainable_params
    from hiso.runners.rundir import rebuild

    for rnd in (2, None):
        want = rebuild(runs[kind], round=rnd)[1]["model"] if rnd else torch.load(runs[kind] / "model.pt")["model"]
        got = dict(trainable_params(load_run_model(runs[kind], rnd).model))
        assert got and all(torch.equal(got[k], want[k]) for k in got)  # (want also has tied copies)
    assert not torch.allclose(_hiso_logits(runs[kind], 2), _hiso_logits(runs[kind]), atol=1e-6)


def test_peft_export_on_its_base_gives_hisos_logits(runs, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "adapter"
    code, _, err = run_cli(["export", str(runs["lora"]), "--out", str(out), "--format", "peft", "--round", "3"], capsys)
    assert code == 0, err
    assert {"adapter_config.json", "adapter_model.safetensors", "README.md", "hiso.json"} <= {p.name for p in out.iterdir()}
    # a directory of the user's with no hub id: named by its name, never by this machine's path
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == "lm"
    base = AutoModelForCausalLM.from_pretrained(runs["files"]["lm"])
    model = PeftModel.from_pretrained(base, out).eval()
    assert torch.allclose(_logits(model), _hiso_logits(runs["lora"], 3), atol=1e-5, rtol=0)
    assert json.loads((out / "hiso.json").read_text())["lora"]["r"] == 2


def test_state_dict_export_is_the_models_tensors(runs, tmp_path, capsys):
    from safetensors import safe_open
    from safetensors.torch import load_file

    q = tmp_path / "quad"
    assert run_cli(["run", "--out", str(q), "--dim", "20", "--clients", "4", "--sampled", "2", "--rounds", "5",
                    "--quiet"], capsys)[0] == 0
    code, _, err = run_cli(["export", str(q), "--out", str(tmp_path / "sd")], capsys)  # default: state-dict
    assert code == 0, err
    got = load_file(tmp_path / "sd" / "model.safetensors")
    assert torch.equal(got["x"], torch.load(q / "model.pt")["model"]["x"])
    with safe_open(tmp_path / "sd" / "model.safetensors", "pt") as f:
        assert json.loads(f.metadata()["hiso"])["round"] == 5
    # a LoRA language run: the merged model's state dict, loadable into the base architecture
    code, _, err = run_cli(["export", str(runs["lora"]), "--out", str(tmp_path / "lsd"), "--format", "state-dict"],
                           capsys)
    assert code == 0, err
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(runs["files"]["lm"]).eval()
    base.load_state_dict(load_file(tmp_path / "lsd" / "model.safetensors"))
    assert torch.allclose(_logits(base), _hiso_logits(runs["lora"]), atol=1e-5, rtol=0)


def _refused(args, capsys, tmp_path, *words):
    before = sorted(p.name for p in tmp_path.iterdir())
    code, _, err = run_cli(args, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert all(w in err for w in words), err
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # nothing written, no temp dir


def test_bad_exports_are_refused_in_one_line_and_write_nothing(runs, tmp_path, capsys):
    out = str(tmp_path / "x")
    _refused(["export", str(tmp_path / "nope"), "--out", out], capsys, tmp_path, "config.json")
    _refused(["export", str(runs["lora"]), "--out", out, "--round", "5"], capsys, tmp_path, "rounds 0..4")
    _refused(["export", str(runs["full"]), "--out", out, "--format", "peft"], capsys, tmp_path, "LoRA", "merged")
    q = tmp_path / "quad"
    assert run_cli(["run", "--out", str(q), "--dim", "5", "--rounds", "2", "--quiet"], capsys)[0] == 0
    _refused(["export", str(q), "--out", out, "--format", "merged"], capsys, tmp_path, "state-dict")
    _refused(["export", str(q), "--out", out, "--format", "peft"], capsys, tmp_path, "LoRA")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "f").write_text("keep")
    _refused(["export", str(q), "--out", str(tmp_path / "taken")], capsys, tmp_path, "--force")
    assert (tmp_path / "taken" / "f").read_text() == "keep"
    _refused(["export", str(q), "--out", str(q), "--force"], capsys, tmp_path, "run directory")


def test_force_replaces_an_earlier_export_and_nothing_else(runs, tmp_path, capsys):
    out = tmp_path / "x"
    for fmt in ("merged", "peft", "state-dict"):  # each format's files replaced by the next's
        code, _, err = run_cli(["export", str(runs["lora"]), "--out", str(out), "--format", fmt, "--force"], capsys)
        assert code == 0, err
        assert json.loads((out / "hiso.json").read_text())["format"] == fmt
    assert sorted(p.name for p in out.iterdir()) == ["README.md", "hiso.json", "model.safetensors"]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("keep")
    (tmp_path / "afile").write_text("keep")
    for target, word in ((mine, "thesis.tex"), (tmp_path / "afile", "is a file")):
        _refused(["export", str(runs["lora"]), "--out", str(target), "--force"], capsys, tmp_path, word)
    (out / "notes.txt").write_text("keep")  # an export a user added to is theirs too
    _refused(["export", str(runs["lora"]), "--out", str(out), "--force"], capsys, tmp_path, "notes.txt")
    assert [(p / n).read_text() for p, n in ((mine, "thesis.tex"), (tmp_path, "afile"), (out, "notes.txt"))] == ["keep"] * 3
    assert (out / "hiso.json").is_file()
    # an export's hiso.json lists what it wrote: a file of any name it lists is its own to replace
    (out / "notes.txt").unlink()
    meta = json.loads((out / "hiso.json").read_text())
    assert sorted(meta["files"]) == ["README.md", "hiso.json", "model.safetensors"]
    (out / "tokenizer.special.bin").write_text("a tokenizer file no name pattern knows")
    (out / "hiso.json").write_text(json.dumps({**meta, "files": [*meta["files"], "tokenizer.special.bin"]}))
    code, _, err = run_cli(["export", str(runs["lora"]), "--out", str(out), "--format", "state-dict", "--force"], capsys)
    assert code == 0, err
    assert not (out / "tokenizer.special.bin").exists()
    (out / "model.safetensors.bak").write_text("keep")  # not listed: the user's, though export-like
    _refused(["export", str(runs["lora"]), "--out", str(out), "--force"], capsys, tmp_path, "model.safetensors.bak")


def test_export_onto_another_base_is_refused(runs, tmp_path, capsys):
    lm = write_tiny_lm(tmp_path / "lm2", seed=1)
    run = _lm_run({**runs["files"], "lm": str(lm)}, tmp_path / "run", "--lora-r", "2", "--lr", "0.5", "--rounds", "1")
    write_tiny_lm(lm, seed=2)  # the base changed under the run's feet
    _refused(["export", str(run), "--out", str(tmp_path / "x"), "--format", "peft"], capsys, tmp_path, "base model")


def test_an_adapter_of_a_short_name_names_the_hub_model_and_its_card_no_cache():
    from hiso.runners.export import adapter_base
    from hiso.runners.model_card import model_card
    from hiso.tasks.lm import HUB_IDS, portable_source

    info = {"model": "smollm2-135m", "model_source": portable_source("smollm2-135m"),
            "hub_id": HUB_IDS["smollm2-135m"]}
    assert adapter_base(info) == "HuggingFaceTB/SmolLM2-135M-Instruct" and adapter_base(info, "b") == "b"
    meta = {"format": "peft", "base_model": "smollm2-135m", "base_model_hub_id": info["hub_id"], "task": "sst2",
            "algorithm": "hiso", "round": 3, "run": "r", "seed": 0, "config_sha256": "x", "base_fingerprint": "y"}
    card = model_card(meta, info, adapter_base(info))
    front = card.split("---")[1]
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in front and "library_name: peft" in front
    assert "from_pretrained('HuggingFaceTB/SmolLM2-135M-Instruct')" in card and "--base-dir" in card
    assert ".cache" not in card and "hiso.tasks" not in card  # loads with stock transformers and peft
