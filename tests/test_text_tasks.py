"""Your own data (tasks ``text`` and ``instruct``): local CSV / TSV / JSON lines / Parquet files read by
``datasets``, runs on a tiny LM, exports that classify and answer from another directory, bad files
refused in one line, bit-exact rebuilds. No downloads."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")
pytest.importorskip("datasets")

from lm_fixtures import write_tiny_lm  # noqa: E402

from cli_helpers import run_cli  # noqa: E402
from hiso.data.files import read_rows  # noqa: E402
from hiso.tasks.text import FileTask  # noqa: E402

REVIEWS = [("this movie was great", "good"), ("a dull film", "bad"), ("it is fun", "good"), ("this is bad", "bad"),
           ("what a good film", "good"), ("terrible movie", "bad"), ("the film is good", "good"), ("a bad thing", "bad")]
QA = [("what is the capital of france ?", "paris"), ("what flows through paris ?", "the river seine"),
      ("paris is the capital of what ?", "france")]


def write_csv(path, rows, header=("text", "label"), sep=","):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([sep.join(header), *(sep.join(r) for r in rows)]) + "\n")
    return path


def write_jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def lm(tmp_path_factory):
    return str(write_tiny_lm(tmp_path_factory.mktemp("text") / "lm"))


@pytest.fixture(scope="module")
def reviews(tmp_path_factory):
    d = tmp_path_factory.mktemp("reviews")
    write_csv(d / "train.csv", [REVIEWS[i % 8] for i in range(40)])
    write_csv(d / "dev.csv", [REVIEWS[i % 8] for i in range(8)])
    return d


def _run(lm, data, out, *extra, task="text", rounds=3):
    return ["run", "--task", task, "--model", lm, "--data-dir", str(data), "--clients", "3", "--sampled", "2",
            "--rounds", str(rounds), "--eval-every", str(rounds), "--lr", "0.5", "--mu", "1e-2", "--batch-size", "4",
            "--out", str(out), "--quiet", *extra]


def _rebuilds(run, tmp_path, capsys):
    code, _, err = run_cli(["rebuild", str(run), "--out", str(tmp_path / "rb.pt")], capsys)
    assert code == 0, err
    ckpt, rb = torch.load(run / "model.pt"), torch.load(tmp_path / "rb.pt")
    assert ckpt["model"].keys() == rb["model"].keys() and rb["round"] == ckpt["round"]
    assert all(torch.equal(ckpt["model"][k], rb["model"][k]) for k in ckpt["model"])


def _classify(model, tok, meta, sentence):
    """As docs/llm.md says: the template, then the largest label word's logit at the last token."""
    words = [tok(w, add_special_tokens=False).input_ids[0] for w in meta["label_words"]]
    with torch.no_grad():
        logits = model(**tok(meta["template"].format(text=sentence), return_tensors="pt")).logits[0, -1]
    return meta["labels"][int(logits[words].argmax())]


def test_text_run_exports_classify_from_another_directory_and_rebuild(lm, reviews, tmp_path, capsys, monkeypatch):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run = tmp_path / "run"
    code, _, err = run_cli(_run(lm, reviews, run, "--lora-r", "8", "--min-size", "2"), capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert "eval_acc" in rows[0] and "eval_acc" in rows[-1]
    info = json.loads((run / "config.json").read_text())["task_info"]
    assert info["labels"] == ["bad", "good"] and info["label_words"] == [" bad", " good"]
    assert info["partition"] == "dirichlet" and info["n_train"] == 40 and info["n_eval"] == 8
    assert len(info["data_files"]["train"]["sha256"]) == 64
    for fmt in ("peft", "merged"):
        code, _, err = run_cli(["export", str(run), "--out", str(tmp_path / fmt), "--format", fmt], capsys)
        assert code == 0, err
    _rebuilds(run, tmp_path, capsys)

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    meta = json.loads((tmp_path / "merged" / "hiso.json").read_text())["prompt"]
    assert meta == {"template": "{text}\nAnswer:", "label_words": [" bad", " good"], "labels": ["bad", "good"]}
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lm), tmp_path / "peft").eval()
    for sentence in ("a good film", "this movie is dull"):
        assert _classify(merged, tok, meta, sentence) == _classify(adapter, tok, meta, sentence) in ("bad", "good")


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "tsv"])
def test_other_formats_give_the_csvs_examples(lm, reviews, tmp_path, fmt):
    d = tmp_path / fmt
    d.mkdir()
    rows = [{"review": t, "stars": {"good": 2, "bad": 1}[y]} for t, y in REVIEWS]
    if fmt == "jsonl":
        write_jsonl(d / "train.jsonl", rows * 2)
    elif fmt == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq
        pq.write_table(pa.Table.from_pylist(rows * 2), d / "train.parquet")
    else:
        write_csv(d / "train.tsv", [(r["review"], str(r["stars"])) for r in rows * 2], ("review", "stars"), "\t")
    write_csv(d / "validation.csv", [(t, str({"good": 2, "bad": 1}[y])) for t, y in REVIEWS], ("review", "stars"))
    task = FileTask("text", 2, model=lm, data_dir=str(d), columns=("review", "stars"), label_words=[" bad", " good"],
                    min_size=2)
    want = FileTask("text", 2, model=lm, data_dir=str(reviews), columns=("text", "label"), min_size=2)
    assert task._data["eval"] == want._data["eval"] and task.labels == ["1", "2"]
    assert [e.text_a for e in task._data["train"]] == [t for t, _ in REVIEWS * 2]
    assert [task.labels[e.label] for e in task._data["train"]] == [str({"good": 2, "bad": 1}[y]) for _, y in REVIEWS * 2]


