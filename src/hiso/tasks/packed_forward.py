"""Packed forwards of a causal LM: when packing a batch pays, its packed logits, and the probe of a model.

The language tasks' ``pack=True`` (see :mod:`hiso.tasks.language`) runs a batch's prompts as one
row with position ids restarting at each prompt; these are the pieces that do not need the task."""

from __future__ import annotations

import torch
from torch import nn


def hidden_size(model: nn.Module) -> int:
    """The width of a language model's hidden states (its text config's ``hidden_size``; 0: unknown)."""
    cfg = getattr(model, "config", None)
    cfg = getattr(cfg, "get_text_config", lambda: cfg)()
    return int(getattr(cfg, "hidden_size", 0) or 0)


def packing_pays(mask: torch.Tensor, hidden: int) -> bool:
    """Whether one packed row of a batch's N real tokens costs less than its B x T padded rows.

    Per token, a transformer layer's linear maps cost ~24 d^2 flops and its attention ~4 d per
    token attended to, so a row of L tokens costs ~L (1 + L / 6d): packed N (1 + N / 6d) against
    padded B T (1 + T / 6d). Short prompts (SST-2: 32 tokens, ~2.2x padding) pack; long ones with
    little padding (SQuAD's long contexts) stay padded, where attention over the packed row would
    cost more than the padding saved.
    """
    B, T = mask.shape
    n = int(mask.sum())
    if B < 2 or n == B * T or hidden <= 0:
        return False
    tau = 6.0 * hidden
    return n * (1 + n / tau) < B * T * (1 + T / tau)


def _packed_logits(model: nn.Module, batch: dict, keep: int, device: torch.device) -> torch.Tensor:
    """The logits of each prompt's last ``keep`` positions from one packed row (padding dropped).

    Position ids restart at every prompt, which transformers reads as packed sequences and masks
    attention block-diagonally (needs ``attention_mask=None`` and no cache). A position before a
    prompt's first token (padding in the padded layout) reads the previous prompt's token here:
    like padding's, those logits are not scored (see
    :meth:`hiso.tasks.language.LanguageTask._answer_loss`).
    """
    mask = batch["attention_mask"].bool()
    ends = mask.sum(1).cumsum(0) - 1
    idx = (ends[:, None] - torch.arange(keep - 1, -1, -1)[None, :]).clamp_(min=0)
    out = model(input_ids=batch["input_ids"][mask][None].to(device),
                position_ids=batch["position_ids"][mask][None].to(device),
                attention_mask=None, use_cache=False, logits_to_keep=idx.reshape(-1).to(device)).logits
    return out[0].reshape(len(ends), keep, -1)


@torch.no_grad()
def packing_works(model: nn.Module, tok) -> bool:
    """Probe: the packed and padded float32 logits of two prompts of different lengths agree.

    A model whose attention ignores packed position ids (cross-prompt attention, or positions
    taken from the mask) fails by O(1); float rounding is ~1e-6 of the logits' scale.
    """
    rows = [tok("the cat sat on the mat and then it was", add_special_tokens=True).input_ids[:10],
            tok("it was", add_special_tokens=True).input_ids[:3]]
    rows = [r for r in rows if r]
    if len(rows) < 2 or len(rows[0]) == len(rows[1]):
        return False
    T = max(map(len, rows))
    ids = torch.full((2, T), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((2, T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):], mask[i, T - len(r):] = torch.tensor(r), 1
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_(min=0)}
    device = next(model.parameters()).device
    try:
        padded = model(**{k: v.to(device) for k, v in batch.items()}, logits_to_keep=2).logits[:, -2:].float()
        packed = _packed_logits(model, batch, 2, device).float()
    except Exception:  # noqa: BLE001 - a model that cannot take a packed row runs padded
        return False
    if len(rows[1]) < 2:
        padded[1, 0] = packed[1, 0] = 0  # the short prompt's first kept position is padding there
    scale = max(float(padded.abs().max()), 1.0)
    return bool(torch.isfinite(packed).all()) and float((packed - padded).abs().max()) <= 1e-3 * scale
