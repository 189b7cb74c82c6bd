"""``--base-dtype``: the frozen base of a LoRA run held in bfloat16, int8 (weight-only) or int4
(NF4), the adapters in float32. Every LoRA method runs on it; the run rebuilds bit for bit,
resumes byte for byte and exports (an adapter for the base as given, a merged float32 model).
Tiny LM, no downloads."""

import contextlib
import io
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")

from lm_fixtures import write_sst2, write_tiny_lm  # noqa: E402

from cli_helpers import run_cli  # noqa: E402
from crash_harness import Crash  # noqa: E402
from hiso.cli import main  # noqa: E402
from hiso.config import ConfigError, load_config  # noqa: E402

DTYPES = ["bfloat16", "int8", "int4"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("quant")
    # hidden 64: bitsandbytes' CPU 4-bit kernel packs output features in blocks of 32
    return {"lm": str(write_tiny_lm(d / "lm", hidden=64)), "sst2": str(write_sst2(d / "sst2"))}


def _args(files, out, dtype, *extra, rounds=4):
    return ["run", "--task", "sst2", "--model", files["lm"], "--data-dir", files["sst2"],
            "--label-words", " terrible, great", "--clients", "3", "--sampled", "2", "--rounds", str(rounds),
            "--eval-every", "2", "--min-size", "2", "--mu", "1e-2", "--batch-size", "4", "--lora-r", "2",
            "--threads", "1", "--base-dtype", dtype, "--out", str(out), "--quiet", *extra]


def _ok(capsys, args):
    code, out, err = run_cli(args, capsys)
    assert code == 0, err
    return out


def _state(path):
    return torch.load(path, weights_only=False)


def _same(a: dict, b: dict) -> bool:
    return a["round"] == b["round"] and a["model"].keys() == b["model"].keys() and all(
        torch.equal(a["model"][k], b["model"][k]) for k in a["model"])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_quantized_base_run_rebuilds_bit_for_bit_and_resumes_byte_for_byte(files, tmp_path, capsys, dtype):
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    _ok(capsys, _args(files, whole, dtype, "--lr", "0.5", "--checkpoint-every", "2"))
    with Crash(cut, 16) as crash, contextlib.suppress(BaseException), \
            contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        main(_args(files, cut, dtype, "--lr", "0.5", "--checkpoint-every", "2"))
    assert crash.dead, "the run finished before the kill: kill it earlier"
    _ok(capsys, ["run", "--resume", str(cut), "--quiet"])
    assert (whole / "history.bin").read_bytes() == (cut / "history.bin").read_bytes()
    assert _same(_state(whole / "model.pt"), _state(cut / "model.pt"))
    _ok(capsys, ["rebuild", str(whole), "--out", str(tmp_path / "x.pt")])
    assert _same(_state(tmp_path / "x.pt"), _state(whole / "model.pt"))
    saved = _state(whole / "model.pt")["model"]
    assert all(v.dtype == torch.float32 for v in saved.values())  # the adapters: float32, and only they
    assert json.loads((whole / "config.json").read_text())["task_opts"]["base_dtype"] == dtype


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_base_is_held_quantized_and_the_adapters_train_in_float32(files, dtype):
    from hiso.tasks.registry import build_task
    cfg = load_config(None, task="sst2", model=files["lm"], data_dir=files["sst2"], lora_r=2, base_dtype=dtype,
                      clients=3, sampled=2, min_size=2, label_words=" terrible, great")
    model = build_task(cfg).build_model()
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    w = q.base_layer.weight
    stored = w.dtype if dtype == "int4" else w.__tensor_flatten__()[0] and w.qdata.dtype
    assert stored in (torch.uint8, torch.int8)  # int4: two codes a byte; int8: one
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert emb.qdata.dtype == torch.int8 and emb.scale.shape == (emb.shape[0], 1)  # int8 per row, int4 base too
    assert head is emb  # the tied head shares the embedding's one quantized tensor
    assert q.lora_A["default"].weight.dtype == torch.float32
    assert all(p.dtype == torch.float32 for p in model.parameters() if p.requires_grad)


METHODS = [("hiso", "0.5"), ("decomfl", "0.5"), ("feedsign", "0.05"), ("fedkseed", "0.5"), ("sketch", "0.05"),
           ("ferret", "0.05"), ("fedkrso", "0.05"), ("fedavg", "0.05"), ("conmezo", "0.5"), ("greedy", "0.5"),
           (str(Path(__file__).resolve().parents[1] / "examples" / "second_moment_method.py") + ":SecondMoment",
            "0.05")]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["int8", "int4"])
