"""What the language-model benches share: their model and task flags, the thread count and a
device-synchronising timer hook, and the parameter count their FLOP estimates use."""

from __future__ import annotations

import argparse


def add_model_args(ap: argparse.ArgumentParser, autocast: str = "auto") -> None:
    """--task --model --data-dir --lora-r --algorithm --autocast --batch-size --threads --device."""
    ap.add_argument("--task", default="sst2")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data-dir", required=True)
    ap.add_argument("--lora-r", type=int)
    ap.add_argument("--algorithm", default="hiso")
    ap.add_argument("--autocast", default=autocast)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")


def start(args):
    """Set torch's threads; returns (cuda?, a function that waits for the device)."""
    import torch

    torch.set_num_threads(args.threads)
    cuda = args.device.startswith("cuda")
    return cuda, (torch.cuda.synchronize if cuda else (lambda: None))


def model_config(args, **extra):
    """The bench's RunConfig: the paper's LLM federation (6 clients, 2 a round) on the flags' model."""
    from hiso.config import load_config

    return load_config(device=args.device, task=args.task, model=args.model, data_dir=args.data_dir,
                       lora_r=args.lora_r, algorithm=args.algorithm, autocast=args.autocast, clients=6, sampled=2,
                       batch_size=args.batch_size, lr=1e-6, eval_max=16, min_size=2, **extra)


def body_params(model) -> int:
    """Parameters outside the embedding and the LM head: 2 x this x tokens is a forward's work
    (a lower bound: attention products and the label head left out)."""
    return sum(p.numel() for n, p in model.named_parameters() if "embed" not in n and "lm_head" not in n)
