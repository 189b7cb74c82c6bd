"""Text loaders (GLUE TSV, SQuAD JSON, Hugging Face `datasets`) on tiny real-format files."""

from __future__ import annotations

import json
import sys
import types
from collections import Counter
from pathlib import Path

import pytest

from hiso.data import DataError
from hiso.data.text import (
    ClassificationExample,
    QAExample,
    find_text_file,
    load_glue_tsv,
    load_squad_json,
    load_text_task,
)

# CI checks out ../shared beside the repo; see /work/shared/data/README.md for the counts.
SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"

SST2_HEADER = "sentence\tlabel\n"
QQP_HEADER = "id\tqid1\tqid2\tquestion1\tquestion2\tis_duplicate\n"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def squad_doc(paragraphs: list[dict]) -> dict:
    return {"version": "1.1", "data": [{"title": "", "paragraphs": paragraphs}]}


def qa(qid: str, question: str, *answers: str) -> dict:
    return {
        "id": qid,
        "question": question,
        "answers": [{"text": a, "answer_start": 0} for a in answers],
    }


SQUAD = squad_doc(
    [
        {
            "context": "Denver Broncos won Super Bowl 50.",
            "qas": [
                qa("q1", "Who won?", "Denver Broncos", "Broncos", "Denver Broncos"),
                qa("q2", "Which Super Bowl?", "50"),
            ],
        },
        {"context": "Paris is in France.", "qas": [qa("q3", "Where is Paris?", "France")]},
    ]
)


# ---------------------------------------------------------------- GLUE TSV


def test_sst2_parses_text_and_labels_with_quotes(tmp_path):
    """An unbalanced leading quote must not swallow the following rows (QUOTE_NONE)."""
    p = write(
        tmp_path / "dev.tsv",
        SST2_HEADER
        + "it 's a charming journey . \t1\n"
        + '" a quote that never closes\t0\n'
        + 'he said "fine" and left\t1\n',
    )
    got = load_glue_tsv(p, "sst2")
    assert got == [
        ClassificationExample("it 's a charming journey . ", None, 1),
        ClassificationExample('" a quote that never closes', None, 0),
        ClassificationExample('he said "fine" and left', None, 1),
    ]


def test_qqp_parses_pairs_by_header_name(tmp_path):
    p = write(
        tmp_path / "dev.tsv",
        QQP_HEADER
        + "1\t10\t11\tHow do I learn Python?\tWhat is the best way to learn Python?\t1\n"
        + '2\t12\t13\tWhat does "carpe diem" mean?\tIs Rome old?\t0\n',
    )
    got = load_glue_tsv(p, "qqp")
    assert got == [
        ClassificationExample("How do I learn Python?", "What is the best way to learn Python?", 1),
        ClassificationExample('What does "carpe diem" mean?', "Is Rome old?", 0),
    ]
    # columns are found by name, not position
    shuffled = write(
        tmp_path / "other.tsv",
        "is_duplicate\tquestion2\tquestion1\n0\tsecond?\tfirst?\n",
    )
    assert load_glue_tsv(shuffled, "qqp") == [ClassificationExample("first?", "second?", 0)]


def test_csv_quoted_qqp_file_is_unquoted(tmp_path):
    """Few-shot QQP files were re-saved with csv quoting: every field with a quote is wrapped."""
    p = write(
        tmp_path / "dev.tsv",
        QQP_HEADER
        + '1\t10\t11\t"What does ""carpe diem"" mean?"\tWhat is Latin?\t0\n'
        + '2\t12\t13\tPlain question?\t"""Hello"" in French?"\t1\n',
    )
    got = load_glue_tsv(p, "qqp")
    assert got[0].text_a == 'What does "carpe diem" mean?'
    assert got[1].text_b == '"Hello" in French?'
    assert got[1].text_a == "Plain question?"


def test_unquoted_file_keeps_wrapped_looking_fields_verbatim(tmp_path):
    """One unwrapped quote marks the file as GLUE's raw format: no field is unquoted."""
    p = write(
        tmp_path / "dev.tsv",
        QQP_HEADER
        + '1\t10\t11\t"Carpe diem"\tWhat is Latin?\t0\n'
        + '2\t12\t13\tWhat does "carpe diem" mean?\tIs it Latin?\t1\n',
    )
    assert load_glue_tsv(p, "qqp")[0].text_a == '"Carpe diem"'