@pytest.mark.parametrize("alg,lr", METHODS, ids=[m.rsplit(":", 1)[-1] for m, _ in METHODS])
def test_every_lora_method_runs_on_a_quantized_base(files, tmp_path, capsys, alg, lr, dtype):
    """The zeroth-order methods (a user's too), the first-order clients (backpropagation through
    the quantized base, as QLoRA does) and FedAvg-LoRA; the runs with a log rebuild bit for bit."""
    out = tmp_path / "run"
    _ok(capsys, _args(files, out, dtype, "--algorithm", alg, "--lr", lr, rounds=2))
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all(r["train_loss"] is None or r["train_loss"] == r["train_loss"] for r in rows[1:])
    if (out / "history.bin").exists():
        _ok(capsys, ["rebuild", str(out), "--out", str(tmp_path / "x.pt")])
        assert _same(_state(tmp_path / "x.pt"), _state(out / "model.pt"))


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_exports_give_an_adapter_for_the_base_as_given_and_a_float32_merged_model(files, tmp_path, capsys, dtype):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    run = tmp_path / "run"
    _ok(capsys, _args(files, run, dtype, "--lr", "0.5"))
    _ok(capsys, ["export", str(run), "--out", str(tmp_path / "peft"), "--format", "peft"])
    _ok(capsys, ["export", str(run), "--out", str(tmp_path / "merged"), "--format", "merged"])
    ids = torch.tensor([[9, 10, 11, 12, 13, 14]])
    base = AutoModelForCausalLM.from_pretrained(files["lm"]).eval()
    adapted = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert all(p.dtype == torch.float32 for p in merged.parameters())
    with torch.no_grad():
        a, m = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(a, m, atol=1e-5, rtol=0)  # the merged model is the adapter on the float32 base
    trained = _state(run / "model.pt")["model"]
    assert any(float(v.abs().max()) > 0 for k, v in trained.items() if "lora_B" in k)  # it learned something


