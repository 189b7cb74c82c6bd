"""A language model's shape without its weights: for timing a GPU machine that has no internet.

The benches' timings (a round against its forwards, batched against hooks perturbation, grouped
shifts, compiled forwards) depend on the model's architecture and the token counts, not on the
weights' values. Moving the weights to a lent GPU machine costs parts of 60 MB and a call each
(bench/gpu.md); the shape costs 3.5 MB (SmolLM2-135M's config and tokenizer), so the timing
checks fit one device call:

    python bench/lm_shape.py save smollm2-135m --out .xfer-setup/smollm2-shape     # here
    python bench/lm_shape.py build .xfer-setup/smollm2-shape --out /tmp/smol        # there
    python bench/llm_round.py --model /tmp/smol ...                                 # any bench

``build`` writes a model directory of that architecture with seeded random weights (the
architecture's own initialisation) and the real tokenizer, which ``--model DIR`` reads like any
local model. ``--layers N`` keeps the first N layers (a quick check on a CPU). Accuracy from
such a model means nothing: it is for time and memory only. ``--portable`` fills the weights from
numpy's PCG64 instead of the architecture's torch initialisation, so two machines with different
torch or transformers versions build the same bytes (its fingerprint is printed): a run made there
can be rebuilt here from its ``history.bin`` (``bench/gpu_session.sh``'s rebuild steps).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

SHAPE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "chat_template.jinja")


def save(name: str, out: Path) -> None:
    from hiso.tasks.lm import resolve_model

    src = Path(resolve_model(name))
    if not src.is_dir():
        sys.exit(f"lm_shape: {name} is not a local or cached model directory ({src})")
    out.mkdir(parents=True, exist_ok=True)
    copied = [f for f in SHAPE_FILES if (src / f).is_file()]
    for f in copied:
        shutil.copy(src / f, out / f)
    (out / "shape.json").write_text(json.dumps({"model": name, "files": copied}, indent=2))
    size = sum((out / f).stat().st_size for f in copied)
    print(f"{out}: {name}'s shape, {len(copied)} files, {size / 2**20:.1f} MiB")


def portable_fill(model, seed: int) -> None:
    """Every parameter from numpy's PCG64 under ``seed``, in name order: matrices uniform with
    std 0.02 (float64 draws rounded to float32), vectors (norms) ones; the same bytes on any
    machine, unlike an initialiser whose kernels a torch release may change."""
    import numpy as np
    import torch

    rng = np.random.Generator(np.random.PCG64(seed))
    half = 0.02 * 3 ** 0.5
    with torch.no_grad():
        for _, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.ndim == 1:
                p.fill_(1.0)
            else:
                v = (rng.random(p.numel()) * 2 - 1) * half
                p.copy_(torch.from_numpy(v.astype(np.float32)).view_as(p))


def build(shape: Path, out: Path, seed: int, layers: int | None, portable: bool = False) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(shape)
    if layers is not None:
        cfg.num_hidden_layers = layers
        for key in ("layer_types",):  # per-layer lists (Gemma-3) follow the layer count
            if isinstance(getattr(cfg, key, None), list):
                setattr(cfg, key, getattr(cfg, key)[:layers])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    if portable:
        portable_fill(model, seed)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for f in SHAPE_FILES:
        if f != "config.json" and (shape / f).is_file():
            shutil.copy(shape / f, out / f)
    n = sum(p.numel() for p in model.parameters())
    from hiso.tasks.lm import fingerprint

    fp = fingerprint(dict(model.state_dict()))
    print(f"{out}: {cfg.model_type}, {cfg.num_hidden_layers} layers, {n / 1e6:.1f} M parameters, "
          f"random (seed {seed}{', portable' if portable else ''}), fingerprint {fp[:16]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("save", help="copy a model's config and tokenizer (no weights) to --out")
    s.add_argument("model", help="a short name (smollm2-135m, gemma3-270m) or a local model directory")
    s.add_argument("--out", type=Path, required=True)
    b = sub.add_parser("build", help="a model directory of that shape with random weights")
    b.add_argument("shape", type=Path)
    b.add_argument("--out", type=Path, required=True)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--layers", type=int, default=None, help="keep the first N layers (quick checks)")
    b.add_argument("--portable", action="store_true",
                   help="weights from numpy's PCG64: the same bytes under any torch/transformers")
    args = ap.parse_args()
    if args.cmd == "save":
        save(args.model, args.out)
    else:
        build(args.shape, args.out, args.seed, args.layers, args.portable)


if __name__ == "__main__":
    main()
