"""Evaluation by generation: CER, WER and exact match on known strings (jiwer's edit distances), raw
and normalized, per sample and over a set."""

from __future__ import annotations

import pytest

from trainpod.train.generation_eval import corpus_scores, sample_scores


def test_one_deleted_character_of_five_is_a_cer_of_one_fifth():
    scores = sample_scores("HELLO", "HELO")
    assert scores["cer"] == pytest.approx(0.2)
    assert scores["wer"] == 1.0
    assert scores["exact_match"] == 0.0


def test_one_substituted_word_of_three_is_a_wer_of_one_third():
    assert sample_scores("a b c", "a x c")["wer"] == pytest.approx(1 / 3)


def test_normalized_scores_ignore_case_and_whitespace_runs_but_raw_ones_do_not():
    scores = sample_scores("Depth  2150 M ", "depth 2150 m")
    assert scores["exact_match"] == 0.0 and scores["cer"] > 0
    assert scores["exact_match_normalized"] == 1.0
    assert scores["cer_normalized"] == 0.0 and scores["wer_normalized"] == 0.0


def test_an_empty_reference_scores_zero_for_an_empty_prediction_and_one_otherwise():
    assert sample_scores("", "")["cer"] == 0.0
    assert sample_scores("", "x")["cer"] == 1.0


def test_set_cer_weighs_samples_by_their_length():
    """1 edit in 10 characters and 1 in 2: 2 edits over 12 characters, not the mean of 0.1 and 0.5."""
    scores = corpus_scores(["ABCDEFGHIJ", "XY"], ["ABCDEFGHIX", "X"])
    assert scores["cer"] == pytest.approx(2 / 12)
    assert scores["exact_match"] == 0.0


def test_set_exact_match_is_the_share_of_samples_answered_exactly():
    assert corpus_scores(["a", "b", "c", "d"], ["a", "b", "x", "D"])["exact_match"] == 0.5
    assert corpus_scores(["a", "b", "c", "d"], ["a", "b", "x", "D"])["exact_match_normalized"] == 0.75
