"""GPU tier for the training fast paths (`pytest -m gpu` where a CUDA GPU is lent).

The chunked loss under bf16 and torch.compile, pinned non-blocking batches, flex attention on
packed rows (forward and backward, which CPU flex attention cannot run), and the memory estimate
against torch.cuda.max_memory_allocated. CPU twins: test_loss.py, test_attention.py, test_memory.py.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from trainpod.config.loader import validate_tree
from trainpod.config.pretrain import PretrainConfig
from trainpod.train.batches import TokenBatches, to_device
from trainpod.train.loss import CausalLMLoss, linear_cross_entropy
from trainpod.train.memory import estimate_training_memory
from trainpod.train.model import build_model, causal_fast_path, llama_config
from trainpod.train.optim import build_optimizer, decay_groups

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="needs a CUDA GPU (pytest -m gpu on a GPU machine)"
    ),
]
CUDA = torch.device("cuda")


def optimizer_for(model, t, device):
    """The optimizer pretraining builds for this train config."""
    groups = decay_groups(model, t.weight_decay)
    return build_optimizer(t.optimizer, groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, device=device)


def peak_bytes(work) -> tuple[object, int]:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    result = work()
    torch.cuda.synchronize()
    return result, torch.cuda.max_memory_allocated() - before


def test_chunked_loss_on_gpu_matches_the_plain_loss_with_under_half_its_memory():
    generator = torch.Generator(device=CUDA).manual_seed(0)
    hidden = torch.randn(8192, 768, device=CUDA, generator=generator, requires_grad=True)
    weight = (0.02 * torch.randn(32768, 768, device=CUDA, generator=generator)).requires_grad_()
    targets = torch.randint(0, 32768, (8192,), device=CUDA, generator=generator)

    def step(loss_fn):
        hidden.grad = weight.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        return loss.detach()

    plain, plain_peak = peak_bytes(
        lambda: step(lambda: F.cross_entropy((hidden @ weight.T).float(), targets))
    )
    plain_grad = weight.grad.clone()
    ours, our_peak = peak_bytes(lambda: step(lambda: linear_cross_entropy(hidden, weight, targets)))
    torch.testing.assert_close(ours, plain, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(weight.grad, plain_grad, rtol=2e-2, atol=1e-4)
    assert our_peak <= 0.5 * plain_peak, (
        f"chunked peak {our_peak / 2**20:.0f} MiB, plain {plain_peak / 2**20:.0f} MiB"
    )


def test_compiled_model_with_chunked_loss_trains_in_bf16():
    config = LlamaConfig(
        vocab_size=32768, hidden_size=256, intermediate_size=688, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, use_cache=False,
    )  # fmt: skip
    config._attn_implementation = causal_fast_path("sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(CUDA)
    ids = torch.randint(0, 32768, (4, 257), device=CUDA)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        eager = CausalLMLoss(model)(ids[:, :-1], ids[:, 1:])
        compiled = torch.compile(CausalLMLoss(model))(ids[:, :-1], ids[:, 1:])
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_token_batches_on_cuda_are_pinned_and_copied_without_blocking(tmp_path):
    tokens = np.arange(10_000, dtype=np.uint16)
    batches = TokenBatches([tmp_path / "shard"], lambda _: tokens, 4, 64, pin_memory=True)
    inputs, targets = batches.next_batch()
    assert inputs.is_pinned() and targets.is_pinned()
    on_gpu = to_device(inputs, CUDA)
    assert on_gpu.device.type == "cuda"
    assert torch.equal(on_gpu.cpu(), torch.arange(256).view(4, 64))


def test_flex_attention_on_packed_rows_trains_like_the_dense_masked_reference():
    def model(attn: str) -> LlamaForCausalLM:
        config = LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, use_cache=False,
        )  # fmt: skip
        config._attn_implementation = attn
        torch.manual_seed(0)
        return LlamaForCausalLM(config).to(CUDA)

    ids = torch.randint(0, 256, (2, 128), device=CUDA)
    positions = torch.tensor(
        [list(range(40)) + list(range(88)), list(range(100)) + list(range(28))], device=CUDA
    )
    losses, grads = {}, {}
    for attn in ("sdpa", "flex_attention"):
        m = model(attn)
        loss = m(input_ids=ids, position_ids=positions, labels=ids).loss
        loss.backward()
        losses[attn], grads[attn] = loss.detach(), m.model.layers[0].self_attn.q_proj.weight.grad
    torch.testing.assert_close(losses["flex_attention"], losses["sdpa"], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grads["flex_attention"], grads["sdpa"], rtol=1e-3, atol=1e-5)


def test_memory_estimate_is_within_a_quarter_of_the_measured_peak():
    config = validate_tree(
        PretrainConfig,
        {
            "name": "m",
            "data": {"dataset": "d"},
            "model": {"hidden_size": 1024, "num_layers": 4, "num_heads": 8, "intermediate_size": 2816},
            "train": {"max_steps": 2, "warmup_steps": 0, "seq_len": 1024, "micro_batch_size": 8},
        },
    )
    vocab = 32768
    estimate = estimate_training_memory(config, vocab, bf16=True)
    llama = llama_config(config.model, vocab, config.train.seq_len, causal_fast_path("sdpa"))
    torch.cuda.reset_peak_memory_stats()
    model = build_model(llama, seed=0, device=CUDA)
    optimizer = optimizer_for(model, config.train, CUDA)
    wrapped = CausalLMLoss(model)
    for _ in range(2):  # the second step holds gradients and optimizer states from the first
        for _ in range(2):
            ids = torch.randint(0, vocab, (8, 1025), device=CUDA)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                wrapped(ids[:, :-1], ids[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    measured = torch.cuda.max_memory_allocated()
    assert estimate.allocated == pytest.approx(measured, rel=0.25), (
        f"estimated {estimate.allocated / 2**30:.2f} GiB, measured {measured / 2**30:.2f} GiB\n{estimate.report()}"
    )
