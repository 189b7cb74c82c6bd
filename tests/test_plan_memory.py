"""hiso plan's client memory by base dtype: the base's bytes counted from the model's structure
equal those of the model hiso actually builds (tied and untied heads, every dtype, LoRA adapters
included), a bare size gets its stated Llama-3 shape, and the CLI prints the table and refuses
what hiso run refuses. Tiny LM, no downloads, no wall clock."""

import pytest

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
pytest.importorskip("torchao")

from lm_fixtures import write_sst2, write_tiny_lm  # noqa: E402

from cli_helpers import run_cli  # noqa: E402
from hiso.config import load_config  # noqa: E402
from hiso.runners import plan_memory as pm  # noqa: E402


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from transformers import AutoConfig, LlamaForCausalLM
    d = tmp_path_factory.mktemp("planmem")
    tied = write_tiny_lm(d / "tied", hidden=64)  # hidden 64: bitsandbytes' CPU 4-bit packing
    untied = write_tiny_lm(d / "untied", hidden=64)
    cfg = AutoConfig.from_pretrained(untied)
    cfg.tie_word_embeddings = False
    LlamaForCausalLM(cfg).save_pretrained(untied)
    return {"tied": str(tied), "untied": str(untied), "sst2": str(write_sst2(d / "sst2"))}


@pytest.mark.parametrize("head", ["tied", "untied"])
@pytest.mark.parametrize("dtype,qe", [(d, True) for d in pm.BASE_DTYPES] + [("int8", False), ("int4", False)])
def test_plan_counts_the_base_as_hiso_holds_it(files, head, dtype, qe):
    """The structure's count (meta device, no weights) equals hiso's own count of the client's
    model as hiso builds it: quantized linears, an int8 embedding and head (one tensor when tied;
    float32 with --no-quantize-embedding), float32 norms and adapters."""
    from hiso.runners.client_cost import model_bytes
    from hiso.tasks.registry import build_task
    cfg = load_config(None, task="sst2", model=files[head], data_dir=files["sst2"], lora_r=2, base_dtype=dtype,
                      quantize_embedding=qe, clients=3, sampled=2, min_size=2, label_words=" terrible, great")
    model = build_task(cfg).build_model()
    s = pm.structure(files[head], lora_r=2)
    assert s.lora == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert pm.base_bytes(s, dtype, qe) + 4 * s.lora == model_bytes(model)


def test_the_quantized_bases_are_smaller_in_the_order_hiso_holds_them(files):
    s = pm.structure(files["untied"])
    sizes = [pm.base_bytes(s, d) for d in pm.BASE_DTYPES]
    assert sizes[0] == 2 * sizes[1] - s.buffer_bytes  # bfloat16: half, buffers float32
    assert s.other == s.params - s.linear - s.embed > 0  # the norms: float32 under int8 and int4
    assert (s.embed, s.embed_rows) == (2 * s.vocab * s.hidden, 2 * s.vocab)  # embedding and untied head: int8
    tied = pm.structure(files["tied"])
    assert (tied.embed, tied.embed_rows) == (tied.vocab * tied.hidden, tied.vocab)  # one tensor for the pair
    assert sizes[2] - sizes[3] > 0


def test_a_bare_size_gets_the_stated_llama3_shape():
    assert [pm.parse_size(x) for x in ("8B", "1.5b", "350M", "125000", "llama")] == [8e9, 1.5e9, 350e6, 125000, None]
    eight, one = pm.llama3_shape(8_000_000_000), pm.llama3_shape(1_000_000_000)
    assert (eight.hidden_size, eight.num_hidden_layers, eight.intermediate_size, eight.tie_word_embeddings) == \
        (4096, 32, 14336, False)  # Llama 3.1 8B's shape
    assert one.tie_word_embeddings and one.vocab_size == 128256
    s = pm.count(eight, "8B")
    assert abs(s.params - 8e9) / 8e9 < 0.01


def test_memory_adds_the_runtime_on_a_cpu_only(files):
    s = pm.structure(files["tied"], lora_r=2)
    m = pm.client_memory(s, "int4", 4 * s.lora, lora=True)
    assert m["held"] == pm.base_bytes(s, "int4") + 4 * s.lora
    assert m["cpu_total"] == m["held"] + m["cpu_transient"] + m["cpu_runtime"]
    assert m["cpu_runtime"] == pm.RUNTIME_PROCESS + pm.TOKENIZER_PER_ENTRY * s.vocab
    assert m["cuda_runtime"] == 0 and m["cuda_total"] == m["held"] + m["cuda_transient"]
    full = pm.client_memory(s, "float32", 8 * s.params, lora=False)  # full parameters: the model is the state
    assert full["held"] == 8 * s.params
    assert full["cpu_loading"] == full["cpu_runtime"] + pm.base_bytes(s, "float32")  # the mapped file, read whole
    assert full["cpu_larger"] == "rounds"