def test_label_words_as_label_word_pairs_fix_the_label_set(lm, reviews):
    task = FileTask("text", 2, model=lm, data_dir=str(reviews), columns=("text", "label"),
                    label_words=["good= great", "bad= terrible"], min_size=2)
    assert task.labels == ["good", "bad"] and task.label_words == (" great", " terrible")
    assert [task.labels[e.label] for e in task._data["train"][:8]] == [y for _, y in REVIEWS]


def test_a_client_column_is_the_federations_own_split(lm, tmp_path, capsys):
    d = tmp_path / "fed"
    rows = [(t, y, ["north", "south", "east"][i % 3]) for i, (t, y) in enumerate(REVIEWS * 3)]
    write_csv(d / "train.csv", rows, ("text", "label", "client"))
    write_csv(d / "test.csv", REVIEWS, ("text", "label"))
    task = FileTask("text", 3, model=lm, data_dir=str(d), columns=("text", "label"))
    parts = task._data["parts"]
    assert task.client_names == ["east", "north", "south"]
    assert [[rows[i][2] for i in p] for p in parts] == [[c] * 8 for c in task.client_names]
    code, _, err = run_cli(_run(lm, d, tmp_path / "r", "--clients", "4"), capsys)
    assert code == 2 and "3 clients (east, north, south)" in err and "--clients 4" in err
    code, _, err = run_cli(_run(lm, d, tmp_path / "r2", "--partition", "iid"), capsys)
    assert code == 2 and "drop --partition" in err


