"""A base held below float32 read one tensor at a time: loading's peak is the held model plus one
float32 tensor, not the float32 model.

transformers quantizes (or casts) each weight as it reads it, but from a memory-mapped safetensors
file whose pages, once read, count as the process's own until it exits (SmolLM2-135M: +522 MB), and
glibc keeps the holes its freed float32 copies leave between the quantized tensors (+333 MB).
Here the same ``from_pretrained`` gets the same tensors through ``state_dict``, each read with
``pread`` (no mapping) when transformers asks for it, after the memory the previous one freed is
returned to the system. The modules, the quantization and so the values held are those of a
plain ``from_pretrained`` (tests/test_quantized_loading.py compares the two)."""

from __future__ import annotations

import ctypes
import json
from pathlib import Path

from torch import nn


def weight_files(source: str | Path) -> list[Path] | None:
    """The safetensors files of a local model directory, or None (a hub name, .bin weights)."""
    d = Path(source)
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    index = d / "model.safetensors.index.json"
    if index.is_file():
        return [d / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return None


def _libc_trim():
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to return
        return lambda: None
    trim.argtypes = [ctypes.c_size_t]
    return lambda: trim(0)


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


def from_pretrained(source: str | Path, files: list[Path], **kw) -> nn.Module | None:
    """``AutoModelForCausalLM.from_pretrained(source, **kw)`` with the weights read a tensor at a
    time from ``files`` (:func:`weight_files`); None for a model class the auto mapping does not
    know (custom code: to be read as usual)."""
    from safetensors import safe_open
    from transformers import AutoConfig, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    config = AutoConfig.from_pretrained(str(source))
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        return None
    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    trim, weights = _libc_trim(), _Weights()
    for f in files:
        handle = safe_open(str(f), framework="pt", device="cpu", backend="pread")
        weights.update({k: _Slice(handle.get_slice(k), trim) for k in handle.keys()})
    model = cls.from_pretrained(None, config=config, state_dict=weights, **kw)
    weights.clear()
    trim()
    try:  # from a directory, from_pretrained reads it too
        model.generation_config = GenerationConfig.from_pretrained(str(source))
    except OSError:
        pass
    return model
