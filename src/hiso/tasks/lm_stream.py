"""A base held below float32 read one tensor at a time: loading's peak is the held model plus one
float32 tensor, not the float32 model.

transformers quantizes (or casts) each weight as it reads it, but from a memory-mapped safetensors
file whose pages, once read, count as the process's own until it exits (SmolLM2-135M: +522 MB), and
glibc keeps the holes its freed float32 copies leave between the quantized tensors (+333 MB).
Here the same ``from_pretrained`` gets the same tensors through ``state_dict``, each read with
``pread`` (no mapping) when transformers asks for it, after the memory the previous one freed is
returned to the system. The embedding and an untied head, which an int8 or int4 base quantizes
after loading (:func:`hiso.tasks.lm.quantize_embeddings`), stay views of the mapped file instead,
and each block of rows quantized is released from the process (:func:`release_mapped`), so they
are never resident whole in float32 either. The modules, the quantization and so the values
held are those of a plain ``from_pretrained`` (tests/test_quantized_loading.py compares them)."""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import torch
from torch import nn

from ..heap import return_freed


def weight_files(source: str | Path) -> list[Path] | None:
    """The safetensors files of a local model directory, or None (a hub name, .bin weights)."""
    d = Path(source)
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return None


class _Slice:
    """One tensor of a safetensors file, read with ``pread`` when indexed (transformers reads
    ``slice[...]``), once glibc has returned the pages freed since the last read."""

    def __init__(self, inner, trim):
        self._inner, self._trim = inner, trim

    def __getitem__(self, index):
        self._trim()
        return self._inner[index]

    def __getattr__(self, name):  # get_shape, get_dtype, ...
        return getattr(self._inner, name)


class _Weights(dict):
    """The checkpoint's tensors by name; ``from_pretrained`` deep-copies its keywords, and file
    handles do not copy."""

    def __deepcopy__(self, memo):
        return self


def from_pretrained(source: str | Path, files: list[Path], map_vocabulary: bool = False,
                    **kw) -> nn.Module | None:
    """``AutoModelForCausalLM.from_pretrained(source, **kw)`` with the weights read a tensor at a
    time from ``files`` (:func:`weight_files`); ``map_vocabulary``: the tensors with a row per
    vocabulary entry (embedding, head) left views of the mapped file, for a caller that reads
    them by blocks of rows (and releases each, :func:`release_mapped`). None for a model class the
    auto mapping does not know (custom code: to be read as usual)."""
    from safetensors import safe_open
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(str(source))
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    trim, weights = return_freed, _Weights()
    vocab = getattr(config.get_text_config(), "vocab_size", None) if map_vocabulary else None
    for f in files:
        try:
            handle = safe_open(str(f), framework="pt", device="cpu", backend="pread")
        except TypeError:  # safetensors before its backends: read as usual
            return None
        mapped = safe_open(str(f), framework="pt", device="cpu", backend="mmap") if vocab else None
        for k in handle.keys():
            shape = handle.get_slice(k).get_shape()
            by_rows = vocab is not None and len(shape) == 2 and shape[0] == vocab
            weights[k] = mapped.get_slice(k) if by_rows else _Slice(handle.get_slice(k), trim)
    model = cls.from_pretrained(None, config=config, state_dict=weights, **kw)
    weights.clear()
    trim()
    model.name_or_path = model.config._name_or_path = str(source)  # as from the directory (peft records it)
    try:  # from a directory, from_pretrained reads it too
        model.generation_config = GenerationConfig.from_pretrained(str(source))
    except OSError:
        pass
    return model


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _file_mapping(t: torch.Tensor) -> tuple[int, int] | None:
    """The address range of the mapped file ``t`` lies in, or None (memory of the process's own)."""
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    try:
        lines = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in parts[0].split("-"))
        if start <= lo and hi <= end:
            path = parts[5] if len(parts) == 6 else ""
            return (start, end) if path.endswith(".safetensors") else None
    return None


def release_mapped(t: torch.Tensor) -> None:
    """Drop the resident pages of ``t`` if it is a view of a mapped safetensors file (read rows of
    an embedding): they count as the process's until then, and are read again from the file if
    touched. The mapping is private and never written, so nothing is lost; memory of the
    process's own is left alone."""
    span = _file_mapping(t) if t.numel() else None
    if span is None:
        return
    lo = max(span[0], t.data_ptr() // _PAGE * _PAGE)
    hi = min(span[1], -(-(t.data_ptr() + t.numel() * t.element_size()) // _PAGE) * _PAGE)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
    except OSError:
        return
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.madvise(lo, hi - lo, 4)  # MADV_DONTNEED
