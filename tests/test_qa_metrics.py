"""SQuAD v1.1 metrics against cases worked out by hand from the official script's rules."""

from __future__ import annotations

import pytest

from hiso.tasks.qa_metrics import exact_match, f1, normalize_answer, squad_scores


def test_normalize_lowercases_strips_punctuation_articles_and_spaces():
    assert normalize_answer("The Cat!") == "cat"
    assert normalize_answer("  A  quick\tbrown   fox. ") == "quick brown fox"
    assert normalize_answer("an Apple, the pear") == "apple pear"
    # articles only as whole words
    assert normalize_answer("Theatre another") == "theatre another"


def test_normalize_removes_punctuation_before_articles():
    """Official order: "the-end" loses its hyphen first, leaving no article to remove."""
    assert normalize_answer("the-end") == "theend"
    assert normalize_answer("the end") == "end"


def test_exact_match_after_normalisation():
    assert exact_match("The Cat!", ["cat"]) == 1.0
    assert exact_match("cat", ["dog"]) == 0.0
    assert exact_match("black cat", ["cat"]) == 0.0
    assert exact_match("dog", ["cat", "The dog."]) == 1.0


def test_f1_by_hand():
    # pred {big, red, dog}, gold {red, dog}: P = 2/3, R = 1, F1 = 2PR/(P+R) = 4/5
    assert f1("the big red dog", ["red dog"]) == pytest.approx(0.8)
    assert f1("red dog", ["red dog"]) == pytest.approx(1.0)
    assert f1("green cat", ["red dog"]) == 0.0


def test_f1_counts_repeated_tokens_once_per_match():
    """Multiset overlap: "dog dog" vs "dog" is P = 1/2, R = 1, F1 = 2/3; against "dog dog" both
    dogs match (F1 1), where a set overlap would count one (P = R = 1/2)."""
    assert f1("dog dog", ["dog"]) == pytest.approx(2 / 3)
    assert f1("dog dog", ["dog dog"]) == pytest.approx(1.0)
    # pred {red, dog, dog}, gold {dog, dog, barks}: 2 shared, P = R = 2/3
    assert f1("red dog dog", ["dog dog barks"]) == pytest.approx(2 / 3)


def test_empty_prediction():
    assert f1("", ["cat"]) == 0.0
    assert exact_match("", ["cat"]) == 0.0
    # as in the official v1.1 script: empty vs empty is an exact match but F1 0 (no overlap)
    assert exact_match("", [""]) == 1.0
    assert f1("", [""]) == 0.0
    # a prediction that normalises to nothing matches a reference that does too
    assert exact_match("The.", ["a"]) == 1.0


def test_several_golds_take_the_max():
    # "red": P = 1/2, R = 1 -> 2/3; "red dog barks": P = 1, R = 2/3 -> 4/5; "blue cat": 0
    assert f1("red dog", ["blue cat", "red", "red dog barks"]) == pytest.approx(0.8)
    assert f1("red dog", ["blue cat", "red"]) == pytest.approx(2 / 3)


def test_single_string_gold_is_one_reference():
    """A bare string must not be iterated as characters (which would score "cat" 0)."""
    assert f1("cat", "cat") == 1.0
    assert exact_match("cat", "The cat") == 1.0


def test_no_golds_is_an_error():
    with pytest.raises(ValueError, match="reference"):
        f1("cat", [])
    with pytest.raises(ValueError, match="reference"):
        exact_match("cat", [])


def test_squad_scores_are_means_in_unit_interval():
    scores = squad_scores(["the cat", "big red dog", "nothing"], [["Cat"], ["red dog"], ["x"]])
    assert scores["exact_match"] == pytest.approx(1 / 3)
    assert scores["f1"] == pytest.approx((1.0 + 0.8 + 0.0) / 3)
    with pytest.raises(ValueError, match="2 predictions for 1"):
        squad_scores(["a", "b"], [["a"]])
    with pytest.raises(ValueError, match="no predictions"):
        squad_scores([], [])
