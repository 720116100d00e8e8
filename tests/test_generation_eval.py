"""Evaluation by generation: CER, WER and exact match on known strings (jiwer's edit distances), raw
and normalized, per sample and over a set."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from trainpod.train.generation_eval import (
    Prompt,
    corpus_scores,
    generate_and_score,
    sample_scores,
    stop_token_ids,
)

from sft_support import make_tiny_tokenizer


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


def _model_that_follows(tokenizer, successor: dict[int, int]) -> LlamaForCausalLM:
    """A one-layer Llama whose greedy next token after token a is successor[a]: each of those tokens
    embeds as a basis vector of its own, attention and MLP add nothing, and the head maps a to its successor."""
    width = 16
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=width,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.lm_head.weight.zero_()
        model.model.layers[0].self_attn.o_proj.weight.zero_()
        model.model.layers[0].mlp.down_proj.weight.zero_()
        for basis, (token, following) in enumerate(successor.items()):
            model.model.embed_tokens.weight[token, basis] = 1.0
            model.lm_head.weight[following, basis] = 10.0
    return model


def test_a_chat_answer_ends_at_its_end_of_turn_token_when_that_is_not_eos(tmp_path):
    # The test tokenizer's eos is <|endoftext|>, as a base model's is, while chatml answers end with
    # <|im_end|>: generation ran on past it to max_new_tokens, and the text after it was scored.
    tokenizer = AutoTokenizer.from_pretrained(str(make_tiny_tokenizer(tmp_path / "tok")))
    newline, a, b = (tokenizer(t, add_special_tokens=False)["input_ids"][-1] for t in ("\n", "a", "b"))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model = _model_that_follows(tokenizer, {newline: a, a: im_end, im_end: b, b: b})
    ids = torch.tensor([[newline]])
    answer = [a, im_end]  # the stored answer: "a<|im_end|>"
    prompt = Prompt({"input_ids": ids, "attention_mask": torch.ones_like(ids)}, "", "a", 0, answer_ids=answer)

    stop = stop_token_ids(model, tokenizer, [prompt])
    metrics = generate_and_score(
        model, [prompt], tokenizer, 6, torch.device("cpu"), tmp_path / "eval", 1, 1, torch.no_grad, stop
    )

    assert stop == [tokenizer.eos_token_id, im_end]
    prediction = json.loads((tmp_path / "eval/step-1.predictions.jsonl").read_text())["prediction"]
    assert prediction == "a", (
        f"generation must stop at <|im_end|>, the answers' end of turn; got {prediction!r}"
    )
    assert metrics["eval_exact_match"] == 1.0