def test_wrong_header_names_file_and_columns(tmp_path):
    p = write(tmp_path / "dev.tsv", "text\tlabel\nhello\t1\n")
    with pytest.raises(DataError, match=r"dev\.tsv.*sentence"):
        load_glue_tsv(p, "sst2")
    q = write(tmp_path / "qqp.tsv", SST2_HEADER + "hello\t1\n")
    with pytest.raises(DataError, match=r"qqp\.tsv.*question1.*question2"):
        load_glue_tsv(q, "qqp")


def test_test_file_without_labels_is_rejected(tmp_path):
    p = write(tmp_path / "test.tsv", "index\tsentence\n0\thello\n")
    with pytest.raises(DataError, match="labels are required"):
        load_glue_tsv(p, "sst2")


@pytest.mark.parametrize("label", ["2", "-1", "pos", ""])
def test_bad_label_names_file_and_line(tmp_path, label):
    p = write(tmp_path / "dev.tsv", SST2_HEADER + "good\t1\n" + f"bad\t{label}\n")
    with pytest.raises(DataError, match=r"dev\.tsv, line 3: label .*expected 0 or 1"):
        load_glue_tsv(p, "sst2")


def test_malformed_row_names_file_and_line(tmp_path):
    p = write(
        tmp_path / "dev.tsv",
        QQP_HEADER + "1\t10\t11\tq1?\tq2?\t0\n" + "2\t12\t13\tcut off here\n",
    )
    with pytest.raises(DataError, match=r"dev\.tsv, line 3: 4 tab-separated fields.*has 6"):
        load_glue_tsv(p, "qqp")


def test_empty_tsv_is_an_error(tmp_path):
    with pytest.raises(DataError, match="empty file"):
        load_glue_tsv(write(tmp_path / "a.tsv", ""), "sst2")
    with pytest.raises(DataError, match="no examples"):
        load_glue_tsv(write(tmp_path / "b.tsv", SST2_HEADER), "sst2")


def test_missing_tsv_names_path_and_source(tmp_path):
    with pytest.raises(DataError, match=r"nope\.tsv: file not found.*gluebenchmark\.com"):
        load_glue_tsv(tmp_path / "nope.tsv", "sst2")


def test_unknown_glue_task():
    with pytest.raises(ValueError, match="unknown text task"):
        load_glue_tsv("x.tsv", "mnli")


# ---------------------------------------------------------------- SQuAD JSON


def test_squad_json_parses_questions_with_deduplicated_answers(tmp_path):
    p = write(tmp_path / "dev-v1.1.json", json.dumps(SQUAD))
    got = load_squad_json(p)
    assert got == [
        QAExample(
            "q1", "Who won?", "Denver Broncos won Super Bowl 50.", ("Denver Broncos", "Broncos")
        ),
        QAExample("q2", "Which Super Bowl?", "Denver Broncos won Super Bowl 50.", ("50",)),
        QAExample("q3", "Where is Paris?", "Paris is in France.", ("France",)),
    ]


