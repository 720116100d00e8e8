"""A finetune step's loss is the mean over every trained token of its micro-batches, as one big batch's
would be: micro-batches with uneven token counts weigh by their tokens, not as a mean of their means.
Whatever computes it: the chunked loss (a known decoder), transformers' own loss given
num_items_in_batch, or a remote-code model whose own loss knows nothing of num_items_in_batch.

In-process: the tiny base's Finetuner takes one step, and its gradients before the optimizer step are
checked against the gradients of the token-weighted loss of the same micro-batches.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from trainpod.config import load_config
from trainpod.config.finetune import FinetuneConfig
from trainpod.context import RunContext
from trainpod.preemption import PreemptionWatch
from trainpod.sft import IGNORE_INDEX
from trainpod.train.distributed import init_distributed
from trainpod.volume import Volume

from finetune_support import BASE, FINETUNE_RUN, SFT_FILE, TINY_FINETUNE

pytestmark = pytest.mark.slow

SETTINGS = [
    f"base_model.path={BASE}",
    f"data.sft.datasets={json.dumps([{'path': SFT_FILE, 'format': 'alpaca'}])}",
    "data.sft.template=chatml",
    "data.sft.packing=false",  # one sample a micro-batch: 5, 3, 3 and 5 trained tokens in the first step
    "method=lora",
    "lora.dropout=0.0",
    "train.micro_batch_size=1",
    "train.grad_accum_steps=4",
    "train.grad_clip=0",
]

# A causal LM in remote code written before num_items_in_batch (as InternLM2's or MiniCPM's): a forward of
# named arguments, its loss the mean over its own micro-batch; `**kwargs` where the forward takes any.
REMOTE_CODE = """
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast


class OldConfig(LlamaConfig):
    model_type = "old_llama"


class OldForCausalLM(LlamaForCausalLM):
    config_class = OldConfig

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                inputs_embeds=None, labels=None, use_cache=None, output_attentions=None, output_hidden_states=None,
                return_dict=None{kwargs}):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                              past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
        loss = None
        if labels is not None:
            logits = out.logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1)
            )
        return CausalLMOutputWithPast(loss=loss, logits=out.logits, past_key_values=out.past_key_values)
"""


@pytest.fixture
def volume(finetune_base_volume: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, copy)
    return copy


def as_remote_code(volume: Path, takes_kwargs: bool) -> None:
    """The tiny base's weights under the remote-code class above (auto_map in its config.json)."""
    from transformers import AutoConfig

    folder = volume / BASE
    (folder / "old.py").write_text(REMOTE_CODE.format(kwargs=", **kwargs" if takes_kwargs else ""))
    spec = importlib.util.spec_from_file_location("old", folder / "old.py")
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    settings = AutoConfig.from_pretrained(folder).to_dict()
    for key in ("model_type", "architectures", "transformers_version", "auto_map"):
        settings.pop(key, None)
    config = old.OldConfig(
        **settings, auto_map={"AutoConfig": "old.OldConfig", "AutoModelForCausalLM": "old.OldForCausalLM"}
    )
    model = old.OldForCausalLM.from_pretrained(folder, config=config)
    for weights in folder.glob("model*.safetensors"):
        weights.unlink()
    model.save_pretrained(folder)


def finetuner(volume: Path, *settings: str):
    from trainpod.workloads.finetune import Finetuner

    config = load_config(FinetuneConfig, TINY_FINETUNE, [*SETTINGS, *settings])
    run = Volume(volume).run(FINETUNE_RUN)
    run.create()
    return Finetuner(RunContext(Volume(volume), run, PreemptionWatch()), config, init_distributed())


def step_and_token_weighted(trainer) -> tuple[dict, dict, float, float, list[int]]:
    """The gradients one train_step leaves for the optimizer and those of the summed token loss of the same
    micro-batches over their trained tokens; the loss the step logs and that loss; each micro-batch's
    trained tokens."""
    micro_batches, next_batch = [], trainer.batches.next_batch
    trainer.batches.next_batch = lambda: micro_batches.append(next_batch()) or micro_batches[-1]
    stepped: dict[str, torch.Tensor] = {}
    expected: dict[str, torch.Tensor] = {}
    expected_loss = []

    def instead_of_the_optimizer_step(*args, **kwargs):
        stepped.update({name: p.grad.clone() for name, p in trainer.trainable.items()})
        trainer.optimizer.zero_grad(set_to_none=True)
        total, tokens = torch.zeros(()), 0
        for batch in micro_batches:
            inputs = {k: v for k, v in batch.items() if k in ("input_ids", "attention_mask", "position_ids")}
            logits = trainer.model(**inputs).logits[:, :-1].float()
            targets = batch["labels"][:, 1:]
            total = total + F.cross_entropy(logits.transpose(1, 2), targets, reduction="sum")
            tokens += int((targets != IGNORE_INDEX).sum())
        (total / tokens).backward()
        expected_loss.append((total / tokens).item())
        expected.update({name: p.grad.clone() for name, p in trainer.trainable.items()})

    trainer.optimizer.step = instead_of_the_optimizer_step
    model = trainer.wrap_for_training()
    model.train()
    logged = trainer.train_step(model, 1).loss.item()
    counts = [int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro_batches]
    return stepped, expected, logged, expected_loss[0], counts


