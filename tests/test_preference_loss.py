"""The DPO loss (train/preference.py): its formula against hand-computed values, the chunked log-probabilities
against a plain log-softmax (values and gradients), and the loss module on a real peft LoRA model: the
reference is the base with the adapters off, and training moves the chosen answer above the rejected one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trainpod.train.preference import (
    PreferenceLoss,
    dpo_losses,
    logits_token_logps,
    orpo_losses,
    simpo_losses,
    token_logps,
)
from trainpod.workloads.preference import least_preferred

IGNORE = -100


def test_the_sigmoid_loss_is_log_2_at_no_margin_and_falls_as_the_chosen_answer_gains():
    zero = torch.zeros(3)
    losses, chosen, rejected = dpo_losses(zero, zero, zero, zero, beta=0.1)
    assert torch.allclose(losses, torch.full((3,), math.log(2)))
    assert chosen.abs().sum() == 0 and rejected.abs().sum() == 0
    # policy: chosen +2 nats over the reference, rejected -1: margin 3, loss -log sigmoid(0.3)
    losses, chosen, rejected = dpo_losses(
        torch.tensor([-8.0]), torch.tensor([-11.0]), torch.tensor([-10.0]), torch.tensor([-10.0]), beta=0.1
    )
    assert losses.item() == pytest.approx(-math.log(1 / (1 + math.exp(-0.3))), rel=1e-6)
    assert chosen.item() == pytest.approx(0.2) and rejected.item() == pytest.approx(-0.1)


def test_label_smoothing_and_ipo_follow_their_formulas():
    margin = torch.tensor([3.0])
    args = (margin, torch.zeros(1), torch.zeros(1), torch.zeros(1))
    smoothed, _, _ = dpo_losses(*args, beta=0.1, label_smoothing=0.2)
    expected = -0.8 * math.log(1 / (1 + math.exp(-0.3))) - 0.2 * math.log(1 / (1 + math.exp(0.3)))
    assert smoothed.item() == pytest.approx(expected, rel=1e-6)
    ipo, _, _ = dpo_losses(*args, beta=0.1, loss="ipo")
    assert ipo.item() == pytest.approx((3.0 - 1 / 0.2) ** 2)


def test_chunked_log_probabilities_match_a_plain_log_softmax_in_value_and_gradient():
    torch.manual_seed(0)
    hidden = torch.randn(3, 7, 16, requires_grad=True)
    weight = torch.randn(50, 16, requires_grad=True)
    targets = torch.randint(0, 50, (3, 7))
    targets[0, :3] = IGNORE
    targets[2, -2:] = IGNORE
    chunked = token_logps(hidden, weight, targets, chunk_rows=4)  # 21 rows: 6 checkpointed chunks
    valid = targets != IGNORE
    plain = (
        torch.log_softmax(hidden @ weight.T, -1).gather(2, targets.where(valid, 0)[..., None]).squeeze(2)
        * valid
    )
    assert torch.allclose(chunked, plain, atol=1e-5)
    upstream = torch.randn(3, 7)  # a per-token weighting no fused loss could fold in: the DPO sigmoid's
    (chunked_grads) = torch.autograd.grad((chunked * upstream).sum(), (hidden, weight))
    plain_grads = torch.autograd.grad((plain * upstream).sum(), (hidden, weight))
    for ours, reference in zip(chunked_grads, plain_grads, strict=True):
        assert torch.allclose(ours, reference, atol=1e-5)


def _tiny_lora_model():
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    base = LlamaForCausalLM(config)
    return get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear"))


def _pairs() -> dict[str, torch.Tensor]:
    """Two pairs, chosen rows then rejected: a shared prompt, answers differing, right-padded."""
    ids = torch.tensor(
        [
            [5, 6, 7, 10, 11, 12],
            [5, 8, 9, 20, 21, 0],
            [5, 6, 7, 30, 31, 32],
            [5, 8, 9, 40, 41, 0],
        ]
    )
    mask = (torch.arange(6) < torch.tensor([6, 5, 6, 5])[:, None]).long()
    labels = ids.where(mask.bool(), IGNORE)
    labels[:, :3] = IGNORE  # the prompt trains nothing
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def test_a_fresh_adapter_is_its_own_reference_and_training_makes_the_chosen_answers_likelier():
    model = _tiny_lora_model()
    loss_module = PreferenceLoss(model, beta=0.5)
    batch = _pairs()
    losses, chosen, rejected = loss_module(**batch)
    # LoRA's B starts at zero: the policy is the reference, every pair's loss is log 2 and its rewards 0.
    assert torch.allclose(losses, torch.full((2,), math.log(2)), atol=1e-6)
    assert chosen.abs().max() < 1e-6 and rejected.abs().max() < 1e-6

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(20):
        losses, _, _ = loss_module(**batch)
        losses.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    losses, chosen, rejected = loss_module(**batch)
    assert (chosen > rejected).all() and losses.max() < math.log(2) / 2

    # The reference did not move: the base's log-probabilities with the adapters off are what they were.
    with torch.no_grad(), model.disable_adapter():
        after = loss_module.sequence_logps(**batch)
    fresh = PreferenceLoss(_tiny_lora_model(), beta=0.5)
    with torch.no_grad():
        before = fresh.sequence_logps(**batch)
    assert torch.allclose(after, before, atol=1e-6)


def _dropout_model(kind: str):
    """A tiny model whose config has dropout (Llama: the attention's float rate; GPT-2: nn.Dropout modules, and
    no chunked loss), with LoRA adapters that have their own."""
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    if kind == "llama":
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, attention_dropout=0.3)  # fmt: skip
        base, targets = LlamaForCausalLM(config), "all-linear"
    else:
        config = GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.3,
                            embd_pdrop=0.3, attn_pdrop=0.3)  # fmt: skip
        base, targets = GPT2LMHeadModel(config), ["c_attn", "c_fc"]
    lora = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.2, target_modules=targets, fan_in_fan_out=kind == "gpt2"
    )
    return get_peft_model(base, lora)


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_a_fresh_adapter_is_its_own_reference_in_train_mode_though_the_base_has_dropout(kind):
    """The reference is the base run in train mode beside the policy: with the base's dropout on, each forward
    drew other masks, and a fresh adapter's pairs (policy = reference) had a noisy margin, not 0. The adapters'
    own dropout stays, for the policy alone."""
    model = _dropout_model(kind)
    loss_module = PreferenceLoss(model, beta=0.5, chunked=kind == "llama")
    model.train()
    for _ in range(3):
        losses, chosen, rejected = loss_module(**_pairs())
        assert torch.allclose(losses, torch.full((2,), math.log(2)), atol=1e-6), losses
        assert chosen.abs().max() < 1e-6 and rejected.abs().max() < 1e-6
    assert loss_module.dropout_turned_off > 0
    assert {m.p for n, m in model.named_modules() if n.endswith("lora_dropout.default")} == {0.2}


def test_the_models_own_logits_give_the_chunked_loss_and_ipo_averages_per_token():
    model = _tiny_lora_model()
    torch.manual_seed(1)
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # a trained adapter: policy and reference differ
    batch = _pairs()
    with torch.no_grad():
        chunked = PreferenceLoss(model, beta=0.3, chunked=True)(**batch)
        whole = PreferenceLoss(model, beta=0.3, chunked=False)(**batch)
        for ours, theirs in zip(chunked, whole, strict=True):
            assert torch.allclose(ours, theirs, atol=1e-5)
        summed = PreferenceLoss(model, beta=0.3).sequence_logps(**batch)
        averaged = PreferenceLoss(model, beta=0.3, loss="ipo").sequence_logps(**batch)
    trained = (batch["labels"][:, 1:] != IGNORE).sum(1)
    assert torch.allclose(averaged, summed / trained, atol=1e-6)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    by_hand = F.log_softmax(logits[:, :-1].float(), -1)
    targets = batch["labels"][:, 1:]
    expected = (
        by_hand.gather(2, targets.where(targets != IGNORE, 0)[..., None]).squeeze(2) * (targets != IGNORE)
    ).sum(1)
    assert torch.allclose(logits_token_logps(logits, batch["labels"]).sum(1), expected, atol=1e-5)


def test_orpo_is_the_chosen_answers_sft_loss_plus_beta_times_the_odds_ratio_term():
    chosen, rejected = torch.tensor([-0.5]), torch.tensor([-2.0])  # per-token means: p = e^-0.5 and e^-2
    losses, chosen_reward, rejected_reward = orpo_losses(chosen, rejected, beta=0.1)
    p_c, p_r = math.exp(-0.5), math.exp(-2.0)
    log_odds = math.log(p_c / (1 - p_c)) - math.log(p_r / (1 - p_r))
    assert losses.item() == pytest.approx(0.5 - 0.1 * math.log(1 / (1 + math.exp(-log_odds))), rel=1e-6)
    assert chosen_reward.item() == pytest.approx(-0.05) and rejected_reward.item() == pytest.approx(-0.2)
    # A chosen answer the model is certain of (mean log-probability 0): finite, where log(1 - p) is -inf
    certain, _, _ = orpo_losses(torch.tensor([0.0]), torch.tensor([-1.0]), beta=0.1)
    assert torch.isfinite(certain).all()


def test_simpo_is_the_margin_of_scaled_mean_log_probabilities_less_gamma():
    losses, chosen_reward, rejected_reward = simpo_losses(
        torch.tensor([-1.0]), torch.tensor([-1.5]), 2.0, 1.0
    )
    assert losses.item() == pytest.approx(-math.log(1 / (1 + math.exp(-(2.0 * 0.5 - 1.0)))), rel=1e-6)
    assert chosen_reward.item() == pytest.approx(-2.0) and rejected_reward.item() == pytest.approx(-3.0)


def test_the_worst_pairs_of_an_orpo_eval_are_those_it_prefers_least_not_those_of_the_unlikeliest_chosen_answer():
    """ORPO's loss holds the chosen answer's SFT loss: the pair whose chosen answer is unlikely (mean log-probability
    -3) but preferred to its rejected one (-4) has the highest loss, and was written first to worst.jsonl, above
    the pair whose rejected answer the model prefers (-0.5 against -0.4)."""
    chosen, rejected = torch.tensor([-3.0, -0.5, -1.0]), torch.tensor([-4.0, -0.4, -1.5])
    losses, chosen_rewards, rejected_rewards = orpo_losses(chosen, rejected, beta=0.1)
    per_pair = list(
        zip(losses.tolist(), range(3), chosen_rewards.tolist(), rejected_rewards.tolist(), strict=True)
    )
    assert max(range(3), key=lambda i: losses[i]) == 0, "the preferred pair has the highest loss"
    assert [index for _, index, _, _ in least_preferred(per_pair, 2)] == [1, 2]


@pytest.mark.parametrize("objective", ["orpo", "simpo"])
def test_reference_free_objectives_train_a_model_without_adapters(objective):
    """ORPO and SimPO need no reference, so a full finetune's plain model (no disable_adapter) trains by them."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )
    )  # fmt: skip
    loss_module = PreferenceLoss(
        model, beta=0.5 if objective == "orpo" else 2.0, objective=objective, gamma=0.5
    )
    batch = _pairs()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _, chosen, rejected = loss_module(**batch)
    start_margin = (chosen - rejected).mean()
    for _ in range(15):
        losses, _, _ = loss_module(**batch)
        losses.mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    _, chosen, rejected = loss_module(**batch)
    assert (chosen - rejected).mean() > start_margin and (chosen > rejected).all()