@pytest.mark.parametrize("head", ["tied", "untied"])
def test_loading_holds_the_base_and_one_float32_tensor_and_names_the_larger_peak(files, head):
    """A base below float32 is read a tensor at a time: loading holds the base at its dtype and the
    largest tensor read in float32 (an int8 embedding's rows by blocks); the peak is the larger."""
    from hiso.tasks.lm import HEAD_ROWS
    s = pm.structure(files[head], lora_r=2)
    for dtype in ("int8", "int4"):
        m = pm.client_memory(s, dtype, 4 * s.lora, lora=True)
        assert m["cpu_loading"] == m["cpu_runtime"] + pm.base_bytes(s, dtype) + 4 * max(s.largest,
                                                                                     HEAD_ROWS * s.hidden)
        assert m["cpu_peak"] == max(m["cpu_loading"], m["cpu_total"])
        assert m["cpu_larger"] == ("loading" if m["cpu_loading"] > m["cpu_total"] else "rounds")
    bf16 = pm.client_memory(s, "bfloat16", 4 * s.lora, lora=True)
    assert bf16["cpu_loading"] == bf16["cpu_runtime"] + pm.base_bytes(s, "bfloat16") + 4 * max(s.largest,
                                                                                              s.vocab * s.hidden)
    big = pm.structure("8B", lora_r=8)  # the float32 embedding a bfloat16 base reads whole: 2 GiB
    m = pm.client_memory(big, "bfloat16", 4 * big.lora, lora=True)
    assert m["cpu_larger"] == "loading" and m["cpu_peak"] == m["cpu_loading"] > m["cpu_total"]


def _plan(files, capsys, *extra):
    return run_cli(["plan", "--params-model", files["tied"], "--clients", "6", "--sampled", "2", "--rounds", "4",
                    "--methods", "hiso,decomfl", *extra], capsys)


def test_cli_plan_prints_client_memory_by_base_dtype(files, capsys):
    code, out, err = _plan(files, capsys, "--lora-r", "2", "--base-dtype", "int4")
    assert code == 0, err
    s = pm.structure(files["tied"], lora_r=2)
    assert out.startswith(f"d={s.lora:,} params")  # d: the adapters
    table = out[out.index("client memory at the peak of a round"):]
    assert "base int4" in table and "CPU loading: loading's" in table
    hiso, decomfl = (line.split() for line in table.splitlines() if line.strip().startswith(("hiso ", "decomfl ")))
    held = pm.base_bytes(s, "int4") + 4 * s.lora
    assert decomfl[1] == f"{held / pm.MiB:,.0f}" and hiso[1] == f"{(held + 4 * s.lora) / pm.MiB:,.0f}"  # + H
    code, out, err = _plan(files, capsys, "--lora-r", "2", "--base-dtype", "int4", "--no-quantize-embedding")
    assert code == 0, err
    table = out[out.index("client memory at the peak of a round"):]
    decomfl = next(line.split() for line in table.splitlines() if line.strip().startswith("decomfl "))
    assert "embedding and output head float32" in table
    assert decomfl[1] == f"{(pm.base_bytes(s, 'int4', False) + 4 * s.lora) / pm.MiB:,.0f}"
    assert pm.base_bytes(s, "int4", False) > pm.base_bytes(s, "int4")


@pytest.mark.parametrize("bad,why", [(["--base-dtype", "int4"], "needs --lora-r"),
                                     (["--params", "100", "--lora-r", "2"], None)])
def test_cli_plan_refuses_a_quantized_base_without_lora_or_a_structure(files, capsys, bad, why):
    args = ["plan", "--clients", "6", "--sampled", "2", "--rounds", "4", *bad]
    if why:
        args += ["--params-model", files["tied"]]
    code, _, err = run_cli(args, capsys)
    assert code == 2 and ("needs --lora-r" in err if why else "need the model's structure" in err)


def test_cli_plan_counts_a_tasks_model_too(files, capsys):
    """``--task sst2 --model DIR --lora-r 2``: the same structure, d the adapters', the memory table."""
    code, out, err = run_cli(["plan", "--task", "sst2", "--model", files["untied"], "--lora-r", "2", "--clients", "6",
                              "--sampled", "2", "--rounds", "4", "--methods", "decomfl", "--base-dtype", "int8"], capsys)
    assert code == 0, err
    s = pm.structure(files["untied"], lora_r=2)
    assert out.startswith(f"d={s.lora:,} params") and "base int8" in out
