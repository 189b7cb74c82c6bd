"""Prompt-based fine-tuning of a causal LM: SST-2, QQP (classification) and SQuAD (extractive QA).

Classification (``sst2``, ``qqp``): the prompt (e.g. SST-2 ``"<sentence> It was"``) is fed to the
model and the logits of the label words (``" terrible"`` / ``" great"``) at the prompt's last
token are compared. The loss is the cross-entropy of the softmax over the label words only (the
rest of the vocabulary is ignored), ``eval_acc`` the share of examples whose correct label word
has the larger logit. Label words must be single tokens of the model's tokenizer.

QA (``squad``): the prompt (context, question, ``"Answer:"``) is followed by the gold answer and
an end-of-sequence token; the loss is the mean cross-entropy on those answer tokens (teacher
forcing). Evaluation decodes greedily and scores with the standard SQuAD v1.1 normalisation:
``eval_em`` (exact match) and ``eval_f1`` (token F1), each the max over the gold answers.

Prompts longer than ``max_length`` tokens lose tokens from the left (the end of a prompt, where
the question and the answer cue are, is kept). Batches are left-padded with explicit position
ids, so every prompt ends at the last position and padding does not change a prompt's result.

Packed forwards (``pack=True``, the default): a batch's prompts, padding dropped, run as one row
whose position ids restart at each prompt, so transformers' attention masks keep the prompts
apart. SST-2 training batches are ~2.2x padding at 32 tokens, and a forward's cost is its
tokens' (``bench/llm_packing.py``), so packing makes the forward ~2x cheaper; the logits equal
the padded ones up to float rounding. A batch is packed only where that costs less: attention
over the packed row grows with its square (see :func:`~hiso.tasks.packed_forward.packing_pays`).
Models whose attention does not follow packed position ids are found by a probe on load (packed
and padded logits of two prompts must agree) and run padded.

Every random choice (train/eval subsets, partition, batches, LoRA init) is a function of the run
seed and (client, round, step), as :class:`~hiso.tasks.base.Task` requires. Data are loaded on
first use, so ``hiso rebuild`` (which only needs the model) reads no data.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cached_property
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from ..data import DataError
from ..data import partition as partitioners
from ..data.partition import label_entropy, label_histograms
from . import lm
from .base import Task
from .lm_head import contiguous_head_input
from .packed_forward import _packed_logits, hidden_size, packing_pays, packing_works
from .prompts import _FIELDS, CLASSIFICATION, LANGUAGE_TASKS, QA, _check_template
from .registry import register_task

_SALT_BATCH = 0x7E47
_SALT_SUBSET = 0x5B5E
_SALT_LORA = 0x10FA
_SALT_VAL = 0x7A1D


class LanguageTask(Task):
    """A federated prompt-based task on a causal LM (see the module docstring)."""

    def __init__(self, name: str, num_clients: int, seed: int = 0, *, model: str = "smollm2-135m",
                 data_dir: str | None = None, partition: str | None = None, alpha: float = 1.0,
                 min_size: int = 10, train_max: int | None = None, eval_max: int | None = None,
                 max_length: int | None = None, template: str | None = None,
                 label_words: list[str] | None = None, lora_r: int | None = None,
                 lora_alpha: float = 16.0, lora_targets: list[str] | tuple[str, ...] = ("q_proj", "v_proj"),
                 autocast: str = "auto", eval_batch_size: int = 16, max_new_tokens: int = 16,
                 pack: bool = True, val_fraction: float = 0.0, strip_text: bool = True,
                 device: str = "cpu", perturb_mode: str = "hooks", base_dtype: str = "float32",
                 quantize_embedding: bool = True):
        super().__init__(num_clients, seed)
        if name not in LANGUAGE_TASKS:
            raise ValueError(f"unknown language task {name!r} (choose from {', '.join(LANGUAGE_TASKS)})")
        self.name = name
        self.qa = name in QA
        spec = QA[name] if self.qa else CLASSIFICATION[name]
        self.template = template or spec["template"]
        _check_template(name, self.template)
        self.max_length = int(max_length or spec["max_length"])
        if partition is None:
            partition = "iid" if self.qa else "dirichlet"
        if self.qa and partition != "iid":
            raise ValueError(f"{name} has no labels to skew: use partition iid")
        self.partition, self.alpha, self.min_size = partition, float(alpha), int(min_size)
        self.train_max, self.eval_max = train_max, eval_max
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction}")
        self.val_fraction = float(val_fraction)
        self.data_dir = data_dir
        self.strip_text = bool(strip_text)
        self.eval_batch_size, self.max_new_tokens = int(eval_batch_size), int(max_new_tokens)
        self.lora = None if lora_r is None else {"r": int(lora_r), "alpha": float(lora_alpha),
                                                 "targets": list(lora_targets)}
        self.autocast, self.autocast_why = lm.resolve_autocast(autocast, lora=self.lora is not None, device=device,
                                                               batched=perturb_mode == "batched")

        if base_dtype != "float32" and self.lora is None:
            raise ValueError(f"base_dtype {base_dtype} needs LoRA (the base is frozen at that precision)")
        self.base_dtype, self.device = base_dtype, device
        self.quantize_embedding = bool(quantize_embedding)
        self.model_name = model
        self.source = lm.resolve_model(model)
        self.tok = lm.load_tokenizer(model, self.source)
        self.label_ids = None
        if not self.qa and (label_words or spec["label_words"]):  # (text: set from its files' labels)
            self._set_label_words(tuple(label_words or spec["label_words"]))
        self._spare: nn.Module | None = None
        self._fingerprint: str | None = None
        self.pack = bool(pack)
        self._pack_ok: bool | None = None  # the probe's verdict (None: not probed yet)

    def _set_label_words(self, words: tuple[str, ...]) -> None:
        ids = [self.tok(w, add_special_tokens=False).input_ids for w in words]
        bad = [w for w, i in zip(words, ids) if len(i) != 1]
        if bad:
            raise ValueError(f"label words {bad} are not single tokens for {self.model_name}; choose others "
                             "(--label-words), e.g. with a leading space")
        self.label_words = words
        self.label_ids = torch.tensor([i[0] for i in ids])

    # ------------------------------------------------------------------ model

    def _fresh_model(self) -> nn.Module:
        model = lm.load_model(self.model_name, self.source, self.base_dtype, self.device,
                             quantize_embedding=self.quantize_embedding)
        if self.lora is not None:
            model = lm.add_lora(model, self.lora["r"], self.lora["alpha"], self.lora["targets"],
                                seed=int(np.random.SeedSequence([_SALT_LORA, self.seed]).generate_state(1)[0]))
        contiguous_head_input(model)
        if self.pack and self._pack_ok is None:  # here, before any forward (which may run under vmap)
            self._pack_ok = packing_works(model, self.tok)
        return model

    def build_model(self) -> nn.Module:
        """The pretrained model (float32), with fresh seeded LoRA adapters if asked for."""
        if self._spare is not None:
            model, self._spare = self._spare, None
            return model
        return self._fresh_model()

    def base_fingerprint(self) -> str:
        """sha256 of the weights a run starts from and does not replicate (the frozen base under
        LoRA, the whole initial model otherwise)."""
        if self._fingerprint is None:
            if self._spare is None:
                self._spare = self._fresh_model()  # handed on to the next build_model call
            model = self._spare
            frozen = lm.frozen_tensors(model) if self.base_dtype == "float32" else lm.frozen_state(model)
            self._fingerprint = lm.fingerprint(frozen or dict(model.named_parameters()))
        return self._fingerprint

    def _autocast(self, device: torch.device):
        if self.autocast != "bf16":
            return nullcontext()
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)

    def _logits(self, model: nn.Module, batch: dict, keep: int) -> torch.Tensor:
        """Float32 logits of each prompt's last ``keep`` positions, (batch, keep, vocab)."""
        device = next(model.parameters()).device
        if self.pack and packing_pays(batch["attention_mask"], hidden_size(model)) and self._packs(model):
            with self._autocast(device):
                return _packed_logits(model, batch, keep, device).float()
        kw = {k: batch[k].to(device) for k in ("input_ids", "attention_mask", "position_ids")}
        with self._autocast(device):
            out = model(**kw, logits_to_keep=keep).logits
        return out[:, -keep:].float()

    def _packs(self, model: nn.Module) -> bool:
        """Whether packed forwards give this model's padded logits (probed once, in float32)."""
        if self._pack_ok is None:  # a model this task did not build: probe it, unless under vmap
            if torch._C._functorch.peek_interpreter_stack() is not None:
                return False
            self._pack_ok = packing_works(model, self.tok)
        return self._pack_ok

    # ------------------------------------------------------------------ data

    @cached_property
    def _data(self) -> dict[str, Any]:
        train, ev = self._load()
        if not train or not ev:
            raise DataError(f"{self.name}: empty {'train' if not train else 'eval'} split")
        train = self._subset(train, self.train_max, 0)
        ev = self._subset(ev, self.eval_max, 1)
        ev, val = self._split_val(ev)
        labels = np.zeros(len(train), dtype=np.int64) if self.qa else np.array([e.label for e in train])
        parts = self._partition(train, labels)
        classes = 1 if self.qa else len(self.label_words)
        return {"train": train, "eval": ev, "val": val, "parts": parts,
                "label_hist": label_histograms(labels, parts, classes)}

    def _load(self) -> tuple[list, list]:
        """The (train, held-out) examples, before subsets and the validation split."""
        from ..data.text import load_text_task
        return list(load_text_task(self.name, self.data_dir, "train")), list(load_text_task(self.name, self.data_dir, "eval"))

    def _partition(self, train: list, labels: np.ndarray) -> list[np.ndarray]:
        """Each client's indices into ``train`` (the examples ``train_max`` kept)."""
        return partitioners.partition(self.partition, labels, self.num_clients, self.seed,
                                      alpha=self.alpha, min_size=self.min_size)

    def _split_val(self, held_out: list) -> tuple[list, list]:
        """``(test, val)``: a seeded ``val_fraction`` of the held-out examples kept apart, so that
        ``hiso compare`` picks lr and round on examples it does not report (as the vision tasks do)."""
        if self.val_fraction == 0:
            return held_out, []
        n_val = int(round(self.val_fraction * len(held_out)))
        if not 0 < n_val < len(held_out):
            raise ValueError(f"val_fraction {self.val_fraction} of {len(held_out)} held-out examples leaves an "
                             "empty validation or test split")
        perm = np.random.default_rng([_SALT_VAL, self.seed]).permutation(len(held_out))
        return [held_out[i] for i in np.sort(perm[n_val:])], [held_out[i] for i in np.sort(perm[:n_val])]

    def _subset(self, examples: list, limit: int | None, which: int) -> list:
        if limit is None or limit >= len(examples):
            return examples
        pick = np.sort(np.random.default_rng([_SALT_SUBSET, which, self.seed]).choice(len(examples), limit, replace=False))
        return [examples[i] for i in pick]

    @property
    def label_hist(self) -> np.ndarray:
        return self._data["label_hist"]

    def _prompt(self, ex) -> str:
        """The template filled with the example's fields, each stripped (``strip_text``), as the
        authors' code and MeZO do: GLUE's SST-2 sentences all end with a space, which otherwise
        becomes a token of its own before the template's text."""
        fields = {k: getattr(ex, f) for k, f in _FIELDS[self.name].items()}
        if self.strip_text:
            fields = {k: v.strip() for k, v in fields.items()}
        return self.template.format(**fields)

    def _encode(self, examples: list, with_answers: bool) -> dict[str, torch.Tensor]:
        """Tokenize, truncate from the left, left-pad; with_answers appends the first gold answer + EOS."""
        tok = self.tok
        rows, answer_lens = [], []
        for ex in examples:
            ids = tok(self._prompt(ex), add_special_tokens=True).input_ids
            head = ids[:1] if ids and tok.bos_token_id is not None and ids[0] == tok.bos_token_id else []
            tail = []
            if with_answers:
                tail = tok(" " + ex.answers[0].strip(), add_special_tokens=False).input_ids + [tok.eos_token_id]
                tail = tail[: self.max_length // 2]
            room = self.max_length - len(head) - len(tail)
            body = ids[len(head):]
            rows.append(head + body[max(len(body) - room, 0):] + tail)
            answer_lens.append(len(tail))
        T = max(len(r) for r in rows)
        ids = torch.full((len(rows), T), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), T), dtype=torch.long)
        for i, r in enumerate(rows):
            ids[i, T - len(r):] = torch.tensor(r)
            mask[i, T - len(r):] = 1
        out = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(1) - 1).clamp_(min=0)}
        if with_answers:
            out["answer_lens"] = torch.tensor(answer_lens)
        return out

    def _collate(self, examples: list) -> dict[str, torch.Tensor]:
        batch = self._encode(examples, with_answers=self.qa)
        if not self.qa:
            batch["labels"] = torch.tensor([e.label for e in examples])
        return batch

    def batch(self, client: int, round: int, step: int, batch_size: int) -> dict[str, torch.Tensor]:
        """Distinct examples of ``client``'s data, fixed by (seed, client, round, step)."""
        if not 0 <= client < self.num_clients:
            raise IndexError(f"client {client} out of range [0, {self.num_clients})")
        own = self._data["parts"][client]
        rng = np.random.default_rng([self.seed, client, round, step, _SALT_BATCH])
        pick = own[rng.choice(len(own), size=min(batch_size, len(own)), replace=False)]
        return self._collate([self._data["train"][i] for i in pick])

    # ------------------------------------------------------------------ loss and evaluation

    def _class_logits(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self._logits(model, batch, 1)[:, -1, self.label_ids.to(batch["input_ids"].device)]

    def _answer_loss(self, model: nn.Module, batch: dict, reduction: str = "mean") -> torch.Tensor:
        """Cross-entropy on the answer tokens; rows are left-padded so answers end every row."""
        lens = batch["answer_lens"]
        K = int(lens.max()) + 1
        logits = self._logits(model, batch, K)[:, :-1]  # position t predicts token t+1
        target = batch["input_ids"][:, -(K - 1):].to(logits.device).clone()
        pos = torch.arange(K - 1, device=logits.device)
        target[pos[None, :] < (K - 1 - lens.to(logits.device))[:, None]] = -100
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                               ignore_index=-100, reduction="sum")
        return loss / lens.sum() if reduction == "mean" else loss

    def loss(self, model: nn.Module, batch: dict) -> torch.Tensor:
        if self.qa:
            return self._answer_loss(model, batch)
        logits = self._class_logits(model, batch)
        return F.cross_entropy(logits, batch["labels"].to(logits.device))

    def _eval_batches(self, examples: list, what: str):
        starts = range(0, len(examples), self.eval_batch_size)
        for s in tqdm(starts, desc=f"eval {self.name} ({what})", unit="batch", leave=False, disable=None):
            yield examples[s: s + self.eval_batch_size]

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> dict[str, float]:
        """Classification: ``eval_loss``, ``eval_acc``. SQuAD: ``eval_loss``, ``eval_em``, ``eval_f1``.
        With a validation split (``val_fraction``) the same metrics as ``val_*`` on it as well."""
        was_training = model.training
        model.eval()
        score = self._evaluate_qa if self.qa else self._evaluate_cls
        try:
            out = score(model, self._data["eval"], "eval")
            if self._data["val"]:
                out.update(score(model, self._data["val"], "val"))
            return out
        finally:
            model.train(was_training)

    def _evaluate_cls(self, model: nn.Module, examples: list, prefix: str) -> dict[str, float]:
        loss, correct, n = 0.0, 0, 0
        for exs in self._eval_batches(examples, f"{prefix}, scoring"):
            b = self._collate(exs)
            logits = self._class_logits(model, b)
            y = b["labels"].to(logits.device)
            loss += float(F.cross_entropy(logits, y, reduction="sum"))
            correct += int((logits.argmax(1) == y).sum())
            n += len(exs)
        return {f"{prefix}_loss": loss / n, f"{prefix}_acc": correct / n}

    def _evaluate_qa(self, model: nn.Module, examples: list, prefix: str) -> dict[str, float]:
        from .qa_metrics import exact_match, f1

        device = next(model.parameters()).device
        loss, tokens, em, f = 0.0, 0, 0.0, 0.0
        n = 0
        for exs in self._eval_batches(examples, f"{prefix}, generating"):
            b = self._encode(exs, with_answers=True)
            loss += float(self._answer_loss(model, b, reduction="sum"))
            tokens += int(b["answer_lens"].sum())
            for ex, pred in zip(exs, self.generate(model, exs, device)):
                em += exact_match(pred, list(ex.answers))
                f += f1(pred, list(ex.answers))
            n += len(exs)
        return {f"{prefix}_loss": loss / tokens, f"{prefix}_em": em / n, f"{prefix}_f1": f / n}

    def generate(self, model: nn.Module, examples: list, device: torch.device | None = None) -> list[str]:
        """Greedy answers (up to ``max_new_tokens``), each its first non-blank line (``strip_text``;
        without it the first line, so a reply that begins with a line break is the empty answer)."""
        device = device or next(model.parameters()).device
        b = self._encode(examples, with_answers=False)
        with self._autocast(device):
            out = model.generate(input_ids=b["input_ids"].to(device), attention_mask=b["attention_mask"].to(device),
                                 max_new_tokens=self.max_new_tokens, do_sample=False,
                                 pad_token_id=self.tok.pad_token_id, eos_token_id=self.tok.eos_token_id)
        texts = self.tok.batch_decode(out[:, b["input_ids"].shape[1]:], skip_special_tokens=True)
        return [(t.strip() if self.strip_text else t).split("\n")[0].strip() for t in texts]

    # ------------------------------------------------------------------ facts

    def client_sizes(self) -> list[int]:
        return [len(p) for p in self._data["parts"]]

    def describe(self) -> dict[str, Any]:
        d = self._data
        sizes = self.client_sizes()
        if self._spare is None:
            self._spare = self._fresh_model()  # handed on to the next build_model call
        model = self._spare
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        info = {
            "task": "language", "dataset": self.name, "data_dir": self.data_dir,
            "n_train": len(d["train"]), "n_eval": len(d["eval"]), "n_val": len(d["val"]),
            "num_clients": self.num_clients,
            "partition": self.partition, "alpha": None if self.partition == "iid" else self.alpha,
            "client_size_min": int(min(sizes)), "client_size_max": int(max(sizes)),
            "model": self.model_name, "model_source": lm.portable_source(self.model_name),
            **({"hub_id": lm.hub_id(self.model_name)} if lm.hub_id(self.model_name) else {}),
            "template": self.template, "max_length": self.max_length,
            "autocast": self.autocast, "autocast_why": self.autocast_why,
            "packed_forwards": self.pack and self._packs(model),
            "lora": self.lora, "trainable_params": trainable,
            "total_params": sum(p.numel() for p in model.parameters()),
            "base_fingerprint": self.base_fingerprint(),
        }
        if not self.qa:
            info["label_words"] = list(self.label_words)
            info["label_entropy_mean_bits"] = float(label_entropy(d["label_hist"]).mean())
        return info


