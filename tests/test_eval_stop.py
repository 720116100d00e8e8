"""A stop during an eval: the eval is dropped, the step before it committed within the warning window,
and the resumed run evaluates that step first and ends byte-identical to an uninterrupted run. With
torch.compile, the eval's graph is built before the first step, never between two commits.

In-process runs: a pretrain on the tiny dataset, and a LoRA finetune stopped in its generation eval.
The SIGTERM is `PreemptionWatch.request`, which is what the signal handler does (test_preemption.py
covers the handler itself).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from trainpod.config import load_config
from trainpod.config.pretrain import PretrainConfig
from trainpod.context import RunContext
from trainpod.errors import Preempted
from trainpod.preemption import PreemptionWatch
from trainpod.train.distributed import init_distributed
from trainpod.volume import Volume
from trainpod.workloads.pretrain import Pretrainer

from support import RUN, TINY_PRETRAIN

pytestmark = pytest.mark.slow

SETTINGS = [
    "train.max_steps=8",
    "train.eval_every=4",
    "train.eval_batches=3",
    "train.log_every=1",
    "checkpoint.every_steps=100",  # the only commits: at the stop and at the end
    "checkpoint.mode=sync",
]


def pretrainer(volume: Path, *settings: str) -> Pretrainer:
    config = load_config(PretrainConfig, TINY_PRETRAIN, [*SETTINGS, *settings])
    run = Volume(volume).run(RUN)
    run.create()
    return Pretrainer(RunContext(Volume(volume), run, PreemptionWatch()), config, init_distributed())


def final_weights(trainer: Pretrainer) -> dict[str, torch.Tensor]:
    return {name: tensor.clone() for name, tensor in trainer.model.state_dict().items()}


def eval_losses(volume: Path) -> dict[int, float]:
    lines = (volume / "runs" / RUN / "logs" / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m["eval_loss"] for m in map(json.loads, lines) if "eval_loss" in m}


def stop_after_the_first_eval_batch_at(trainer: Pretrainer, step: int) -> None:
    real = trainer._eval_batches

    def batches(count: int):
        for index, batch in enumerate(real(count)):
            if index == 1 and trainer.progress.step == step:
                trainer.ctx.watch.request("SIGTERM")  # between the eval's first and second batch
            yield batch

    trainer._eval_batches = batches


def test_a_stop_during_an_eval_commits_the_step_and_the_resumed_run_evaluates_it_first(
    tmp_path: Path, tiny_dataset_volume: Path
):
    def fresh_volume(name: str) -> Path:
        for folder in ("datasets", "tokenizers"):
            shutil.copytree(tiny_dataset_volume / folder, tmp_path / name / folder)
        return tmp_path / name

    whole = fresh_volume("uninterrupted")
    uninterrupted = pretrainer(whole)
    uninterrupted.train()

    volume = fresh_volume("stopped")
    first = pretrainer(volume)
    stop_after_the_first_eval_batch_at(first, 4)
    with pytest.raises(Preempted):
        first.train()
    checkpoints = volume / "runs" / RUN / "checkpoints"
    assert (checkpoints / "LATEST").read_text().strip() == "step-4", "the step before the eval is committed"
    state = json.loads((checkpoints / "step-4" / "trainer_state.json").read_text())
    assert state["progress"]["last_eval_step"] is None, "the dropped eval is not recorded as done"
    assert 4 not in eval_losses(volume)

    second = pretrainer(volume)
    second.train()
    assert second.progress.step == 8
    assert eval_losses(volume) == eval_losses(whole), "the eval of step 4 ran after the resume, then step 8's"
    resumed, expected = final_weights(second), final_weights(uninterrupted)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


def test_with_compile_the_eval_graph_is_built_before_the_first_step(
    volume: Path, monkeypatch: pytest.MonkeyPatch
):
    # Dynamo's tracing with a counting backend instead of Inductor's code generation (minutes on 2 cores):
    # which graphs are built, and when, is Dynamo's decision either way.
    from torch._dynamo.testing import CompileCounter

    counter, real_compile = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **_: real_compile(model, backend=counter))
    trainer = pretrainer(volume, "train.compile=true", "train.max_steps=6", "train.eval_every=2")
    graphs_at_step: dict[int, int] = {}
    real_step = trainer.train_step

    def counted_step(model: torch.nn.Module, step: int):
        graphs_at_step[step] = counter.frame_count
        return real_step(model, step)

    trainer.train_step = counted_step
    trainer.train()
    torch._dynamo.reset()
    assert sorted(eval_losses(volume)) == [2, 4, 6]
    assert graphs_at_step[1] >= 1, "the eval graph was built before the first step"
    assert counter.frame_count == graphs_at_step[2], (
        "no graph was built after the first step (the training one)"
    )


def test_a_stop_during_a_finetunes_generation_eval_is_resumed_the_same_way(
    tmp_path: Path, finetune_base_volume: Path
):
    # LoRA dropout draws random numbers in every step, so equal weights also show the eval drew none.
    from trainpod.config.finetune import FinetuneConfig
    from trainpod.workloads.finetune import Finetuner

    from finetune_support import FINETUNE_RUN, finetune_args

    args = finetune_args(
        "--set", "train.max_steps=6", "--set", "train.eval_every=3", "--set", "checkpoint.every_steps=100",
        "--set", "checkpoint.mode=sync", "--set", "generation_eval.every_evals=1",
        "--set", "generation_eval.max_samples=3", "--set", "generation_eval.max_new_tokens=4",
        method="lora",
    )  # fmt: skip
    overrides = [value for flag, value in zip(args[4::2], args[5::2], strict=True) if flag == "--set"]

    def finetuner(name: str) -> Finetuner:
        volume = tmp_path / name
        if not volume.exists():
            shutil.copytree(finetune_base_volume, volume)
        config = load_config(FinetuneConfig, Path(args[3]), overrides)
        run = Volume(volume).run(FINETUNE_RUN)
        run.create()
        return Finetuner(RunContext(Volume(volume), run, PreemptionWatch()), config, init_distributed())

    def metrics(name: str) -> dict[int, dict]:
        lines = (tmp_path / name / "runs" / FINETUNE_RUN / "logs" / "metrics.jsonl").read_text().splitlines()
        evals = [m for m in map(json.loads, lines) if "eval_loss" in m]
        return {m["step"]: {k: v for k, v in m.items() if k.startswith("eval_")} for m in evals}

    def trained(trainer: Finetuner) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    uninterrupted = finetuner("uninterrupted")
    uninterrupted.train()

    first = finetuner("stopped")
    real_prompts = first.generation_prompts

    def prompts(limit: int):
        for index, prompt in enumerate(real_prompts(limit)):
            if index == 1 and first.progress.step == 3:
                first.ctx.watch.request("SIGTERM")  # between the first and second answer
            yield prompt

    first.generation_prompts = prompts
    with pytest.raises(Preempted):
        first.train()
    assert 3 not in metrics("stopped")
    assert (
        tmp_path / "stopped" / "runs" / FINETUNE_RUN / "checkpoints" / "LATEST"
    ).read_text().strip() == "step-3"

    second = finetuner("stopped")
    second.train()
    assert metrics("stopped") == metrics("uninterrupted")
    assert set(metrics("uninterrupted")[3]) >= {"eval_loss", "eval_cer"}, "the generation eval ran at step 3"
    resumed, expected = trained(second), trained(uninterrupted)
    assert resumed and all(torch.equal(resumed[name], expected[name]) for name in expected)
