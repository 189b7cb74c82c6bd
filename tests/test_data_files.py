"""Your own files (tasks ``text`` and ``instruct``): which held-out file is read, and the order of
a label set (hiso.data.files); no model needed."""

import pytest

from hiso.data.files import label_order, split_files


def test_numeric_labels_are_in_numeric_order_others_alphabetical():
    assert label_order(["10", "2", "1", "2"]) == ["1", "2", "10"]
    assert label_order(["-1", "10", "0.5", "9"]) == ["-1", "0.5", "9", "10"]
    assert label_order(["b", "10", "a", "2"]) == ["10", "2", "a", "b"]  # not all numbers: as text


def test_a_text_files_numeric_labels_index_in_numeric_order(tmp_path):
    pytest.importorskip("datasets")
    from hiso.data.files import read_text
    path = tmp_path / "train.csv"
    path.write_text("text,label\na,10\nb,2\nc,1\nd,2\n")
    labels, examples = read_text(path, "text", "label", None, "those of train.csv", True)
    assert labels == ["1", "2", "10"] and [e.label for e in examples] == [2, 1, 0, 1]


@pytest.mark.parametrize("held_out, read", [
    (["dev.csv", "validation.csv", "test.csv"], "dev.csv"),
    (["test.csv", "dev.jsonl"], "dev.jsonl"),  # whatever the formats
    (["test.tsv", "validation.parquet"], "validation.parquet"),
    (["test.csv"], "test.csv"),
])
def test_the_held_out_file_is_the_first_of_dev_validation_test(tmp_path, held_out, read):
    for name in ["train.csv", *held_out]:
        (tmp_path / name).write_text("text,label\na,1\n")
    assert split_files(tmp_path, "text") == {"train": tmp_path / "train.csv", "eval": tmp_path / read}
