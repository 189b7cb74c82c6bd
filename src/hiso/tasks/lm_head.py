"""The output head's input made contiguous where a strided one costs a copy of the head per prompt.

transformers slices the last positions' hidden states (``logits_to_keep``) as a strided view. On
a CPU, torch's bfloat16 ``linear`` with a strided 3-d input copies the weight once per row of the
batch: for SmolLM2-135M's head (49,152 x 576) 766 MB and 100x the time of the same product on a
contiguous input (16 prompts, one kept position), for Gemma-3-270M's 5 GB. A float32 head (no
autocast) is left alone: there the strided product has no such cost, and a contiguous input would
round its logits differently from earlier runs'.
"""

from __future__ import annotations

import torch
from torch import nn


def _contiguous_input(module: nn.Module, args: tuple):
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.is_contiguous():
        return None
    if module.weight.dtype == torch.float32 and not torch.is_autocast_enabled(x.device.type):
        return None
    return (x.contiguous(), *args[1:])


def contiguous_head_input(model: nn.Module) -> None:
    """Give ``model``'s output head (``get_output_embeddings()``) a contiguous input when its
    weight is not float32 or autocast is on; its outputs are the same numbers."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if isinstance(head, nn.Module) and isinstance(getattr(head, "weight", None), torch.Tensor):
        head.register_forward_pre_hook(_contiguous_input)
