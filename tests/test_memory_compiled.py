"""The compiled terms of the peak-memory estimate (train/memory.py, train.compile true) against what
torch.compile really does with a tiny Llama and its chunked loss on CPU, in bf16 autocast with the mask-free
SDPA the presets run: the bytes its graph saves for the backward, the peak of live bytes in the loss's
forward (where inductor holds every chunk's term of the head's gradient), and the second copy of the
gradients at the end of a backward that accumulates. So the formula follows torch when its partitioner or
inductor's schedule changes.

CPU stands for the GPU here because what decides these bytes does not depend on the device: the partitioner
(what is saved), inductor's lowering (the loss's fused sum) and autograd (when gradients are added). The
one device-specific op, attention, saves the same on both: CPU SDPA's flash kernel keeps q, k, v, the output
and a log-sum-exp per head and row, as CUDA's flash and cuDNN attention do.

The partitioner inductor uses runs with backend="aot_eager_decomp_partition" too, without inductor's code
generation (seconds); only the loss's schedule needs inductor itself (about 30 s on 2 cores, once).
"""

from __future__ import annotations

import pytest
import torch
from torch._C._profiler import _EventType

import trainpod.train.loss
from trainpod.config.loader import validate_tree
from trainpod.config.pretrain import PretrainConfig
from trainpod.train import memory
from trainpod.train.loss import CausalLMLoss, linear_cross_entropy
from trainpod.train.model import build_model, causal_fast_path, llama_config

VOCAB = 512
# 16 rows a chunk, 16 chunks of a 64-wide model: as in the presets (512 rows, 768-3072 wide, 16-128
# chunks), a chunk's vocab x width term of the head's gradient outweighs its rows x vocab logits, and the
# tokens far outnumber the width, so the graph saves the head's summed gradient, not every chunk's inputs.
CHUNK_ROWS = 16
PARTITION_ONLY = "aot_eager_decomp_partition"  # inductor's decompositions and partitioner, eager kernels


@pytest.fixture
def small_chunks(monkeypatch):
    for module in (trainpod.train.loss, memory):
        monkeypatch.setattr(module, "rows_per_chunk", lambda vocab, rows=None: CHUNK_ROWS)


def compiled_config(micro_batch_size: int = 4, seq_len: int = 64) -> PretrainConfig:
    model = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 176}
    train = {"max_steps": 1, "warmup_steps": 0, "seq_len": seq_len, "micro_batch_size": micro_batch_size}
    train |= {"grad_accum_steps": 2, "compile": True}
    return validate_tree(
        PretrainConfig, {"name": "c", "data": {"dataset": "d"}, "model": model, "train": train}
    )


def compiled_model(config: PretrainConfig, backend: str):
    t = config.train
    model = build_model(llama_config(config.model, VOCAB, t.seq_len, causal_fast_path("sdpa")), seed=0)
    compiled = torch.compile(CausalLMLoss(model), backend=backend)

    def micro_batch() -> torch.Tensor:
        ids = torch.randint(0, VOCAB, (t.micro_batch_size, t.seq_len + 1))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return compiled(ids[:, :-1], ids[:, 1:])

    return model, micro_batch


def memory_profile():
    return torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)


def live_bytes_peak(profile) -> int:
    """The most bytes allocated at once during `profile`, counted from its start."""
    allocations = []
    nodes = list(profile.profiler.kineto_results.experimental_event_tree())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children)
        if node.typed[0] == _EventType.Allocation:
            allocations.append((node.start_time_ns, node.typed[1].alloc_size))
    live = peak = 0
    for _, size in sorted(allocations):
        live += size
        peak = max(peak, live)
    return peak


def test_the_compiled_graph_saves_what_the_estimate_counts_per_layer_and_token(small_chunks):
    config = compiled_config()
    model, micro_batch = compiled_model(config, PARTITION_ONLY)
    micro_batch()  # compiles; the measured call runs what it built
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        micro_batch()

    shape = memory.model_shape(config, VOCAB)
    tokens = config.train.micro_batch_size * config.train.seq_len
    moment = memory.compiled_moments(shape, config.train, tokens, True, "ddp", 1)["end of the forward"]
    # What the loss holds beyond what it saves (its chunks' terms and one chunk's softmax) is the next test's.
    saved_by_loss = 4 * shape.vocab * shape.hidden
    estimated = moment["bf16 weight copies (autocast)"] + moment["activations (compiled, checkpointing off)"]
    estimated += saved_by_loss
    assert sum(saved.values()) == pytest.approx(estimated, rel=0.05), (
        f"the compiled graph saves {sum(saved.values()):,} bytes for the backward, the estimate counts "
        f"{estimated:,}: update memory.compiled_layer_activation_bytes (and the module docstring) to what "
        "torch.compile's partitioner saves now (TORCH_LOGS=aot_graphs lists the forward graph's outputs)"
    )


def test_the_compiled_chunked_loss_holds_what_the_estimate_counts_at_the_end_of_the_forward(small_chunks):
    tokens, hidden_size = 256, 64
    hidden = torch.randn(tokens, hidden_size, requires_grad=True)
    head = torch.randn(VOCAB, hidden_size, requires_grad=True)
    targets = torch.randint(0, VOCAB, (tokens,))
    loss = torch.compile(linear_cross_entropy)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss(hidden, head, targets)  # compiles
        with memory_profile() as forward:
            loss(hidden, head, targets)

    shape = memory.ModelShape(
        tensor_sizes=(VOCAB * hidden_size,), hidden=hidden_size, kv_hidden=hidden_size, mlp=hidden_size,
        layers=1, vocab=VOCAB, embedding_params=VOCAB * hidden_size,
    )  # fmt: skip
    # The hidden states' gradient in bf16 chunks is counted with the activations (compiled_moments).
    estimated = memory.compiled_loss_bytes(shape, tokens, bf16=True) + 2 * tokens * hidden_size
    held = live_bytes_peak(forward)
    assert held <= estimated, f"an estimate under the real peak lets an OOM through: {held:,} > {estimated:,}"
    assert held == pytest.approx(estimated, rel=0.10), (
        f"the compiled loss held at most {held:,} bytes in its forward, the estimate counts {estimated:,}: "
        "see what inductor's schedule keeps alive now (TORCH_LOGS=output_code) and update "
        "memory.compiled_loss_bytes"
    )


def test_a_compiled_backward_that_accumulates_holds_two_sets_of_gradients_at_its_end(small_chunks):
    config = compiled_config(micro_batch_size=1, seq_len=8)  # few tokens: the gradients dwarf the rest
    model, micro_batch = compiled_model(config, PARTITION_ONLY)
    micro_batch().backward()  # compiles both graphs
    model.zero_grad(set_to_none=True)
    gradients = 4 * sum(p.numel() for p in model.parameters())
    with memory_profile() as step:
        for _ in range(config.train.grad_accum_steps):
            micro_batch().backward()

    shape = memory.model_shape(config, VOCAB)
    tokens = config.train.micro_batch_size * config.train.seq_len
    moments = memory.compiled_moments(shape, config.train, tokens, True, "ddp", 1)
    assert moments["end of the backward"]["gradients of a micro-batch (compiled)"] == gradients
    # Eager autograd adds each gradient in as it is made: about one set. The single compiled backward
    # returns them all at once, beside the first micro-batch's.
    assert live_bytes_peak(step) >= 2 * gradients, (
        "a compiled backward no longer holds a second set of gradients: drop the 'end of the backward' "
        "moment from memory.compiled_moments"
    )
