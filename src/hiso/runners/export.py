"""``hiso export``: a run's model (any round) in the formats the ecosystem loads.

* ``peft``: ``adapter_config.json`` + ``adapter_model.safetensors`` (and the tokenizer), what
  ``PeftModel.from_pretrained(base, DIR)`` loads: LoRA runs only, a few MB;
* ``merged``: a Hugging Face model directory (``config.json``, ``model.safetensors``, the
  tokenizer), what ``AutoModelForCausalLM.from_pretrained(DIR)`` loads, vLLM serves and llama.cpp's
  converter reads: the LoRA adapter merged into the base, or the fully trained parameters;
* ``state-dict``: ``model.safetensors``, the model's ``state_dict()`` (LoRA merged) for any task,
  vision and users' own included: ``model.load_state_dict(safetensors.torch.load_file(...))``.

Every export says where it came from, without a path of the machine that made it: ``hiso.json``
and a model card (``README.md``, :mod:`hiso.runners.model_card`) hold the run's identity (its
directory's name, configuration sha256, algorithm, seed, round) and, for language runs, the base
model's name, hub id when known and weight fingerprint; ``merged`` also puts them in ``config.json``
(key ``hiso``), ``state-dict`` in the safetensors header. A run is exported only onto the base it
started from. Everything is written to a temporary directory beside ``--out`` and renamed at the
end, so a refused or failed export leaves nothing behind. ``--force`` replaces an earlier export
only (a directory of the files its ``hiso.json`` lists): a user's files at ``--out`` are refused, never deleted.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
from typing import Any

from .model_card import model_card
from .runfiles import overwrites_run, saved_config
from .runmodel import RunModel, load_run_model

FORMATS = ("peft", "merged", "state-dict")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# the names an export's files had before hiso.json listed them (its own, transformers' and peft's
# save_pretrained, a tokenizer's): --force replaces such an export only if it holds nothing else
EXPORT_FILES = re.compile(r"hiso\.json|README\.md|(generation_)?config\.json|adapter_config\.json"
                          r"|(model|adapter_model)(-\d+-of-\d+)?\.safetensors(\.index\.json)?"
                          r"|tokenizer(_config)?\.json|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)"
                          r"|merges\.txt|(tokenizer|spiece|sentencepiece\.bpe)\.model|chat_template\.(jinja|json)")


def default_format(info: dict) -> str:
    """merged for language runs (loads with transformers alone), state-dict otherwise."""
    return "merged" if info.get("task") == "language" else "state-dict"


def check_dtype(dtype: str, fmt: str) -> None:
    """A merged model or state dict is written in any of DTYPES; an adapter as it was trained."""
    if dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if fmt == "peft" and dtype != "float32":
        raise ValueError(f"--dtype {dtype}: a PEFT adapter is written as it was trained (float32); "
                         "use --format merged for a model in that dtype")


def check_format(fmt: str, cfg, info: dict) -> None:
    """Refuse a format the run cannot give, before anything is loaded."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown export format {fmt!r} (choose from {', '.join(FORMATS)})")
    import importlib.util

    if importlib.util.find_spec("safetensors") is None:
        raise ValueError("hiso export writes safetensors: pip install safetensors (or pip install -e '.[llm]' in "
                         "hiso's clone)")
    language = info.get("task") == "language"
    if fmt == "peft" and not (language and info.get("lora")):
        why = "trains all parameters (use --format merged)" if language else \
            f"is a {cfg.task} run, not a language model (use --format state-dict)"
        raise ValueError(f"--format peft needs a LoRA run; this run {why}")
    if fmt == "merged" and not language:
        raise ValueError(f"--format merged is a Hugging Face model directory, for language runs; this is a "
                         f"{cfg.task} run (use --format state-dict)")


def _plain_model(rm: RunModel):
    """The run's model without LoRA wrappers: the adapter merged into the base (a new module).
    A run whose base was held quantized (``base_dtype``) merges into the base as given, in
    float32: its adapter is what the run trained, the rounding of the base is not exported."""
    from peft import PeftModel

    if getattr(rm.cfg, "base_dtype", "float32") != "float32" and isinstance(rm.model, PeftModel):
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        from ..tasks import lm
        base = lm.base_model(rm.task.model_name)
        lora = rm.task.lora
        full = lm.add_lora(base, lora["r"], lora["alpha"], lora["targets"], seed=0)
        set_peft_model_state_dict(full, {k: v.detach().to("cpu", torch.float32)
                                         for k, v in get_peft_model_state_dict(rm.model).items()})
        rm = RunModel(full, rm.task, rm.cfg, rm.info, rm.round, rm.run_dir)
    if isinstance(rm.model, PeftModel):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return rm.model.merge_and_unload()
    return rm.model


