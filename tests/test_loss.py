"""The chunked linear cross-entropy (train/loss.py) equals the plain loss and its gradients.

CPU, fp32: equal within fp32 rounding; under bf16 autocast within bf16 rounding. The model and the
loss trace into one graph under torch.compile (dynamo with fullgraph=True; the aot_eager backend
runs the same autograd graph as inductor would, without compiling C++ here).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trainpod.train.loss import (
    IGNORE_INDEX,
    CausalLMLoss,
    fits_chunked_loss,
    linear_cross_entropy,
    rows_per_chunk,
)

torch.set_num_threads(1)


def inputs(rows: int = 300, width: int = 32, vocab: int = 1000, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, width, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, width, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=generator)
    targets[::7] = IGNORE_INDEX
    return hidden, weight, targets


def loss_and_grads(loss_fn, hidden, weight):
    hidden.grad = weight.grad = None
    loss = loss_fn()
    loss.backward()
    return loss.detach(), hidden.grad.clone(), weight.grad.clone()


def assert_close(ours, plain, rtol, atol):
    for mine, theirs, name in zip(ours, plain, ("loss", "grad of hidden", "grad of weight"), strict=True):
        torch.testing.assert_close(
            mine, theirs, rtol=rtol, atol=atol, msg=f"{name} differs from the plain loss"
        )


@pytest.mark.parametrize("chunk_rows", [1, 64, 299, 300, 4096])
def test_chunked_loss_and_gradients_equal_the_plain_loss_in_fp32(chunk_rows):
    hidden, weight, targets = inputs()
    plain = loss_and_grads(lambda: F.cross_entropy(hidden @ weight.T, targets), hidden, weight)
    ours = loss_and_grads(
        lambda: linear_cross_entropy(hidden, weight, targets, chunk_rows=chunk_rows), hidden, weight
    )
    assert_close(ours, plain, rtol=1e-5, atol=1e-7)


def test_chunked_loss_under_bf16_autocast_matches_the_upcast_plain_loss():
    hidden, weight, targets = inputs()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = loss_and_grads(lambda: F.cross_entropy((hidden @ weight.T).float(), targets), hidden, weight)
        ours = loss_and_grads(
            lambda: linear_cross_entropy(hidden, weight, targets, chunk_rows=64), hidden, weight
        )
    assert ours[0].dtype == torch.float32
    assert_close(ours, plain, rtol=1e-2, atol=1e-3)  # bf16 matmuls; ours accumulates the head's grad in fp32


def test_a_given_divisor_sums_the_loss_like_num_items_in_batch():
    hidden, weight, targets = inputs()
    plain = loss_and_grads(
        lambda: F.cross_entropy(hidden @ weight.T, targets, reduction="sum") / 1234.0, hidden, weight
    )
    ours = loss_and_grads(
        lambda: linear_cross_entropy(hidden, weight, targets, divisor=1234.0), hidden, weight
    )
    assert_close(ours, plain, rtol=1e-5, atol=1e-8)


def test_loss_without_gradients_equals_the_training_loss():
    hidden, weight, targets = inputs()
    trained = linear_cross_entropy(hidden, weight, targets, chunk_rows=64)
    with torch.no_grad():
        evaluated = linear_cross_entropy(hidden, weight, targets, chunk_rows=64)
    torch.testing.assert_close(evaluated, trained.detach(), rtol=1e-6, atol=0)


def test_chunks_hold_64_mib_of_fp32_logits_and_at_least_one_row():
    assert rows_per_chunk(32768) == 512
    assert rows_per_chunk(10**9) == 1


def test_a_large_micro_batch_is_cut_into_at_most_16_chunks_of_at_most_512_mib():
    # torch.compile unrolls the chunk loop: the 125m preset's 64 x 1024 tokens were 128 chunks of 512 rows
    # and its first step compiled for 181 s on an H100's host, at every start of the run.
    assert rows_per_chunk(32768, 64 * 1024) == 4096  # 16 chunks of 512 MiB
    assert rows_per_chunk(32768, 16 * 1024) == 1024  # the 1b preset's micro-batch: 16 chunks, not 32
    assert rows_per_chunk(32768, 1000) == 512  # never under 64 MiB a chunk
    assert rows_per_chunk(152064, 8 * 4096) == 882  # Qwen's vocabulary: 512 MiB caps it at 38 chunks
    assert rows_per_chunk(10**9, 10**6) == 1


def tiny_llama(tie: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=tie,
        use_cache=False,
    )
    return LlamaForCausalLM(config)


@pytest.mark.parametrize("tie", [True, False])
def test_model_with_chunked_loss_equals_transformers_own_loss_and_gradients(tie):
    model = tiny_llama(tie)
    ids = torch.randint(0, 300, (3, 20), generator=torch.Generator().manual_seed(1))
    theirs = model(input_ids=ids, labels=ids).loss  # transformers shifts the labels itself
    theirs.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    ours = CausalLMLoss(model)(ids[:, :-1], ids[:, 1:])
    ours.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-7, msg=f"grad of {name}")


def test_model_and_loss_compile_into_one_graph_with_the_eager_loss_and_gradients():
    model = tiny_llama(tie=False)
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(2))
    eager = CausalLMLoss(model)(ids[:, :-1], ids[:, 1:])
    eager.backward()
    expected = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    torch._dynamo.reset()
    compiled = torch.compile(CausalLMLoss(model), backend="aot_eager", fullgraph=True)  # a graph break fails
    loss = compiled(ids[:, :-1], ids[:, 1:])
    loss.backward()
    torch.testing.assert_close(loss, eager, rtol=1e-5, atol=1e-7)
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], rtol=1e-4, atol=1e-7, msg=f"grad of {name}")


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_chunked_loss_of_a_lora_model_equals_its_own_sft_loss_and_gradients(layout):
    from peft import LoraConfig, get_peft_model

    from trainpod.train.loss import shift_labels

    model = get_peft_model(
        tiny_llama(tie=False), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False)
    )
    assert fits_chunked_loss(model)
    ids = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(3))
    labels = ids.clone()
    labels[:, :6] = IGNORE_INDEX  # the prompt
    if layout == "padded":
        inputs = {"attention_mask": torch.ones_like(ids)}
        inputs["attention_mask"][1, 15:] = 0
        labels[1, 15:] = IGNORE_INDEX
    else:
        inputs = {"position_ids": torch.tensor([list(range(12)) + list(range(8))] * 2)}
        labels[:, 12] = IGNORE_INDEX  # a sample's first label, as stored
    items = torch.tensor(float((labels[:, 1:] != IGNORE_INDEX).sum() + 5))  # other micro-batches count too
    theirs = model(input_ids=ids, labels=labels, num_items_in_batch=items, **inputs).loss
    theirs.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    ours = CausalLMLoss(model)(ids, shift_labels(labels), items, **inputs)
    ours.backward()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-7)
    for name, grad in expected.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-7, msg=name)


def test_models_with_a_quantized_or_scaled_head_keep_their_own_loss():
    model = tiny_llama(tie=False)
    model.config.model_type = "gemma2"  # soft-capped logits: lm_head(hidden) is not its logits
    assert not fits_chunked_loss(model)
