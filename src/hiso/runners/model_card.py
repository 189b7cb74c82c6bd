"""An export's model card: README.md in the Hugging Face format (YAML front matter, then what was
trained, on what, how, the run's result and how to ask the model), naming no path of the machine
that made it."""

from __future__ import annotations

import json


def _front(meta: dict, hub: str | None) -> list[str]:
    tags = ["hiso", "federated-learning", "zeroth-order", *(["lora"] if meta.get("lora") else [])]
    return ["---", *([f"base_model: {hub}"] if hub else []),
            f"library_name: {'peft' if meta['format'] == 'peft' else 'transformers'}",
            *(["pipeline_tag: text-generation"] if meta.get("base_model") else []),
            f"tags: [{', '.join(tags)}]", "---", ""]


def _what(meta: dict, info: dict) -> list[str]:
    from ..tasks.lm import SHORT_NAMES
    out = ["## What was trained", ""]
    base, hub = meta.get("base_model"), meta.get("base_model_hub_id")
    if base:
        line = f"- base model: `{base}`"
        if base in SHORT_NAMES:
            line += (f", {SHORT_NAMES[base]}: the 4-bit GGUF of `{hub}` dequantized to float32 (the hub's own "
                     f"weights differ slightly; `hiso export --base-dir DIR` writes the run's exact base)")
        elif hub and hub != base:
            line += f" (`{hub}` on the Hugging Face hub)"
        out += [line, f"- base weights sha256 (hiso fingerprint): `{meta['base_fingerprint']}`"]
    if lo := meta.get("lora"):
        out.append(f"- LoRA adapters r = {lo['r']}, alpha = {lo['alpha']:g} on {', '.join(lo['targets'])}; "
                   "the base frozen")
    elif base:
        out.append("- all parameters trained")
    if meta.get("dtype"):
        out.append(f"- weights written in {meta['dtype']} (`--dtype`), merged in float32 first")
    if "n_train" in info:
        part = info.get("partition")
        out.append(f"- data: {info.get('dataset', meta['task'])}, {info['n_train']} training examples over "
                   f"{info.get('num_clients', '?')} clients ({part}" + (f", alpha {info['alpha']:g}" if
                                                                         info.get("alpha") else "") + ")"
                   + (f"; {info['n_eval']} held-out examples scored" if "n_eval" in info else ""))
    else:
        out.append(f"- task: {meta['task']}")
    return out + [""]


def _how(meta: dict) -> list[str]:
    out = ["## How", "",
           f"- method: {meta['algorithm']}, federated zeroth-order fine-tuning with hiso: clients send seeds and "
           "scalars, never weights; the model is its base plus that log, rebuilt bit for bit by `hiso rebuild`",
           f"- run `{meta['run']}`, seed {meta['seed']}, exported at round {meta['round']}"
           + (f" of {meta['trained']['rounds']}" if meta.get("trained", {}).get("rounds") else ""),
           f"- configuration sha256: `{meta['config_sha256']}`"]
    if t := meta.get("trained"):
        if t.get("bytes_up_mean") is not None:
            out.append(f"- bytes per client over the whole run (mean): {t['bytes_up_mean']:.0f} up, "
                       f"{t['bytes_down_mean']:.0f} down")
    if dp := meta.get("privacy"):
        spent = (f"({dp['epsilon']:.3g}, {dp['delta']:g})-DP at round {meta['round']} for the client that took part "
                 f"in the most rounds ({dp['participations_max']}), against a reader who knows who took part"
                 if dp["epsilon"] is not None else "no epsilon reported (no delta given)")
        out.append(f"- differential privacy ({dp['mode']}): scalars clipped at {dp['clip']:g}, noise multiplier "
                   f"{dp['noise_multiplier']:.4g}; {spent}")
    logged = meta.get("metrics_logged_at_round", {})
    if logged:
        out += ["", "## Result", ""]
        out += [f"- {k} logged by the run at this round: {v:.6g}" for k, v in logged.items()]
    return out + [""]


def _load(meta: dict, base_ref: str | None) -> list[str]:
    fmt = meta["format"]
    if fmt == "state-dict":
        return ["## Load", "", "```python", "from safetensors.torch import load_file",
                "model.load_state_dict(load_file(DIR + '/model.safetensors'))  # model: the run's architecture",
                "```", ""]
    lines = ["## Load and ask it", "", "`DIR` is this directory.", "", "```python", "import torch",
             "from transformers import AutoModelForCausalLM, AutoTokenizer"]
    if fmt == "peft":
        lines += ["from peft import PeftModel", "",
                  f"base = AutoModelForCausalLM.from_pretrained({base_ref!r})  # adapter_config.json's "
                  "base_model_name_or_path",
                  "model = PeftModel.from_pretrained(base, DIR).eval()"]
    else:
        lines += ["", "model = AutoModelForCausalLM.from_pretrained(DIR).eval()"]
    lines.append("tok = AutoTokenizer.from_pretrained(DIR)")
    prompt = meta.get("prompt") or {}
    words = prompt.get("label_words")
    template = prompt.get("template")
    if template and words:
        fields = {k: "..." for k in _fields(template)}
        lines += [f"prompt = {template!r}.format(**{fields!r})  # the run's prompt; fill in your text",
                  f"words = [tok(w, add_special_tokens=False).input_ids[0] for w in {json.dumps(words)}]",
                  "with torch.no_grad():",
                  "    logits = model(**tok(prompt, return_tensors='pt')).logits[0, -1]",
                  "print(int(logits[words].argmax()))  # the class: the label word with the larger logit"]
    elif template:
        fields = {k: "..." for k in _fields(template)}
        lines += [f"prompt = {template!r}.format(**{fields!r})  # the run's prompt; fill in your text",
                  "out = model.generate(**tok(prompt, return_tensors='pt'), max_new_tokens=16, do_sample=False)",
                  "print(tok.decode(out[0], skip_special_tokens=True))"]
    return lines + ["```", ""]


def _fields(template: str) -> list[str]:
    import string
    return [f for _, f, _, _ in string.Formatter().parse(template) if f]


def model_card(meta: dict, info: dict, base_ref: str | None = None) -> str:
    """README.md for an export described by ``meta`` (hiso.json) of a run whose task_info is
    ``info``; ``base_ref``: what a PEFT adapter names as its base."""
    from ..tasks.lm import SHORT_NAMES
    task = info.get("dataset", meta["task"])
    hub = meta.get("base_model_hub_id")
    title = [f"# {task} fine-tuned with hiso ({meta['algorithm']}, round {meta['round']})", "",
             f"Exported by `hiso export --format {meta['format']}` from a federated zeroth-order fine-tuning run.", ""]
    body = _what(meta, info) + _how(meta) + _load(meta, base_ref)
    if meta["format"] == "peft" and meta.get("base_model") in SHORT_NAMES and base_ref == hub:
        body += [f"`{hub}` is the hub model the run's base was quantized from: on it the adapter gives nearly, not "
                 "exactly, the run's model.", ""]
    return "\n".join(_front(meta, hub) + title + body)