def assert_token_weighted(trainer) -> None:
    stepped, expected, logged, loss, counts = step_and_token_weighted(trainer)
    assert len(set(counts)) > 1, f"uneven token counts tell the two apart, not {counts}"
    assert logged == pytest.approx(loss, rel=1e-5), "the logged loss is the mean over the trained tokens"
    for name, grad in expected.items():
        torch.testing.assert_close(
            stepped[name], grad, rtol=1e-4, atol=1e-7, msg=lambda m, name=name: f"{name}: {m}"
        )


def test_the_chunked_loss_weighs_micro_batches_by_their_trained_tokens(volume):
    trainer = finetuner(volume)
    assert trainer.chunked_loss
    assert_token_weighted(trainer)


def test_transformers_own_loss_weighs_micro_batches_by_their_trained_tokens(volume, monkeypatch):
    import trainpod.workloads.finetune as finetune

    # as for a head the chunked loss cannot take (a soft-capped or quantized one)
    monkeypatch.setattr(finetune, "fits_chunked_loss", lambda model: False)
    trainer = finetuner(volume)
    assert not trainer.chunked_loss
    assert_token_weighted(trainer)


@pytest.mark.parametrize("takes_kwargs", [False, True], ids=["named-arguments", "kwargs-ignored"])
def test_a_remote_code_models_step_weighs_micro_batches_by_their_trained_tokens(volume, takes_kwargs):
    """Its forward took no num_items_in_batch (a TypeError at the first step, exit 1 at every restart), or took
    it in **kwargs and returned its micro-batch's mean: a mean of means, and a logged loss grad_accum_steps
    times the real one."""
    as_remote_code(volume, takes_kwargs)
    trainer = finetuner(volume, "base_model.trust_remote_code=true")
    assert not trainer.chunked_loss
    assert_token_weighted(trainer)


def test_the_eval_of_a_chunked_loss_finetune_never_makes_a_whole_batchs_logits(volume):
    """The eval took per-token losses from the model's own forward: the whole batch's logits, their fp32 copy and
    log-softmax (12 GB for 4 x 2048 tokens of Qwen2.5's vocabulary), an OOM at the first eval of a run whose
    chunked-loss steps fit the GPU. It computes them a chunk at a time now, with the same losses."""
    from trainpod.train.loss import _base_model

    trainer = finetuner(
        volume, "data.sft.val_ratio=0.25", "train.micro_batch_size=4", "train.worst_samples=100"
    )
    assert trainer.chunked_loss and len(trainer.data.val) > 4
    head_outputs = []
    head = _base_model(trainer.model).get_output_embeddings()
    hook = head.register_forward_hook(lambda module, args, output: head_outputs.append(output.shape))
    model = trainer.wrap_for_training()
    eval_loss = trainer.evaluate(model, 10)
    hook.remove()
    assert head_outputs == [], "the output head ran over whole eval batches"

    total, tokens, per_sample = 0.0, 0, {}
    with torch.no_grad():
        for batch in trainer._eval_batches():
            inputs = {k: batch[k] for k in ("input_ids", "attention_mask")}
            logits = trainer.model(**inputs).logits[:, :-1].float()
            targets = batch["labels"][:, 1:]
            losses = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
            trained = targets != IGNORE_INDEX
            total += (losses * trained).sum().item()
            tokens += int(trained.sum())
            for row, index in enumerate(batch["sample_index"].tolist()):
                if trained[row].any():
                    per_sample[index] = ((losses[row] * trained[row]).sum() / trained[row].sum()).item()
    assert eval_loss == pytest.approx(total / tokens, rel=1e-5)
    written = (volume / "runs" / FINETUNE_RUN / "eval" / "step-10.worst.jsonl").read_text().splitlines()
    worst = {record["val_index"]: record["loss"] for record in map(json.loads, written)}
    assert worst.keys() == per_sample.keys()
    for index, loss in worst.items():
        assert loss == pytest.approx(per_sample[index], rel=1e-5), index
