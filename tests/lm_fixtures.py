"""A tiny randomly initialised causal LM (Llama architecture) with a word-level tokenizer, and tiny
SST-2 / QQP / SQuAD files in their real formats: the language tasks tested with no downloads."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = ("a the it was great terrible movie film good bad fun dull is this what why how do i "
         "can you question same are these two ask thing answer context who where paris france "
         "capital of city river seine flows through 1 2 3 yes no").split()
SPECIAL = ["[PAD]", "[UNK]", "[EOS]"]
PUNCT = list("?:.,!\n")


def write_tiny_lm(path: Path, seed: int = 0, hidden: int = 16) -> Path:
    """Save a 2-layer Llama with tied embeddings and its tokenizer to ``path`` (from_pretrained-able)."""
    import torch
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(SPECIAL + PUNCT + list(WORDS))}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]", eos_token="[EOS]")
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=True, pad_token_id=0, eos_token_id=2, bos_token_id=None)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path


_SST2 = [("this movie was great", 1), ("a dull film", 0), ("it is fun", 1), ("this is bad", 0),
         ("what a good film", 1), ("terrible movie", 0), ("the film is good", 1), ("a bad thing", 0)]


def write_sst2(path: Path, n: int = 48) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, count in (("train.tsv", n), ("dev.tsv", 12)):
        rows = ["sentence\tlabel"] + [f"{_SST2[i % 8][0]} \t{_SST2[i % 8][1]}" for i in range(count)]
        (path / name).write_text("\n".join(rows) + "\n")
    return path


def write_qqp(path: Path, n: int = 40) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    qs = ["how do i ask a question", "what is the capital of france", "why is this film good",
          "can you answer this", "who flows through paris"]
    for name, count in (("train.tsv", n), ("dev.tsv", 10)):
        rows = ["id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate"]
        for i in range(count):
            rows.append(f"{i}\t{2 * i}\t{2 * i + 1}\t{qs[i % 5]}\t{qs[(i * 3) % 5]}\t{int(i % 5 == (i * 3) % 5)}")
        (path / name).write_text("\n".join(rows) + "\n")
    return path


def write_squad(path: Path, n: int = 24) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    ctx = "paris is the capital of france . the river seine flows through paris ."
    qas = [("what is the capital of france ?", ["paris"]), ("what flows through paris ?", ["the river seine", "seine"]),
           ("paris is the capital of what ?", ["france"])]
    for name, count in (("train-v1.1.json", n), ("dev-v1.1.json", 6)):
        items = [{"id": f"{name}-{i}", "question": qas[i % 3][0],
                  "answers": [{"text": a, "answer_start": ctx.find(a)} for a in qas[i % 3][1]]}
                 for i in range(count)]
        doc = {"version": "1.1", "data": [{"title": "", "paragraphs": [{"context": ctx, "qas": items}]}]}
        (path / name).write_text(json.dumps(doc))
    return path


def write_lm_files(d: Path, *datasets: str) -> dict:
    """The tiny LM and the named datasets (sst2, qqp, squad) under ``d``: {"lm": path, name: path}."""
    writers = {"sst2": write_sst2, "qqp": write_qqp, "squad": write_squad}
    return {"lm": str(write_tiny_lm(d / "lm")), **{n: str(writers[n](d / n)) for n in datasets}}