def _builder(name: str, cls: type = LanguageTask, extra=lambda cfg: {}):
    """``build(cfg)`` of task ``name``: a ``cls`` with the run's language options (and ``extra(cfg)``'s)."""
    def build(cfg) -> LanguageTask:
        split = lambda s: [w for w in s.split(",") if w.strip()]  # noqa: E731
        o = cfg.task_options  # (hiso.tasks.options: the data's and the language model's)
        return cls(name, cfg.clients, seed=cfg.seed, model=o.model, data_dir=o.data_dir,
                   partition=o.partition, alpha=o.alpha, min_size=o.min_size,
                   train_max=o.train_max, eval_max=o.eval_max, max_length=o.max_length, template=o.template,
                   label_words=split(o.label_words) if o.label_words else None,
                   lora_r=o.lora_r, lora_alpha=o.lora_alpha, lora_targets=[t.strip() for t in split(o.lora_targets)],
                   autocast=o.autocast, eval_batch_size=o.eval_batch_size,
                   max_new_tokens=o.max_new_tokens, pack=o.pack_sequences,
                   val_fraction=o.val_fraction, strip_text=o.strip_text,
                   device=cfg.device, perturb_mode=cfg.perturb_mode, base_dtype=o.base_dtype,
                   quantize_embedding=o.quantize_embedding,
                   **extra(cfg))
    return build