def test_truncated_json_names_file(tmp_path):
    text = json.dumps(SQUAD)
    p = write(tmp_path / "dev-v1.1.json", text[: len(text) // 2])
    with pytest.raises(DataError, match=r"dev-v1\.1\.json: not valid JSON"):
        load_squad_json(p)


@pytest.mark.parametrize(
    ("drop", "expected"),
    [
        (lambda d: d.pop("data"), "the top level has no key 'data'"),
        (lambda d: d["data"][0].pop("paragraphs"), r"data\[0\] has no key 'paragraphs'"),
        (
            lambda d: d["data"][0]["paragraphs"][1].pop("context"),
            r"data\[0\]\.paragraphs\[1\] has no key 'context'",
        ),
        (
            lambda d: d["data"][0]["paragraphs"][0]["qas"][1].pop("question"),
            r"data\[0\]\.paragraphs\[0\]\.qas\[1\] has no key 'question'",
        ),
        (
            lambda d: d["data"][0]["paragraphs"][0]["qas"][0]["answers"][1].pop("text"),
            r"data\[0\]\.paragraphs\[0\]\.qas\[0\]\.answers\[1\] has no key 'text'",
        ),
    ],
)
def test_missing_key_names_file_and_place(tmp_path, drop, expected):
    doc = json.loads(json.dumps(SQUAD))
    drop(doc)
    p = write(tmp_path / "train-v1.1.json", json.dumps(doc))
    with pytest.raises(DataError, match=r"train-v1\.1\.json: " + expected):
        load_squad_json(p)


def test_wrong_type_and_unanswerable_question(tmp_path):
    doc = json.loads(json.dumps(SQUAD))
    doc["data"] = {"oops": 1}
    with pytest.raises(DataError, match=r"\['data'\] is a dict, expected a list"):
        load_squad_json(write(tmp_path / "a.json", json.dumps(doc)))
    doc = json.loads(json.dumps(SQUAD))
    doc["data"][0]["paragraphs"][1]["qas"][0]["answers"] = []
    with pytest.raises(DataError, match=r"qas\[0\] has no answers"):
        load_squad_json(write(tmp_path / "b.json", json.dumps(doc)))


# ---------------------------------------------------------------- discovery in a data dir


def test_load_text_task_finds_glue_files(tmp_path):
    write(tmp_path / "train.tsv", SST2_HEADER + "good\t1\nbad\t0\n")
    write(tmp_path / "dev.tsv", SST2_HEADER + "fine\t1\n")
    assert [e.text_a for e in load_text_task("sst2", tmp_path, "train")] == ["good", "bad"]
    assert [e.text_a for e in load_text_task("sst2", str(tmp_path), "eval")] == ["fine"]


def test_squad_discovery_prefers_official_name_then_subset(tmp_path):
    write(tmp_path / "train-v1.1-subset.json", json.dumps(SQUAD))
    assert find_text_file("squad", tmp_path, "train").name == "train-v1.1-subset.json"
    write(tmp_path / "train-v1.1.json", json.dumps(squad_doc([SQUAD["data"][0]["paragraphs"][1]])))
    assert find_text_file("squad", tmp_path, "train").name == "train-v1.1.json"
    assert [e.id for e in load_text_task("squad", tmp_path, "train")] == ["q3"]
    # the eval split looks for dev-v1.1*.json, never the train file
    with pytest.raises(DataError, match=r"dev-v1\.1\.json, then dev-v1\.1\*\.json"):
        load_text_task("squad", tmp_path, "eval")
    write(tmp_path / "dev-v1.1-subset.json", json.dumps(SQUAD))
    assert [e.id for e in load_text_task("squad", tmp_path, "eval")] == ["q1", "q2", "q3"]


def test_ambiguous_squad_subsets_are_an_error(tmp_path):
    write(tmp_path / "dev-v1.1-a.json", json.dumps(SQUAD))
    write(tmp_path / "dev-v1.1-b.json", json.dumps(SQUAD))
    with pytest.raises(DataError, match=r"dev-v1\.1-a\.json, dev-v1\.1-b\.json"):
        find_text_file("squad", tmp_path, "eval")


def test_missing_directory_names_path_and_how_to_get(tmp_path):
    missing = tmp_path / "no-such-dir"
    with pytest.raises(DataError, match=r"no-such-dir: directory not found.*gluebenchmark") as e:
        load_text_task("qqp", missing, "train")
    assert "pip install -e '.[hf]'" in str(e.value)
    with pytest.raises(DataError, match=r"no-such-dir: directory not found.*SQuAD"):
        load_text_task("squad", missing, "eval")


def test_missing_file_names_what_was_looked_for(tmp_path):
    write(tmp_path / "train.tsv", QQP_HEADER + "1\t2\t3\ta?\tb?\t0\n")
    with pytest.raises(DataError, match=r"dev\.tsv: file not found \(looked for dev\.tsv\)") as e:
        load_text_task("qqp", tmp_path, "eval")
    assert "gluebenchmark.com" in str(e.value) and "omit --data-dir" in str(e.value)
    with pytest.raises(DataError, match=r"train-v1\.1\.json, then train-v1\.1\*\.json.*SQuAD"):
        load_text_task("squad", tmp_path, "train")


def test_bad_task_or_split():
    with pytest.raises(ValueError, match="unknown text task"):
        load_text_task("mnli", None, "train")
    with pytest.raises(ValueError, match="split must be"):
        load_text_task("sst2", "/tmp", "test")


# ---------------------------------------------------------------- Hugging Face `datasets`


def fake_datasets(monkeypatch, tables: dict, calls: list | None = None):
    """Install a stand-in ``datasets`` whose ``load_dataset(*name, split=)`` reads ``tables``."""
    module = types.ModuleType("datasets")

    def load_dataset(*name, split):
        if calls is not None:
            calls.append((name, split))
        return tables[(name, split)]

    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_hf_glue_rows_become_examples(monkeypatch):
    calls: list = []
    fake_datasets(
        monkeypatch,
        {
            (("glue", "sst2"), "train"): [{"sentence": "good ", "label": 1, "idx": 0}],
            (("glue", "sst2"), "validation"): [
                {"sentence": "bad ", "label": 0, "idx": 0},
                {"sentence": "ok ", "label": 1, "idx": 1},
            ],
            (("glue", "qqp"), "validation"): [
                {"question1": "a?", "question2": "b?", "label": 1, "idx": 7}
            ],
        },
        calls,
    )
    assert load_text_task("sst2", None, "train") == [ClassificationExample("good ", None, 1)]
    assert load_text_task("sst2", None, "eval") == [
        ClassificationExample("bad ", None, 0),
        ClassificationExample("ok ", None, 1),
    ]
    assert load_text_task("qqp", None, "eval") == [ClassificationExample("a?", "b?", 1)]
    assert calls == [
        (("glue", "sst2"), "train"),
        (("glue", "sst2"), "validation"),
        (("glue", "qqp"), "validation"),
    ]


def test_hf_squad_rows_become_examples(monkeypatch):
    row = {
        "id": "q1",
        "title": "T",
        "context": "Denver Broncos won.",
        "question": "Who won?",
        "answers": {
            "text": ["Denver Broncos", "Broncos", "Denver Broncos"],
            "answer_start": [0, 7, 0],
        },
    }
    fake_datasets(monkeypatch, {(("squad",), "validation"): [row]})
    assert load_text_task("squad", None, "eval") == [
        QAExample("q1", "Who won?", "Denver Broncos won.", ("Denver Broncos", "Broncos"))
    ]


def test_hf_unlabelled_rows_are_rejected(monkeypatch):
    """GLUE's test split on the Hub carries label -1; it must not pass as a class."""
    fake_datasets(monkeypatch, {(("glue", "sst2"), "train"): [{"sentence": "x", "label": -1}]})
    with pytest.raises(DataError, match="row 0: label -1"):
        load_text_task("sst2", None, "train")


def test_hf_load_failure_says_to_pass_data_dir(monkeypatch):
    module = types.ModuleType("datasets")

    def load_dataset(*name, split):
        raise ConnectionError("no network")

    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)
    with pytest.raises(DataError, match=r"glue/qqp \[train\]: cannot load.*no network.*--data-dir"):
        load_text_task("qqp", None, "train")


def test_without_datasets_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(DataError, match="not installed") as e:
        load_text_task("squad", None, "train")
    assert "--data-dir" in str(e.value) and "pip install -e '.[hf]'" in str(e.value)


# ---------------------------------------------------------------- the real files, when present


@pytest.mark.skipif(
    not SHARED_DATA.is_dir(), reason=f"real data not found at {SHARED_DATA} (CI's ../shared/data)"
)
def test_real_shared_data_smoke():
    sst2 = load_text_task("sst2", SHARED_DATA / "sst2", "eval")
    assert len(sst2) == 872
    assert Counter(e.label for e in sst2) == {0: 428, 1: 444}

    qqp = load_text_task("qqp", SHARED_DATA / "qqp", "eval")
    assert len(qqp) == 1000
    assert Counter(e.label for e in qqp) == {0: 617, 1: 383}
    assert all(e.text_b for e in qqp)
    # the file is csv-quoted; no field may keep its doubled quotes
    assert not any('""' in e.text_a or '""' in (e.text_b or "") for e in qqp)
    assert any('"' in e.text_a for e in qqp)

    squad = load_text_task("squad", SHARED_DATA / "squad", "eval")
    assert len(squad) == 697
    assert len({e.id for e in squad}) == 697
    assert all(e.answers and len(set(e.answers)) == len(e.answers) for e in squad)
    assert all(e.context and e.question for e in squad)


@pytest.mark.skipif(
    not SHARED_DATA.is_dir(), reason=f"real data not found at {SHARED_DATA} (CI's ../shared/data)"
)
def test_real_shared_train_files_match_the_data_readme():
    """Row and class counts of the train files as shared/data/README.md gives them: no header row,
    blank line or quoting error adds, drops or merges a row."""
    sst2 = load_text_task("sst2", SHARED_DATA / "sst2", "train")
    assert Counter(e.label for e in sst2) == {0: 29780, 1: 37569}
    assert not any("\t" in e.text_a or "\n" in e.text_a for e in sst2)
    qqp = load_text_task("qqp", SHARED_DATA / "qqp", "train")
    assert Counter(e.label for e in qqp) == {0: 5079, 1: 5038}
    assert not any('""' in e.text_a + e.text_b or "\t" in e.text_a + e.text_b for e in qqp)
    squad = load_text_task("squad", SHARED_DATA / "squad", "train")
    assert len(squad) == len({e.id for e in squad}) == 5010
    assert all(a in e.context for e in squad for a in e.answers)  # extractive: answers are spans
