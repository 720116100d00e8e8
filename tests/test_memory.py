"""The peak-memory estimate (train/memory.py) against what a tiny model really holds on CPU, the
shipped presets against one 80 GB GPU, and the preflight refusal.

On CPU the parameter, gradient and optimizer bytes are counted exactly (every tensor's storage, once);
the activations are what autograd saves for the backward (saved_tensors_hooks), within 10%.
No GPU here: the refusal test stands in a GPU size for torch's (the one thing mocked), and
tests/test_gpu_memory.py checks the estimate against torch.cuda.max_memory_allocated on a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from trainpod.config import load_config
from trainpod.config.loader import validate_tree
from trainpod.config.pretrain import PretrainConfig
from trainpod.errors import ExitCode, InputError
from trainpod.train import memory
from trainpod.train.model import build_model, llama_config
from trainpod.train.optim import build_optimizer, decay_groups

torch.set_num_threads(1)


def optimizer_for(model, t, device):
    """The optimizer pretraining builds for this train config."""
    groups = decay_groups(model, t.weight_decay)
    return build_optimizer(t.optimizer, groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, device=device)


PRESETS = Path(__file__).resolve().parents[1] / "configs" / "pretrain"
GPU_80GB = 79 * 2**30  # what torch reports for an 80 GB H100/A100


def tiny_config(**train) -> PretrainConfig:
    model = {"hidden_size": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 160}
    return validate_tree(
        PretrainConfig,
        {
            "name": "t",
            "data": {"dataset": "d"},
            "model": model,
            "train": {"max_steps": 1, "warmup_steps": 0, "seq_len": 32} | train,
        },
    )


def storage_bytes(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_weights_gradients_and_optimizer_states_are_estimated_to_the_byte(optimizer):
    config = tiny_config(optimizer=optimizer, micro_batch_size=2)
    vocab = 320
    model = build_model(llama_config(config.model, vocab, config.train.seq_len), seed=0)
    opt = optimizer_for(model, config.train, torch.device("cpu"))
    ids = torch.randint(0, vocab, (2, 32))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    params = list(model.parameters())
    states = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    estimate = memory.estimate_training_memory(config, vocab, bf16=False).parts
    assert estimate["weights (fp32)"] == storage_bytes(params)
    assert estimate["gradients (fp32)"] == storage_bytes(p.grad for p in params)
    assert estimate[f"optimizer states ({optimizer})"] == storage_bytes(states), (
        "the optimizer's state layout changed; update memory.optimizer_bytes"
    )


def saved_activation_bytes(model, ids, bf16: bool) -> int:
    """Bytes of the distinct tensors autograd saves in one decoder layer's forward, without the weights
    and their bf16 casts (the estimate counts those apart)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weight_shapes = {tuple(p.shape) for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in params and tuple(t.shape) not in weight_shapes:
            saved[ptr] = t.untyped_storage().nbytes()
        return t

    decoder = model.get_decoder()
    embedded = decoder.embed_tokens(ids)
    rotary = decoder.rotary_emb(embedded, torch.arange(ids.shape[1])[None])
    saving = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    with saving, torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        decoder.layers[0](embedded, position_embeddings=rotary, attention_mask=None)
    return sum(saved.values())


@pytest.mark.parametrize("bf16", [False, True])
def test_a_layers_saved_activations_match_the_estimate_within_ten_percent(bf16):
    config = tiny_config(micro_batch_size=4)
    vocab = 320
    model = build_model(llama_config(config.model, vocab, config.train.seq_len), seed=0)
    ids = torch.randint(0, vocab, (4, 32))
    measured = saved_activation_bytes(model, ids, bf16)
    shape = memory.model_shape(config, vocab)
    estimated = memory.layer_activation_bytes(shape, bf16) * ids.numel()
    assert estimated == pytest.approx(measured, rel=0.10), f"estimated {estimated}, autograd saved {measured}"


def test_shipped_presets_fit_one_80gb_gpu_as_documented():
    estimates = {
        name: memory.estimate_training_memory(
            load_config(PretrainConfig, PRESETS / f"{name}.yaml"), 32768, GPU_80GB
        )
        for name in ("125m", "1b", "2b", "4b")
    }
    assert all(e.fits for e in estimates.values()), {n: e.report() for n, e in estimates.items()}
    assert estimates["2b"].settings["gradient_checkpointing"] is False
    assert estimates["4b"].settings["optimizer"] == "adamw_8bit"
    assert estimates["125m"].settings["micro_batch_size"] > 16


def test_preflight_refuses_a_config_too_big_for_the_gpu_naming_the_knobs(monkeypatch):
    monkeypatch.setattr(memory, "visible_gpu_bytes", lambda: 24 * 2**30)  # stands in for a 24 GB GPU
    config = load_config(PretrainConfig, PRESETS / "2b.yaml")
    with pytest.raises(InputError) as refused:
        memory.check_fits(config, 32768)
    assert refused.value.exit_code == ExitCode.BAD_INPUT
    for knob in (
        "train.micro_batch_size",
        "train.seq_len",
        "train.gradient_checkpointing",
        "train.optimizer",
    ):
        assert knob in str(refused.value)
    assert "weights (fp32)" in str(refused.value)  # the breakdown comes with it


def test_a_refusal_whose_peak_is_a_compiled_backward_that_accumulates_names_compile_and_accumulation(
    monkeypatch,
):
    monkeypatch.setattr(memory, "visible_gpu_bytes", lambda: GPU_80GB)  # stands in for an 80 GB GPU
    config = load_config(
        PretrainConfig, PRESETS / "4b.yaml", ["train.optimizer=adamw", "train.micro_batch_size=2"]
    )
    with pytest.raises(InputError) as refused:
        memory.check_fits(config, 32768)
    assert "peak=end of the backward" in str(refused.value)
    assert "train.compile=false or train.grad_accum_steps=1 (now 16)" in str(refused.value)


def test_without_a_gpu_preflight_only_logs_the_estimate(caplog):
    config = load_config(
        PretrainConfig, PRESETS / "4b.yaml", ["train.optimizer=adamw", "train.micro_batch_size=64"]
    )
    with caplog.at_level("INFO", logger="trainpod.train.memory"):
        estimate = memory.check_fits(config, 32768)
    assert estimate.gpu_bytes is None and estimate.total > GPU_80GB
    assert "estimated peak GPU memory" in caplog.text


def test_the_estimate_is_readable_by_part():
    report = memory.estimate_training_memory(tiny_config(), 320, GPU_80GB).report()
    for part in ("weights", "gradients", "optimizer states", "activations", "loss", "CUDA context"):
        assert part in report


def test_fsdp_holds_a_share_of_weights_gradients_and_optimizer_state_per_rank():
    config = tiny_config(parallel="fsdp")
    single = memory.estimate_training_memory(config, 320, world_size=1).parts
    sharded = memory.estimate_training_memory(config, 320, world_size=4).parts
    assert sharded["weights (fp32 / 4 ranks)"] == -(-single["weights (fp32)"] // 4)
    assert sharded["gradients (fp32 / 4 ranks)"] == -(-single["gradients (fp32)"] // 4)
    assert sharded["optimizer states (adamw / 4 ranks)"] == -(-single["optimizer states (adamw)"] // 4)
    assert "FSDP gathered units (root + 2 layers)" in sharded
    ddp = memory.estimate_training_memory(tiny_config(parallel="ddp"), 320, world_size=4).parts
    assert ddp["weights (fp32)"] == single["weights (fp32)"], "DDP replicates everything"


def test_the_4b_preset_on_eight_gpus_is_sharded_by_auto_and_holds_a_third_of_a_replica_per_gpu():
    config = load_config(PretrainConfig, PRESETS / "4b.yaml", ["train.optimizer=adamw"])
    one_gpu = memory.estimate_training_memory(config, 32768, GPU_80GB, world_size=1)
    eight_gpus = memory.estimate_training_memory(config, 32768, GPU_80GB, world_size=8)
    assert eight_gpus.settings["parallel"] == "fsdp", "auto picks FSDP for a model over 1B on several GPUs"
    assert eight_gpus.total < one_gpu.total / 3, (one_gpu.report(), eight_gpus.report())
    replicated = load_config(
        PretrainConfig, PRESETS / "4b.yaml", ["train.optimizer=adamw", "train.parallel=ddp"]
    )
    ddp = memory.estimate_training_memory(replicated, 32768, GPU_80GB, world_size=8)
    assert ddp.parts["gradients (fp32)"] == one_gpu.parts["gradients (fp32)"], (
        "DDP's buckets are the gradients (gradient_as_bucket_view): no extra copy"
    )
    # Compiled under DDP, the graph is split at its buckets, so each backward returns one bucket's gradients;
    # on one GPU the single compiled backward returns all of them at once (test_memory_compiled.py).
    assert "gradients of a micro-batch (compiled)" not in ddp.parts
    assert one_gpu.settings["peak"] == "end of the backward"


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_a_pretrain_checkpoint_is_the_size_the_disk_check_and_the_stop_count(volume, optimizer):
    """A checkpoint holds fp32 weights and the optimizer's state: an 8-bit AdamW's is about a quarter of AdamW's.
    Counted as AdamW's, boot's free-space check refused the 4b preset (exit 5, 'grow the network volume') on a
    volume with room for its checkpoints, and a stop before the first commit thought one took twice as long."""
    from test_eval_stop import pretrainer

    from trainpod.workloads.pretrain import disk_estimate

    trainer = pretrainer(
        volume,
        f"train.optimizer={optimizer}",
        "train.max_steps=1",
        "train.warmup_steps=0",
        "train.eval_every=0",
    )
    trainer.train()
    [checkpoint] = trainer.store.committed()
    held = sum((checkpoint.path / f).stat().st_size for f in ("model.safetensors", "optimizer.safetensors"))
    assert trainer.checkpoint_bytes_estimate() == pytest.approx(held, rel=0.05)
    vocab = trainer.model_config.vocab_size
    config = trainer.cfg.model_copy(
        update={"model": trainer.cfg.model.model_copy(update={"vocab_size": vocab})}
    )
    kept = config.checkpoint.keep_last + config.checkpoint.keep_best + 1
    assert disk_estimate(config) == pytest.approx(kept * held + 4 * trainer.n_params, rel=0.05)


@pytest.mark.parametrize("optimizer", ["adamw", "adamw_8bit"])
def test_a_finetune_checkpoint_is_the_size_the_disk_check_and_the_stop_count(
    finetune_base_volume, tmp_path, optimizer
):
    """A full finetune's checkpoint holds what trains and the optimizer's state: counted as AdamW's whatever
    train.optimizer, an 8-bit AdamW's checkpoint read about twice its size to the free-space check and the stop."""
    import shutil

    from test_eval_stop import generation_eval_finetuner

    volume = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, volume)
    trainer = generation_eval_finetuner(
        volume,
        "method=full",
        f"train.optimizer={optimizer}",
        "train.max_steps=1",
        "train.eval_every=0",
        "generation_eval.every_evals=0",
    )
    trainer.train()
    [checkpoint] = trainer.store.committed()
    held = sum(
        (checkpoint.path / f).stat().st_size for f in ("trainable.safetensors", "optimizer.safetensors")
    )
    # 10%: the saved 8-bit state repeats the two 2 KB quantization maps for each tensor, a few % of a model
    # this tiny (nothing of a real one); counted as AdamW's, the old size was about twice the 8-bit one.
    assert trainer.checkpoint_bytes_estimate() == pytest.approx(held, rel=0.1)