def test_instruct_run_reports_exact_match_and_f1_exports_and_rebuilds(lm, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tmp_path / "qa"
    write_jsonl(d / "train.jsonl", [{"prompt": q, "response": a} for q, a in QA * 8])
    write_jsonl(d / "dev.jsonl", [{"prompt": q, "response": a} for q, a in QA])
    run = tmp_path / "run"
    code, _, err = run_cli(_run(lm, d, run, "--lora-r", "8", "--max-new-tokens", "4", task="instruct"), capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert {"eval_em", "eval_f1", "eval_loss"} <= rows[-1].keys() and 0 <= rows[-1]["eval_f1"] <= 1
    _rebuilds(run, tmp_path, capsys)
    code, _, err = run_cli(["export", str(run), "--out", str(tmp_path / "merged")], capsys)
    assert code == 0, err
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tok = AutoTokenizer.from_pretrained(tmp_path / "merged")
    prompt = json.loads((tmp_path / "merged" / "hiso.json").read_text())["prompt"]["template"].format(prompt=QA[0][0])
    ids = tok(prompt, return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids.input_ids.shape[1]


def test_the_instruct_loss_is_on_the_response_tokens_only(lm, tmp_path):
    d = tmp_path / "qa"
    write_csv(d / "train.csv", QA * 4, ("prompt", "response"))
    write_csv(d / "dev.csv", QA, ("prompt", "response"))
    task = FileTask("instruct", 2, model=lm, data_dir=str(d), columns=("prompt", "response"))
    b = task._encode(task._data["train"][:2], with_answers=True)
    answer = task.tok(" " + QA[0][1], add_special_tokens=False).input_ids + [task.tok.eos_token_id]
    assert b["answer_lens"].tolist() == [len(answer), len(task.tok(" " + QA[1][1]).input_ids) + 1]
    assert b["input_ids"][0, -len(answer):].tolist() == answer
    model = task.build_model()
    one = task._encode(task._data["train"][:1], with_answers=True)
    with torch.no_grad():
        ids = one["input_ids"]
        logits = model(input_ids=ids).logits[0, :-1]
        want = torch.nn.functional.cross_entropy(logits[-len(answer):], ids[0, -len(answer):])
        assert torch.allclose(task.loss(model, one), want, atol=1e-5)  # the response and EOS, no prompt token


@pytest.mark.parametrize("bad,where", [
    ("text,stars\nfine,good\n", "train.csv, row 1, column 'label': no such column"),
    ("text,label\nfine,good\nalso fine,\n", "train.csv, row 2, column 'label': empty label"),
    ("text,label\nfine,good\n ,bad\n", "train.csv, row 2, column 'text': empty text"),
    ("text,label\nfine,good\nalso fine,good\n", "train.csv, column 'label': labels ['good']; a classifier needs two"),
    ("text,label\n", "train.csv: not a readable csv file"),  # (datasets: no data)
])
def test_a_bad_training_file_is_one_line_naming_file_row_and_column(lm, reviews, tmp_path, capsys, bad, where):
    d = tmp_path / "bad"
    d.mkdir()
    (d / "train.csv").write_text(bad)
    (d / "dev.csv").write_text((reviews / "dev.csv").read_text())
    code, _, err = run_cli(_run(lm, d, tmp_path / "r", "--min-size", "1"), capsys)
    assert code == 2 and where in err and len(err.strip().splitlines()) == 1, err


def test_a_held_out_label_outside_the_label_set_is_refused(lm, reviews, tmp_path, capsys):
    d = tmp_path / "bad"
    write_csv(d / "train.csv", REVIEWS * 3)
    write_csv(d / "dev.csv", [*REVIEWS[:3], ("a film", "meh")])
    code, _, err = run_cli(_run(lm, d, tmp_path / "r", "--min-size", "2"), capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "dev.csv, row 4, column 'label': 'meh' is not a label (labels 'bad', 'good', those of train.csv)" in err
    code, _, err = run_cli(_run(lm, reviews, tmp_path / "r2", "--label-words", "good= great,meh= dull"), capsys)
    assert code == 2 and "train.csv, row 2, column 'label': 'bad' is not a label" in err and "--label-words" in err


def test_unreadable_files_and_wrong_options_are_one_line(lm, reviews, tmp_path, capsys):
    d = tmp_path / "broken"
    d.mkdir()
    (d / "train.jsonl").write_text('{"text": "fine", "label": "good"}\n{"text": \n')
    (d / "dev.csv").write_text((reviews / "dev.csv").read_text())
    code, _, err = run_cli(_run(lm, d, tmp_path / "r"), capsys)
    assert code == 2 and "train.jsonl: not a readable jsonl file" in err and len(err.strip().splitlines()) == 1
    code, _, err = run_cli(_run(lm, tmp_path / "none", tmp_path / "r"), capsys)
    assert code == 2 and "data directory not found" in err
    code, _, err = run_cli(_run(lm, reviews, tmp_path / "r", "--prompt-column", "q"), capsys)
    assert code == 2 and "task text does not use it (it is for instruct)" in err
    code, _, err = run_cli(["run", "--task", "sst2", "--text-column", "review", "--out", str(tmp_path / "s")], capsys)
    assert code == 2 and "it is for text" in err
    code, _, err = run_cli(_run(lm, reviews, tmp_path / "r", "--label-words", " bad, good, great"), capsys)
    assert code == 2 and "2 labels (bad, good) but --label-words gives 3 words" in err


def test_read_rows_reads_csv_cells_as_written(tmp_path):
    p = write_csv(tmp_path / "x.csv", [("NA", "1.50"), ('"a, quoted ""one"""', "2")])
    cols, rows = read_rows(p)
    assert cols == ["text", "label"] and rows[0]["text"] == "NA" and rows[1]["text"] == 'a, quoted "one"'
