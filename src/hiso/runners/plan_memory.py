"""``hiso plan``'s client memory by base dtype: what a client participating in a LoRA run holds at
the peak of a round, on a CPU and on a GPU, for a model given by name, by config directory or by
size.

The model is counted from its structure (its transformers config instantiated on the meta device:
no weights are read), the way hiso holds it (:func:`hiso.tasks.lm.base_precision`):

* ``float32``: every parameter and buffer in 4 bytes; ``bfloat16``: parameters in 2, buffers 4;
* ``int8`` (torchao weight-only): every ``nn.Linear`` weight but the output head as int8 codes
  with a float32 scale and an int8 zero point per output row;
* ``int4`` (bitsandbytes NF4, blocks of 64): those weights as two codes a byte with a float32
  absmax per block of 64 and a 16-entry float32 code table per layer.

Under both, the input embedding and the output head are int8 per row as well (one tensor for a
tied pair: :func:`hiso.tasks.lm.quantize_embeddings`); norms and biases stay float32. The LoRA
adapters (r x (in + out) per target linear) and the method's state (HiSo's H, a local iterate's
delta) are float32, from :mod:`.plan`.

On top of the tensors: a CPU client's process runtime (Python, torch, transformers and peft
imported, the tokenizer, the rest of the process), and one answer's transient peak (the
activations of a forward; on a CPU a quantized base's dequantized weights): the peak resident
memory *during the rounds* (``bench/base_dtype.py``'s ``peak_rss_rounds_mb``). Loading's peak on a
CPU is modelled apart (:func:`loading_bytes`: a base below float32 is read a tensor at a time,
:mod:`hiso.tasks.lm_stream`, but its embedding and head whole in float32 before they are
quantized), and a client process's peak is the larger of the two (``bench/quantized_peak.py``
measures both under ``/usr/bin/time -v``). On CUDA the figure is the allocator's peak (the CUDA
context and the host process are not in it).
The per-item figures below were measured on a 2-core AMD EPYC (torch 2.13, transformers 5.24), the
runtime on a 2-core Intel Xeon; docs/llm.md and docs/results/language.md compare the whole estimate
with measured peaks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MiB = 2**20
BASE_DTYPES = ("float32", "bfloat16", "int8", "int4")
# A CPU client process besides its tensors, measured apart from the models it is checked against:
RUNTIME_PROCESS = 668 * MiB  # a whole hiso run's peak (/usr/bin/time -v) of a tiny LM (a word vocabulary,
# tensors of a few KiB): 2 rounds of SST-2 with LoRA, 4 clients, 667, 668 and 668 MiB at float32, int8 and
# int4 (bench/quantized_peak.py --runtime; 2-core Intel Xeon, torch 2.13, transformers 5.25). Python with
# torch, transformers, peft, torchao and bitsandbytes imported (528 MiB alone), the data, the rest
TOKENIZER_PER_ENTRY = 1280  # bytes per vocabulary entry of a fast tokenizer (Gemma-3's alone: 320 MiB for 262,144)
PROMPTS, TOKENS = 16, 512  # one forward: 16 prompts of up to 32 tokens (SST-2 at batch 16)
CUDA_WORKSPACE = 32 * MiB  # cuBLAS' workspace, taken from the allocator on Hopper


@dataclass(frozen=True)
class Structure:
    """A model's parameters by how a quantized base holds them (see the module docstring)."""

    name: str
    params: int  # every parameter, tied ones once
    linear: int  # elements of the quantized linear weights (every nn.Linear but the output head)
    rows: int  # their output rows (int8's per-row scale and zero point)
    layers: int  # how many such linears (int4's code table each)
    embed: int  # elements of the input embedding and an untied output head (int8 per row under int8 and int4)
    embed_rows: int  # their rows
    buffer_bytes: int  # buffers (rotary frequencies): float32 in every dtype
    lora: int  # adapter parameters at lora_r on the targets (0 without LoRA)
    hidden: int
    intermediate: int
    heads: int
    vocab: int
    largest: int  # elements of the largest quantized linear weight
    note: str = ""

    @property
    def other(self) -> int:
        """Parameters that stay float32 under int8 and int4: norms, biases."""
        return self.params - self.linear - self.embed