# ZO lrs: full parameters at the authors' OPT-125M DeComFL value; LoRA at the best of the SST-2
# LoRA grid measured with SmolLM2-135M (docs/results.md). Gemma-3-270M's LoRA diverges at that
# 1e-2 within 10 rounds and DeComFL's collapses after ~40 at 3e-3; 1e-3 held for 80 rounds
# (docs/results.md, "Gemma-3-270M"). No first-order default.
_LM_LR = {"zo": 5e-6, "zo+lora": 1e-2, "zo+lora@gemma3-270m": 1e-3}
_LM_OPTIONS = {"data_dir", "partition", "alpha", "min_size", "eval_max", "val_fraction", "train_max", "model",
               "max_length", "template", "lora_r", "lora_alpha", "lora_targets", "autocast", "eval_batch_size",
               "pack_sequences", "strip_text", "base_dtype", "quantize_embedding"}
for _name, _doc in (("sst2", "SST-2 sentiment, prompt + label words on a causal LM"),
                    ("qqp", "QQP paraphrase, prompt + label words on a causal LM")):
    register_task(_name, metrics={"eval_acc": "max", "eval_loss": "min"}, default_lr=_LM_LR,
                  default_partition="dirichlet", validation=True, doc=_doc,
                  options=_LM_OPTIONS | {"label_words"})(_builder(_name))
register_task("squad", metrics={"eval_f1": "max", "eval_em": "max", "eval_loss": "min"}, default_lr=_LM_LR,
              default_partition="iid", validation=True, doc="SQuAD extractive QA, greedy answers of a causal LM",
              options=_LM_OPTIONS | {"max_new_tokens"})(_builder("squad"))