def _metrics_at(run_dir: Path, rnd: int) -> dict:
    """The evaluation metrics the run logged at round ``rnd`` (none if it did not evaluate then)."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("round") == rnd:
            return {k: v for k, v in row.items() if k.startswith(("eval_", "val_", "gap"))}
    return {}


def _trained(run_dir: Path) -> dict:
    """What the run's summary.json says of the whole run: its rounds and bytes per client."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        comm = summary.get("communication_per_client") or {}
        return {"rounds": summary["rounds_done"], "bytes_up_mean": comm.get("bytes_up_mean"),
                "bytes_down_mean": comm.get("bytes_down_mean")}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def metadata(rm: RunModel, fmt: str) -> dict[str, Any]:
    """hiso.json: the export's format, the run's identity, its base and the metrics logged then."""
    from .._version import __version__

    meta = {"hiso_version": __version__, "format": fmt, **rm.identity()}
    if rm.info.get("lora"):
        meta["lora"] = rm.info["lora"]
    if "template" in rm.info:  # the prompt and its label words: what a reader needs to ask as the run did
        meta["prompt"] = {k: rm.info[k] for k in ("template", "label_words", "labels") if k in rm.info}
    if trained := _trained(rm.run_dir):
        meta["trained"] = trained
    logged = _metrics_at(rm.run_dir, rm.round)
    if logged:
        meta["metrics_logged_at_round"] = logged
    cfg = rm.cfg
    if cfg.dp_clip is not None:  # a released model says what privacy it was trained under, at its round
        from .accounting import THREAT_MODEL, ledger_of_run
        ledger = ledger_of_run(rm.run_dir, cfg, rm.round)  # the worst client of the rounds it holds
        meta["privacy"] = {"mode": cfg.dp_mode, "clip": cfg.dp_clip, "noise_multiplier": cfg.dp_noise,
                           "delta": cfg.dp_delta, "threat_model": THREAT_MODEL,
                           "epsilon": ledger.epsilon() if ledger is not None else None,
                           "participations_max": ledger.worst()[1] if ledger is not None else None}
    return meta


def adapter_base(info: dict, base_dir: str | None = None) -> str | None:
    """What an adapter names as its base (``base_model_name_or_path``): ``base_dir`` when given
    (``--base-dir``), else the hub id the run's model came from, else the base's name (a local
    directory of the user's: its last component; never a path of this machine or a cache)."""
    from .portable import base_name
    if base_dir is not None:
        return str(base_dir)
    return info.get("hub_id") or (base_name(info["model"]) if info.get("model") else None)


def _run_base(rm: RunModel):
    """The run's base model in float32, as hiso loaded it (a short name's dequantized GGUF)."""
    from ..tasks import lm
    return lm.load_model(rm.task.model_name, lm.resolve_model(rm.task.model_name))


def place_base(rm: RunModel, base_dir: Path) -> None:
    """Write the run's base model (and its tokenizer) into ``base_dir``, whole or not at all; an
    existing ``base_dir`` is checked to hold the run's base, tensor for tensor, and left as it is."""
    from transformers import AutoModelForCausalLM

    from ..tasks import lm
    base = _run_base(rm)
    if _taken(base_dir):
        lm._quiet_transformers()
        try:
            there = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32).state_dict()
        except (OSError, ValueError) as e:
            raise ValueError(f"--base-dir {base_dir} holds no model ({str(e).splitlines()[0][:120]}): give a new "
                             "directory, which the export fills with the run's base") from None
        want = base.state_dict()
        if set(there) != set(want) or any(not torch.equal(there[k], want[k]) for k in want):
            raise ValueError(f"--base-dir {base_dir} holds another model than the run's base: give a new directory, "
                             "which the export fills with the run's base")
        return
    base_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{base_dir.name}.base-", dir=base_dir.parent))
    try:
        base.save_pretrained(tmp)
        rm.task.tok.save_pretrained(tmp)
        _usual_modes(tmp)
        os.replace(tmp, base_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write(rm: RunModel, fmt: str, tmp: Path, meta: dict, base_ref: str | None = None) -> None:
    tok = getattr(rm.task, "tok", None)
    if fmt == "peft":
        rm.model.save_pretrained(tmp)  # adapter_config.json + adapter_model.safetensors
        cfg_path = tmp / "adapter_config.json"
        acfg = json.loads(cfg_path.read_text())
        acfg["base_model_name_or_path"] = base_ref or acfg.get("base_model_name_or_path")
        cfg_path.write_text(json.dumps(acfg, indent=2))
    elif fmt == "merged":
        model = _plain_model(rm).to(DTYPES[meta.get("dtype", "float32")])
        model.config.hiso = meta  # config.json's "hiso": the run and the base it came from
        try:
            model.save_pretrained(tmp)
        finally:
            del model.config.hiso
    else:
        from safetensors.torch import save_file

        model = _plain_model(rm) if rm.info.get("lora") else rm.model
        # clones: tied tensors (an LM's embedding and head) are stored under both names
        want = DTYPES[meta.get("dtype", "float32")]
        tensors = {k: v.detach().to("cpu", want if v.is_floating_point() else v.dtype, copy=True).contiguous()
                   for k, v in model.state_dict().items()}
        save_file(tensors, tmp / "model.safetensors", metadata={"hiso": json.dumps(meta)})
    if tok is not None and fmt != "state-dict":
        tok.save_pretrained(tmp)
    (tmp / "README.md").write_text(model_card(meta, rm.info, base_ref))
    files = sorted([*(p.name for p in tmp.iterdir()), "hiso.json"])  # what --force may replace later, only
    (tmp / "hiso.json").write_text(json.dumps({**meta, "files": files}, indent=2))


def not_an_export(out: Path) -> str | None:
    """Why ``out`` is not an earlier export that ``--force`` may replace (None: it is one): an
    export is a directory holding its ``hiso.json`` and only the files that export wrote (the
    names its ``hiso.json`` lists; exports made before it listed them: :data:`EXPORT_FILES`)."""
    if out.is_symlink() or not out.is_dir():
        return "is a file"
    try:
        meta = json.loads((out / "hiso.json").read_text())
    except (OSError, ValueError):
        meta = None
    export = isinstance(meta, dict) and meta.get("format") in FORMATS
    listed = meta.get("files") if export else None
    wrote = set(listed) if isinstance(listed, list) else None
    names = sorted(p.name for p in out.iterdir())
    other = [n for n in names if not ((EXPORT_FILES.fullmatch(n) if wrote is None else n in wrote)
                                      and (out / n).is_file() and not (out / n).is_symlink())]
    if other:
        return f"holds {other[0]!r}, which {'the export there did' if export else 'no export does'} not write"
    return None if export else "has no export's hiso.json"


def _taken(out: Path) -> bool:
    """Whether ``out`` exists as anything but an empty directory (which the export simply takes)."""
    return out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir())))


