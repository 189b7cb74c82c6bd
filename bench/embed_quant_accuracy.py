"""The base's evaluation loss and accuracy before training with its input embedding and output
head held as each quantized base may hold them: float32 (hiso before issue 56: neither library
quantizes them), int8 per row (hiso's choice) and NF4 in blocks of 64 (what an int4 base's
linears get; simulated: quantized and dequantized back to float32, for the accuracy only).

    python bench/embed_quant_accuracy.py --data-dir ../shared/data/sst2 --model smollm2-135m --eval-max 200

One JSON line per (base dtype, embedding): eval_loss, eval_acc, and the change from the row with
a float32 embedding.
"""

from __future__ import annotations

import argparse
import json

import torch


def _nf4_roundtrip(model):
    """The embedding and head replaced by their NF4 (blocks of 64) quantize-dequantize round trip."""
    import bitsandbytes.functional as bf
    done = {}
    for m in (model.get_input_embeddings(), model.get_output_embeddings()):
        w = m.weight
        if id(w) not in done:
            q, state = bf.quantize_4bit(w.detach().float(), blocksize=64, quant_type="nf4")
            done[id(w)] = torch.nn.Parameter(bf.dequantize_4bit(q, state).float(), requires_grad=False)
        m.weight = done[id(w)]
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--task", default="sst2")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lora-r", type=int, default=8)
    ap.add_argument("--eval-max", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--arms", default="float32:float32,int8:float32,int8:int8,int4:float32,int4:int8,int4:nf4")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from hiso.config import load_config
    from hiso.tasks import lm
    from hiso.tasks.registry import build_task

    keep = lm.quantize_embeddings
    ref = {}
    for arm in args.arms.split(","):
        dtype, emb = arm.split(":")
        lm.quantize_embeddings = {"float32": lambda m: m, "int8": keep, "nf4": _nf4_roundtrip}[emb]
        cfg = load_config(None, task=args.task, model=args.model, data_dir=args.data_dir, lora_r=args.lora_r,
                          base_dtype=dtype, eval_max=args.eval_max, seed=args.seed, threads=args.threads)
        task = build_task(cfg)
        ev = task.evaluate(task.build_model())
        ref.setdefault(dtype, ev) if emb == "float32" else None
        base = ref.get(dtype)
        print(json.dumps({"model": args.model, "base_dtype": dtype, "embedding": emb, "eval_max": args.eval_max,
                          "seed": args.seed, **ev, **({"d_loss": ev["eval_loss"] - base["eval_loss"],
                                                       "d_acc": ev["eval_acc"] - base["eval_acc"]} if base else {})}),
              flush=True)
    lm.quantize_embeddings = keep


if __name__ == "__main__":
    main()