def count(config, name: str, lora_r: int | None = None, targets=("q_proj", "v_proj"), note: str = "") -> Structure:
    """A transformers config's :class:`Structure`, from its causal LM built on the meta device."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    head = model.get_output_embeddings()
    pair = [m for m in (model.get_input_embeddings(), head)
            if isinstance(m, (torch.nn.Embedding, torch.nn.Linear)) and getattr(m, "max_norm", None) is None]
    quantized = {id(m.weight): m.weight for m in pair}.values()  # a tied pair once
    embed, embed_rows = sum(w.numel() for w in quantized), sum(w.shape[0] for w in quantized)
    linear = rows = layers = largest = lora = 0
    for mname, m in model.named_modules():
        if isinstance(m, torch.nn.Linear) and m is not head:
            n = m.weight.numel()
            linear, rows, layers, largest = linear + n, rows + m.out_features, layers + 1, max(largest, n)
            if lora_r and mname.rsplit(".", 1)[-1] in targets:
                lora += lora_r * (m.in_features + m.out_features)
    text = getattr(config, "text_config", None) or config
    return Structure(name, sum(p.numel() for p in model.parameters()), linear, rows, layers, embed, embed_rows,
                     sum(b.numel() * 4 for b in model.buffers()), lora, text.hidden_size,
                     getattr(text, "intermediate_size", 4 * text.hidden_size), text.num_attention_heads,
                     text.vocab_size, largest, note)


def base_bytes(s: Structure, dtype: str, quantize_embedding: bool = True) -> int:
    """Bytes of the frozen base held in ``dtype`` (the adapters not included); under int8 and int4
    the embedding and head are int8 per row unless ``quantize_embedding`` is False (float32)."""
    if dtype == "float32":
        return 4 * s.params + s.buffer_bytes
    if dtype == "bfloat16":
        return 2 * s.params + s.buffer_bytes
    embed = s.embed + 5 * s.embed_rows if quantize_embedding else 4 * s.embed
    if dtype == "int8":
        return s.linear + 5 * s.rows + embed + 4 * s.other + s.buffer_bytes
    if dtype == "int4":
        return s.linear // 2 + 4 * -(-s.linear // 64) + 64 * s.layers + embed + 4 * s.other + s.buffer_bytes
    raise ValueError(f"base dtype must be one of {', '.join(BASE_DTYPES)}, got {dtype!r}")


def transient_bytes(s: Structure, dtype: str, device: str, tokens: int = TOKENS,
                    quantize_embedding: bool = True) -> int:
    """One answer's transient peak: a forward's activations over ``tokens`` tokens (the residual
    stream, the MLP's two intermediate tensors, one layer's attention scores), plus on CUDA cuBLAS'
    workspace; on a CPU, an int8 or int4 base's largest weight dequantized to float32 or, if
    larger, its int8 head's block buffer (:data:`hiso.tasks.lm.HEAD_ROWS` rows in float32) with
    the logits three times over (the blocks', joined, scaled) for :data:`PROMPTS` prompts. (A
    bfloat16 head no longer adds a copy of itself per prompt: :mod:`hiso.tasks.lm_head`.)"""
    act = 4 * tokens * (4 * s.hidden + 3 * s.intermediate) + 4 * s.heads * tokens * tokens
    if device == "cuda":
        return act + CUDA_WORKSPACE
    if dtype in ("int8", "int4"):
        from ..tasks.lm import HEAD_ROWS
        head = 4 * HEAD_ROWS * s.hidden + 3 * 4 * PROMPTS * s.vocab if quantize_embedding else 0
        return act + max(4 * s.largest, head)
    return act


def loading_bytes(s: Structure, dtype: str, quantize_embedding: bool = True) -> int:
    """What loading holds on a CPU at its peak besides the runtime: a float32 base is a view of its
    mapped file, all of it read (resident) once its fingerprint is taken; a base below float32 is
    read a tensor at a time (:mod:`hiso.tasks.lm_stream`): the base at ``dtype`` plus
    the largest tensor read in float32 before it is cast or quantized (a bfloat16 base's
    embedding), where an int8 embedding and head are read by blocks of
    :data:`hiso.tasks.lm.HEAD_ROWS` rows."""
    from ..tasks.lm import HEAD_ROWS

    if dtype == "float32":
        return base_bytes(s, dtype)
    if dtype == "bfloat16":
        read = max(s.largest, s.vocab * s.hidden)
    else:
        read = max(s.largest, HEAD_ROWS * s.hidden) if quantize_embedding else s.largest
    return base_bytes(s, dtype, quantize_embedding) + 4 * read


def runtime_bytes(s: Structure, device: str) -> int:
    """A CPU client process besides its tensors (libraries, data, tokenizer); 0 on CUDA,
    whose allocator figure leaves the host process out."""
    return 0 if device == "cuda" else RUNTIME_PROCESS + TOKENIZER_PER_ENTRY * s.vocab


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kKmMbB]?)\s*$")


_LIKE_SIZE = re.compile(r"[\d.]+\s*[A-Za-z]{0,2}")  # what is meant as a size, if anything (8X, 1.5G)


def parse_size(text: str) -> int | None:
    """``"8B"``, ``"1.5B"``, ``"350M"``, ``"125000000"`` as a parameter count; None if not a size."""
    m = _SIZE.match(text)
    if not m:
        return None
    return int(float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "b": 1e9}[m.group(2).lower()])


def llama3_shape(params: int):
    """The Llama-3-shaped config nearest ``params`` parameters (the assumed architecture of a bare
    size): head dim 64 with 4 query heads per key-value head, layers = hidden / 128, MLP 3.5 x
    hidden (to 256), vocabulary 128,256, the output head tied under 4B parameters (as Llama 3.2's
    1B and 3B) and untied above (as 3.1's 8B and 70B)."""
    from transformers import LlamaConfig

    def shape(h: int) -> dict:
        heads = h // 64
        return {"hidden_size": h, "num_hidden_layers": max(1, h // 128), "num_attention_heads": heads,
                "num_key_value_heads": max(1, heads // 4), "head_dim": 64,
                "intermediate_size": max(256, round(3.5 * h / 256) * 256), "vocab_size": 128256,
                "tie_word_embeddings": params < 4e9}

    def total(k: dict) -> int:
        h, f, L, kv = k["hidden_size"], k["intermediate_size"], k["num_hidden_layers"], k["num_key_value_heads"]
        layer = 2 * h * h + 2 * h * 64 * kv + 3 * h * f + 2 * h
        return L * layer + k["vocab_size"] * h * (1 if k["tie_word_embeddings"] else 2) + h

    best = min((shape(h) for h in range(256, 32768 + 1, 256)), key=lambda k: abs(total(k) - params))
    return LlamaConfig(**best, max_position_embeddings=8192)


def structure(model: str, lora_r: int | None = None, targets=("q_proj", "v_proj")) -> Structure:
    """``model``: a size (``8B``: :func:`llama3_shape`), a short name, a local model or config
    directory, or a hub name (its config.json, from the hub the first time)."""
    from transformers import AutoConfig

    size = parse_size(model)
    if size is not None:
        cfg = llama3_shape(size)
        note = (f"assumed Llama-3 shape for {model}: hidden {cfg.hidden_size}, {cfg.num_hidden_layers} layers, "
                f"MLP {cfg.intermediate_size}, vocab {cfg.vocab_size:,}, "
                f"{'tied' if cfg.tie_word_embeddings else 'untied'} head")
        return count(cfg, model, lora_r, targets, note)
    from ..tasks import lm
    if _LIKE_SIZE.fullmatch(model) and not Path(model).expanduser().exists():  # refused before the hub is asked
        raise ValueError(f"--params-model {model!r} is not a size: give a number with K, M or B (135M, 1.5B, 8B), "
                         f"a short name ({', '.join(lm.SHORT_NAMES)}), a directory with a config.json or a hub name")
    try:
        cfg = AutoConfig.from_pretrained(lm.resolve_model(model))
    except OSError as e:
        raise lm.ModelError(f"no config for model {model!r}: {str(e).splitlines()[0]} (give a size such as 8B, "
                            f"a directory with a config.json, or a short name: {', '.join(lm.SHORT_NAMES)})") from None
    return count(cfg, model, lora_r, targets)


def client_memory(s: Structure, dtype: str, state_bytes: float, lora: bool, quantize_embedding: bool = True) -> dict:
    """A client's peak during a round, by part, on CPU and CUDA: ``held`` (the base at ``dtype``
    with LoRA, plus ``state_bytes``: the values the method keeps, trainable model included)."""
    held = (base_bytes(s, dtype, quantize_embedding) if lora else 0) + int(state_bytes)
    out = {"held": held}
    for dev in ("cpu", "cuda"):
        tr, rt = transient_bytes(s, dtype, dev, quantize_embedding=quantize_embedding), runtime_bytes(s, dev)
        out |= {f"{dev}_transient": tr, f"{dev}_runtime": rt, f"{dev}_total": held + tr + rt}
    loading = out["cpu_runtime"] + (loading_bytes(s, dtype, quantize_embedding) if lora else base_bytes(s, "float32"))
    larger = "loading" if loading > out["cpu_total"] else "rounds"
    return out | {"cpu_loading": loading, "cpu_peak": max(loading, out["cpu_total"]), "cpu_larger": larger}


def format_memory(rows: list[dict], s: Structure, dtype: str, lora_r: int | None,
                  quantize_embedding: bool = True) -> str:
    """``hiso plan``'s client-memory table (rows: :func:`hiso.runners.plan.plan`'s, with ``memory``)."""
    mib = lambda x: f"{x / MiB:,.0f} MiB"  # noqa: E731
    what = f"LoRA r={lora_r} ({s.lora:,} trainable)" if lora_r else "full parameters"
    head = [f"client memory at the peak of a round: {s.name}, {s.params:,} params ({s.linear:,} in quantizable "
            f"linears), base {dtype}, {what}" + (f"; {s.note}" if s.note else ""),
            "  ".join(f"{c:>13}" for c in ("method", "model+state", "CPU transient", "CPU runtime", "CPU total",
                                            "CPU loading", "CPU peak", "CUDA transient", "CUDA total"))]
    for r in rows:
        m = r["memory"]
        cells = (r["method"], mib(m["held"]), mib(m["cpu_transient"]), mib(m["cpu_runtime"]), mib(m["cpu_total"]),
                 mib(m["cpu_loading"]), f"{mib(m['cpu_peak'])} ({m['cpu_larger']})", mib(m["cuda_transient"]),
                 mib(m["cuda_total"]))
        head.append("  ".join(f"{c:>13}" for c in cells))
    head.append("CPU total: the resident peak during the rounds; CPU loading: loading's (a base below float32 read a "
                "tensor at a time; float32 mapped and read whole for its fingerprint); CPU peak: the larger, a "
                "client process's; ")
    how = (f"linear weights quantized, the embedding and output head {'int8 per row' if quantize_embedding else 'float32'}"
           ", norms float32" if dtype in ("int8", "int4")
           else f"every weight {dtype}")
    head[-1] += (f"base {dtype}: {mib(base_bytes(s, dtype, quantize_embedding))} ({how}); "
                 f"CPU runtime: the libraries, the tokenizer and the process (measured); transient: a forward over "
                 f"{PROMPTS} prompts, {TOKENS} tokens; CUDA: the allocator's peak, the CUDA context not in it")
    return "\n".join(head)


def plan_structure(args) -> Structure | None:
    """``hiso plan``'s model structure: ``--params-model``, or ``--task``'s ``--model``; None for a
    bare ``--params`` or a task without a language model (then no memory table)."""
    if args.base_dtype != "float32" and not args.lora_r:
        raise ValueError(f"--base-dtype {args.base_dtype} needs --lora-r: the base is frozen at that precision")
    name = args.params_model or (args.model if args.task else None)
    if name is None:
        if args.lora_r or args.base_dtype != "float32":
            raise ValueError("--lora-r and --base-dtype need the model's structure: --params-model, or --task "
                             "with --model")
        return None
    return structure(name, args.lora_r)


def with_memory(rows: list[dict], s: Structure, dtype: str, lora_r: int | None,
                quantize_embedding: bool = True) -> str:
    """Add each plan row's ``memory`` (:func:`client_memory`) and return the table."""
    for r in rows:
        r["memory"] = client_memory(s, dtype, r["client_bytes"], bool(lora_r), quantize_embedding)
    return format_memory(rows, s, dtype, lora_r, quantize_embedding)