def _check_out(out: Path, force: bool) -> None:
    """Refuse an ``--out`` the export may not take: anything but an absent or empty directory, or
    (with ``force``) an earlier export; a user's files are never replaced."""
    if not _taken(out):
        return
    why = not_an_export(out)
    if why is not None:
        raise ValueError(f"--out {out} {why}: export elsewhere (--force replaces only an earlier export)")
    if not force:
        raise ValueError(f"{out} exists (use --force to replace it)")


def _usual_modes(root: Path) -> None:
    """Modes as if created plainly (mkdtemp makes 0700; some writers 0600): readable by whom the umask allows."""
    mask = os.umask(0)
    os.umask(mask)
    for p in [root, *root.rglob("*")]:
        p.chmod((0o777 if p.is_dir() else 0o666) & ~mask)


def export(run_dir: str | Path, out: str | Path, fmt: str | None = None, round: int | None = None,
           force: bool = False, device: str = "cpu", task=None, dtype: str = "float32",
           base_dir: str | Path | None = None) -> dict[str, Any]:
    """Export round ``round`` (None: the last) of the run in ``run_dir`` into the directory ``out``
    (``task``: the run's task object; default: built from ``config.json``), a merged model or state
    dict with its floating tensors in ``dtype``; a PEFT adapter naming ``base_dir`` as its base,
    where the run's base model is written unless it is there already.

    Returns what was written: format, round, files, bytes and seconds. Bad input raises
    ValueError / FileNotFoundError before anything is written.
    """
    t0 = time.perf_counter()
    run_dir, out = Path(run_dir), Path(out)
    cfg, info = saved_config(run_dir)
    fmt = fmt or default_format(info)
    check_format(fmt, cfg, info)
    check_dtype(dtype, fmt)
    if base_dir is not None and fmt != "peft":
        raise ValueError(f"--base-dir names the base of a PEFT adapter: give --format peft (a {fmt} export holds "
                         "its whole model)")
    why = overwrites_run(out, run_dir)
    if why is not None:
        raise ValueError(f"--out {out} {why}: export elsewhere")
    _check_out(out, force)
    rm = load_run_model(run_dir, round, task=task, device=device)
    meta = metadata(rm, fmt)
    if dtype != "float32":
        meta["dtype"] = dtype
    base_ref = adapter_base(rm.info, base_dir) if fmt == "peft" else None
    if base_dir is not None:
        place_base(rm, Path(base_dir))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    try:
        _write(rm, fmt, tmp, meta, base_ref)
        _usual_modes(tmp)
        if _taken(out):  # --force over an earlier export: checked above, and again now it goes
            _check_out(out, force)
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    files = sorted(p for p in out.rglob("*") if p.is_file())
    return {"format": fmt, "round": rm.round, "out": str(out), "files": [str(p.relative_to(out)) for p in files],
            "bytes": sum(p.stat().st_size for p in files), "seconds": time.perf_counter() - t0}