def test_a_merged_export_is_written_in_the_dtype_asked_for(files, tmp_path, capsys):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM
    run = tmp_path / "run"
    _ok(capsys, _args(files, run, "int8", "--lr", "0.5"))
    for dtype in ("float32", "bfloat16"):
        _ok(capsys, ["export", str(run), "--out", str(tmp_path / dtype), "--format", "merged", "--dtype", dtype])
    with safe_open(str(tmp_path / "bfloat16" / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    full = AutoModelForCausalLM.from_pretrained(tmp_path / "float32").eval()
    half = AutoModelForCausalLM.from_pretrained(tmp_path / "bfloat16", dtype=torch.bfloat16).eval()
    for (name, a), b in zip(full.named_parameters(), half.parameters()):
        assert torch.equal(a.to(torch.bfloat16), b), name  # the float32 merge, rounded once
    assert "weights written in bfloat16" in (tmp_path / "bfloat16" / "README.md").read_text()
    assert main(["export", str(run), "--out", str(tmp_path / "p"), "--format", "peft", "--dtype", "bfloat16"]) == 2
    assert "written as it was trained" in capsys.readouterr().err and not (tmp_path / "p").exists()


def test_full_parameter_training_over_a_quantized_base_is_refused():
    with pytest.raises(ConfigError, match="base_dtype int4: the base is frozen at that precision, so it needs LoRA"):
        load_config(None, task="sst2", base_dtype="int4")


def test_a_first_order_gradient_through_an_int4_base_is_that_of_its_dequantized_weights(files):
    """After a forward without gradients (a ZO or evaluation forward), backpropagation through the
    4-bit base still reaches the first layer's adapter along every path: bitsandbytes' CPU repack
    (no backward) is kept off."""
    import copy

    import bitsandbytes as bnb

    from hiso.tasks.registry import build_task
    cfg = load_config(None, task="sst2", model=files["lm"], data_dir=files["sst2"], lora_r=2, base_dtype="int4",
                      clients=3, sampled=2, min_size=2, label_words=" terrible, great")
    model = build_task(cfg).build_model()
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(1))
    ids = torch.tensor([[9, 10, 11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        model(input_ids=ids)
    plain = copy.deepcopy(model)
    for name, m in list(plain.named_modules()):
        for child, sub in list(m.named_children()):
            if isinstance(sub, bnb.nn.Linear4bit):
                w = bnb.functional.dequantize_4bit(sub.weight.data, sub.weight.quant_state).float()
                lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
                lin.weight.data.copy_(w)
                lin.weight.requires_grad_(False)
                setattr(m, child, lin)

    def grad(mdl):
        mdl.zero_grad()
        mdl(input_ids=ids).logits.square().sum().backward()
        return next(p.grad for n, p in mdl.named_parameters() if "layers.0." in n and "lora_A" in n)

    g, want = grad(model), grad(plain)
    assert float(want.abs().max()) > 0
    assert torch.allclose(g, want, rtol=1e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_bfloat16_head_reads_a_contiguous_input_and_a_float32_one_is_left_alone(files, dtype):
    """A strided input to a bfloat16 head copies the head per prompt on a CPU (hiso.tasks.lm_head)."""
    from hiso.tasks.registry import build_task
    cfg = load_config(None, task="sst2", model=files["lm"], data_dir=files["sst2"], lora_r=2, base_dtype=dtype,
                      clients=3, sampled=2, min_size=2, label_words=" terrible, great", pack_sequences=False)
    task = build_task(cfg)
    model = task.build_model()
    seen = []
    model.get_output_embeddings().register_forward_pre_hook(lambda m, a: seen.append(a[0].is_contiguous()))
    with torch.no_grad():
        loss = task.loss(model, task.batch(0, 0, 0, 4))
    assert seen and bool(torch.isfinite(loss))
    assert all(seen) if dtype == "bfloat16" else not any(seen)  # float32: transformers' strided slice, as before


def test_the_int8_embedding_and_head_compute_with_the_dequantized_weight_without_making_it(monkeypatch):
    """A lookup is the dequantized table's rows exactly (a Gemma-style subclass still scales it);
    the logits are those of the dequantized head, computed ``HEAD_ROWS`` rows at a time: the whole
    table is never dequantized (torchao's own embedding and linear would)."""
    from torchao.quantization import Int8Tensor, PerRow

    from hiso.tasks import lm

    class Scaled(torch.nn.Embedding):
        def forward(self, ids):
            return super().forward(ids) * 3.0

    g = torch.Generator().manual_seed(0)
    emb = Scaled(100, 16)
    torch.nn.init.normal_(emb.weight, generator=g)
    head = torch.nn.Linear(16, 100, bias=False)
    head.weight = emb.weight
    model = torch.nn.Module()
    model.get_input_embeddings, model.get_output_embeddings = (lambda: emb), (lambda: head)
    whole = Int8Tensor.from_hp(emb.weight.detach(), granularity=PerRow())
    monkeypatch.setattr(lm, "HEAD_ROWS", 7)  # several blocks, the last one short
    lm.quantize_embeddings(model)
    w = emb.weight
    assert head.weight is w and isinstance(w, Int8Tensor) and isinstance(emb, Scaled)
    assert all(torch.equal(getattr(w, n), getattr(whole, n)) for n in ("qdata", "scale", "zero_point"))  # by blocks
    full = w.dequantize()
    monkeypatch.setattr(Int8Tensor, "dequantize", lambda *a, **k: pytest.fail("the whole table dequantized"))
    ids = torch.tensor([[3, 99, 0], [5, 5, 42]])
    assert torch.equal(emb(ids), full[ids] * 3.0)
    x = torch.randn(2, 3, 16, generator=g)
    with torch.no_grad():
        assert torch.allclose(head(x), x @ full.t(), rtol=1e-6, atol=1e-5)  # the reused buffer
    x.requires_grad_(True)
    head(x).square().sum().backward()  # a first-order client's path: fresh blocks, kept for the backward
    want = x.detach().requires_grad_(True)
    (want @ full.t()).square().sum().backward()
    assert torch.allclose(x.grad, want.grad, rtol=1e-5, atol=1e-4)


def test_a_head_a_library_already_quantized_is_left_alone():
    """An untied head whose weight torchao already holds int8 is not requantized from its codes."""
    from torchao.quantization import Int8Tensor, PerRow

    from hiso.tasks import lm
    emb, head = torch.nn.Embedding(10, 8), torch.nn.Linear(8, 10, bias=False)
    held = torch.nn.Parameter(Int8Tensor.from_hp(head.weight.detach(), granularity=PerRow()), requires_grad=False)
    head.weight = held
    model = torch.nn.Module()
    model.get_input_embeddings, model.get_output_embeddings = (lambda: emb), (lambda: head)
    lm.quantize_embeddings(model)
    assert head.weight is held and type(head) is torch.nn.Linear
    assert isinstance(emb.weight, Int8Tensor)


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_run_made_before_the_int8_embedding_rebuilds_and_exports_as_made(files, tmp_path, capsys, dtype):
    """An int8 or int4 run written by a hiso that held the embedding and head float32 (its
    config.json has no ``quantize_embedding``) reads as made: it rebuilds bit for bit, exports, and
    keeps the configuration hash it had; a run with the default (int8 embedding) rebuilds too."""
    from hiso.compat import FLAT_DEFAULTS, HASH_LATER_FIELDS, TASK_FLAT_OPTIONS
    from hiso.config import RunConfig
    from hiso.runners.runfiles import saved_config
    old, new = tmp_path / "old", tmp_path / "new"
    _ok(capsys, _args(files, old, dtype, "--no-quantize-embedding", rounds=2))
    raw = json.loads((old / "config.json").read_text())
    assert raw["task_opts"].pop("quantize_embedding") is False
    (old / "config.json").write_text(json.dumps(raw))  # as an older hiso wrote it (a task option since schema 5)
    assert saved_config(old)[0].quantize_embedding is False
    _ok(capsys, ["rebuild", str(old), "--out", str(tmp_path / "old.pt")])
    assert _same(_state(tmp_path / "old.pt"), _state(old / "model.pt"))
    _ok(capsys, ["export", str(old), "--out", str(tmp_path / "peft"), "--format", "peft"])
    from hiso.compat import flat_options  # (HiSo's options counted flat, as before they were its own)
    from hiso.runners.portable import identity_values  # (where the inputs are is left out of the hash)
    before = {k: v for k, v in identity_values(flat_options(saved_config(old)[0].model_dump())).items()
              if k != "quantize_embedding"}
    for name in HASH_LATER_FIELDS:  # the hash an older hiso computed, without the field
        default = FLAT_DEFAULTS[name] if name in FLAT_DEFAULTS else TASK_FLAT_OPTIONS[name] \
            if name in TASK_FLAT_OPTIONS else RunConfig.model_fields[name].get_default(call_default_factory=True)
        if before.get(name) == default:
            before.pop(name)
    import hashlib
    sha = hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()
    exported = json.loads((tmp_path / "peft" / "hiso.json").read_text())["config_sha256"]
    assert exported == sha
    _ok(capsys, _args(files, new, dtype, rounds=2))
    assert json.loads((new / "config.json").read_text())["task_opts"]["quantize_embedding"] is True
    _ok(capsys, ["rebuild", str(new), "--out", str(tmp_path / "new.pt")])
    assert _same(_state(tmp_path / "new.pt"), _state(new / "model.pt"))
    _ok(capsys, ["export", str(new), "--out", str(tmp_path / "peft-new"), "--format", "peft"])
    assert json.loads((tmp_path / "peft-new" / "hiso.json").read_text())["config_sha256"] != sha
