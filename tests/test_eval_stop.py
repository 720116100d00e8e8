"""A stop during an eval: the eval is dropped, the step before it committed within the warning window,
and the resumed run evaluates that step first and ends byte-identical to an uninterrupted run. With
torch.compile, the eval's graph is built before the first step, never between two commits.

In-process runs: a pretrain on the tiny dataset, and a LoRA finetune stopped in its generation eval.
The SIGTERM is `PreemptionWatch.request`, which is what the signal handler does (test_preemption.py
covers the handler itself).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from collections.abc import Callable
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
    """The stop is asked for between the eval's first and second batch, in the eval of `step` only."""
    trainer.eval_windows = _StopWhenRead(
        trainer.eval_windows, trainer.ctx.watch, lambda: trainer.progress.step == step
    )


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

    # Stopped again in the pending eval of step 4, before any step: the committed step stands (exit 143).
    again = pretrainer(volume)
    stop_after_the_first_eval_batch_at(again, 4)
    with pytest.raises(Preempted, match="newest checkpoint: step 4"):
        again.train()
    assert 4 not in eval_losses(volume)

    second = pretrainer(volume)
    second.train()
    assert second.progress.step == 8
    assert eval_losses(volume) == eval_losses(whole), "the eval of step 4 ran after the resume, then step 8's"
    resumed, expected = final_weights(second), final_weights(uninterrupted)
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


def test_the_cost_counts_the_evals_too_not_only_the_steps(volume: Path, monkeypatch: pytest.MonkeyPatch):
    """The pod bills evals, commits and loading as much as steps: TRAINPOD_BUDGET_USD counted steps alone."""
    trainer = pretrainer(volume)
    evaluate = trainer.evaluate

    def slow_evaluate(model: torch.nn.Module, step: int) -> float:
        time.sleep(1.5)  # an eval of many batches, as on a real validation split
        return evaluate(model, step)

    monkeypatch.setattr(trainer, "evaluate", slow_evaluate)
    trainer.train()
    assert trainer.progress.step == 8
    assert trainer.progress.elapsed_s >= 3.0, "the two evals' 3 s are counted"
    status = json.loads((volume / "runs" / RUN / "status.json").read_text())
    assert status["elapsed_s"] >= 3.0


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


def generation_eval_finetuner(volume: Path, *settings: str):
    """A LoRA finetune of the tiny base with a generation eval at every eval (steps 3 and 6); `settings`
    override the config."""
    from trainpod.config.finetune import FinetuneConfig
    from trainpod.workloads.finetune import Finetuner

    from finetune_support import FINETUNE_RUN, finetune_args

    args = finetune_args(
        "--set", "train.max_steps=6", "--set", "train.eval_every=3", "--set", "checkpoint.every_steps=100",
        "--set", "checkpoint.mode=sync", "--set", "generation_eval.every_evals=1",
        "--set", "generation_eval.max_samples=3", "--set", "generation_eval.max_new_tokens=4",
        *[part for setting in settings for part in ("--set", setting)],
        method="lora",
    )  # fmt: skip
    overrides = [value for flag, value in zip(args[4::2], args[5::2], strict=True) if flag == "--set"]
    config = load_config(FinetuneConfig, Path(args[3]), overrides)
    run = Volume(volume).run(FINETUNE_RUN)
    run.create()
    return Finetuner(RunContext(Volume(volume), run, PreemptionWatch()), config, init_distributed())


def logged_steps(volume: Path) -> list[int]:
    from finetune_support import FINETUNE_RUN

    lines = (volume / "runs" / FINETUNE_RUN / "logs" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def stop_during_the_generation_eval_at(trainer, step: int) -> None:
    """A SIGTERM between the generation eval's first and second answer at `step`. Its prompts are read
    whole before the first answer (the stop tokens come from their reference answers), so the stop comes
    as the answers are taken: through until_stop(local=True), which only rank 0's generation eval calls."""
    real_until_stop = trainer.until_stop

    def until_stop(prompts, local=False):
        if not local:
            yield from real_until_stop(prompts, local)
            return

        def asking_for_a_stop():
            for index, prompt in enumerate(prompts):
                if index == 1 and trainer.progress.step == step:
                    trainer.ctx.watch.request("SIGTERM")  # between the first and second answer
                yield prompt

        yield from real_until_stop(asking_for_a_stop(), local)

    trainer.until_stop = until_stop


def test_a_stop_during_a_finetunes_generation_eval_is_resumed_the_same_way(
    tmp_path: Path, finetune_base_volume: Path
):
    # LoRA dropout draws random numbers in every step, so equal weights also show the eval drew none.
    from finetune_support import FINETUNE_RUN

    def finetuner(name: str):
        volume = tmp_path / name
        if not volume.exists():
            shutil.copytree(finetune_base_volume, volume)
        return generation_eval_finetuner(volume)

    def metrics(name: str) -> dict[int, dict]:
        lines = (tmp_path / name / "runs" / FINETUNE_RUN / "logs" / "metrics.jsonl").read_text().splitlines()
        evals = [m for m in map(json.loads, lines) if "eval_loss" in m]
        return {m["step"]: {k: v for k, v in m.items() if k.startswith("eval_")} for m in evals}

    def trained(trainer) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    uninterrupted = finetuner("uninterrupted")
    uninterrupted.train()

    first = finetuner("stopped")
    stop_during_the_generation_eval_at(first, 3)
    with pytest.raises(Preempted):
        first.train()
    assert 3 not in metrics("stopped")
    assert (
        tmp_path / "stopped" / "runs" / FINETUNE_RUN / "checkpoints" / "LATEST"
    ).read_text().strip() == "step-3"

    second = finetuner("stopped")
    second.train()
    assert metrics("stopped") == metrics("uninterrupted")
    assert (
        logged_steps(tmp_path / "stopped") == logged_steps(tmp_path / "uninterrupted") == [1, 2, 3, 4, 5, 6]
    ), "one row per step: step 3's eval, run after the resume, joins the row step 3 logged before the stop"
    assert set(metrics("uninterrupted")[3]) >= {"eval_loss", "eval_cer"}, "the generation eval ran at step 3"
    resumed, expected = trained(second), trained(uninterrupted)
    assert resumed and all(torch.equal(resumed[name], expected[name]) for name in expected)


def test_the_checkpoint_of_a_step_whose_eval_a_stop_interrupted_is_ranked_by_that_eval_once_it_runs(
    tmp_path: Path, finetune_base_volume: Path
):
    """keep_best keeps the checkpoints with the best score in their manifests. A stop during step 3's eval
    committed step 3 without one; the resumed run ran that eval first, but its result never reached step
    3's manifest, so the checkpoint never competed for best-k retention: the run's best checkpoint was
    deleted once newer ones came, where an uninterrupted run keeps it."""

    settings = (
        "checkpoint.every_steps=3",
        "checkpoint.keep_last=3",
        "checkpoint.keep_best=1",
        "train.max_steps=9",
    )

    def finetuner(name: str):
        volume = tmp_path / name
        if not volume.exists():
            shutil.copytree(finetune_base_volume, volume)
        return generation_eval_finetuner(volume, *settings)

    def ranked(name: str) -> dict[str, tuple]:
        checkpoints = tmp_path / name / "runs" / "tiny-finetune" / "checkpoints"
        manifests = {
            path.name: json.loads((path / "manifest.json").read_text()) for path in checkpoints.glob("step-*")
        }
        return {name: (m["eval_loss"], m.get("score")) for name, m in manifests.items()}

    finetuner("uninterrupted").train()
    first = finetuner("stopped")
    stop_during_the_generation_eval_at(first, 3)
    with pytest.raises(Preempted):
        first.train()
    assert ranked("stopped") == {"step-3": (None, None)}, "committed before its eval, which the stop dropped"

    finetuner("stopped").train()
    expected = ranked("uninterrupted")
    assert expected["step-3"][0] is not None
    assert ranked("stopped") == expected, "step 3's eval, run after the resume, ranks its checkpoint too"


def test_a_stop_during_the_last_steps_eval_leaves_status_json_showing_that_steps_loss(
    tmp_path: Path, finetune_base_volume: Path
):
    """Stopped in the eval of the last step, the resumed run trains no step: it runs that eval and ends. Its
    status.json showed the eval alone, loss null, where an uninterrupted run shows the last step's loss."""
    from finetune_support import FINETUNE_RUN

    def finetuner(name: str):
        volume = tmp_path / name
        if not volume.exists():
            shutil.copytree(finetune_base_volume, volume)
        return generation_eval_finetuner(volume)

    def status(name: str) -> dict:
        return json.loads((tmp_path / name / "runs" / FINETUNE_RUN / "status.json").read_text())

    finetuner("uninterrupted").train()
    first = finetuner("stopped")
    stop_during_the_generation_eval_at(first, 6)
    with pytest.raises(Preempted):
        first.train()
    finetuner("stopped").train()
    shown = ("step", "loss", "lr", "eval_loss", "eval_metrics")
    assert status("stopped")["loss"] is not None
    assert {key: status("stopped")[key] for key in shown} == {
        key: status("uninterrupted")[key] for key in shown
    }
    assert logged_steps(tmp_path / "stopped") == [1, 2, 3, 4, 5, 6]


class _StopWhenRead(list):
    """A rank's eval windows: the stop is asked for (on this rank alone) as the second one is read, in
    an eval where `now()` holds."""

    def __init__(self, batches: list, watch: PreemptionWatch, now: Callable[[], bool]):
        super().__init__(batches)
        self.watch, self.now = watch, now

    def __iter__(self):
        for index, batch in enumerate(super().__iter__()):
            if index == 1 and self.now():
                self.watch.request("SIGTERM")
            yield batch


def join_two_ranks(rank: int, port: int) -> None:
    """This process's environment as the launcher gives rank `rank` of two on this machine (gloo)."""
    os.environ |= {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def leave_two_ranks() -> None:
    """Both ranks here before either destroys the group: rank 0 hosts the store (no torchrun), and a rank 0
    that left first broke the other's connection mid-teardown, which gloo ends in std::terminate (exit -6)."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _two_rank_worker(workload: str, rank: int, port: int, volume: str, stop_at: int) -> None:
    """One of two gloo ranks, as the launcher starts them; rank 0 alone is stopped during the eval (pretrain)
    or the generation eval (finetune) of step `stop_at`. Writes its outcome, and rank 0 the final weights."""
    join_two_ranks(rank, port)
    if workload == "pretrain":
        # 3 of the eval's windows a rank, as one rank has in SETTINGS: the stop comes before the last one
        trainer = pretrainer(Path(volume), "train.eval_batches=6")
        if rank == 0 and stop_at:
            stop_after_the_first_eval_batch_at(trainer, stop_at)
    else:
        trainer = generation_eval_finetuner(Path(volume))
        if rank == 0 and stop_at:
            stop_during_the_generation_eval_at(trainer, stop_at)
    outcome = "done"
    try:
        trainer.train()
    except Preempted as stopped:
        outcome = str(stopped)
    Path(volume, f"outcome-{rank}").write_text(outcome)
    if rank == 0 and outcome == "done":
        torch.save(final_weights(trainer), Path(volume, "weights.pt"))
    leave_two_ranks()


def _run_two_ranks(volume: Path, stop_at: int = 0, workload: str = "pretrain") -> list[str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spawn = torch.multiprocessing.get_context("spawn")
    workers = [
        spawn.Process(target=_two_rank_worker, args=(workload, rank, port, str(volume), stop_at))
        for rank in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=600)
    assert [worker.exitcode for worker in workers] == [0, 0]
    return [(volume / f"outcome-{rank}").read_text() for rank in range(2)]


def test_on_two_ranks_a_stop_seen_by_one_during_an_eval_ends_it_on_both_and_resume_is_exact(
    tmp_path: Path, tiny_dataset_volume: Path
):
    """The ranks agree before each eval batch: rank 0 alone is asked to stop, after its second batch, and
    both drop the eval together, commit the step before it and stop; the resumed pair evaluates that step
    first and ends with the weights of an uninterrupted pair."""

    def fresh_volume(name: str) -> Path:
        for folder in ("datasets", "tokenizers"):
            shutil.copytree(tiny_dataset_volume / folder, tmp_path / name / folder)
        return tmp_path / name

    whole = fresh_volume("uninterrupted")
    assert _run_two_ranks(whole) == ["done", "done"]

    volume = fresh_volume("stopped")
    outcomes = _run_two_ranks(volume, stop_at=4)
    assert outcomes == [
        "stopped by SIGTERM at step 4; newest checkpoint: step 4",
        "stopped by a stop on another rank at step 4; newest checkpoint: step 4",  # never signalled itself
    ]
    assert (volume / "runs" / RUN / "checkpoints" / "LATEST").read_text().strip() == "step-4"
    assert 4 not in eval_losses(volume)

    assert _run_two_ranks(volume) == ["done", "done"]
    assert eval_losses(volume) == eval_losses(whole)
    resumed, expected = torch.load(volume / "weights.pt"), torch.load(whole / "weights.pt")
    assert resumed.keys() == expected.keys()
    assert all(torch.equal(resumed[name], expected[name]) for name in expected)


def test_on_two_ranks_a_stop_during_rank_0s_generation_eval_ends_the_eval_on_both(
    tmp_path: Path, finetune_base_volume: Path
):
    """Rank 0 alone generates; the other waits for its metrics. Stopped between two answers, rank 0 says so
    in that broadcast and both drop the eval, commit step 3 and stop."""
    from finetune_support import FINETUNE_RUN

    volume = tmp_path / "stopped"
    shutil.copytree(finetune_base_volume, volume)
    outcomes = _run_two_ranks(volume, stop_at=3, workload="finetune")
    assert outcomes == [
        "stopped by SIGTERM at step 3; newest checkpoint: step 3",
        "stopped by a stop on another rank at step 3; newest checkpoint: step 3",
    ]
    logs = volume / "runs" / FINETUNE_RUN / "logs" / "metrics.jsonl"
    assert not [line for line in logs.read_text().splitlines() if "eval_loss" in line]
    assert _run_two_ranks(volume, workload="finetune") == ["done", "done"]
    evals = [json.loads(line) for line in logs.read_text().splitlines() if "eval_cer" in line]
    assert [m["step"] for m in evals] == [3, 6], "the resumed pair ran step 3's generation eval first"


@pytest.mark.parametrize(
    ("eval_every", "every_steps", "warned"), [(6, 4, True), (4, 4, False), (8, 4, False), (4, 8, True)]
)
def test_a_checkpoint_interval_that_misses_most_evals_is_said_when_keep_best_ranks_them(
    tmp_path: Path, tiny_dataset_volume: Path, caplog, eval_every, every_steps, warned
):
    """keep_best ranks the checkpoints committed at an eval's step: with checkpoint.every_steps not dividing
    eval_every, most evals had no checkpoint, and the best kept was the best of a few, with nothing said."""
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, tmp_path / folder)
    trainer = pretrainer(
        tmp_path,
        f"train.eval_every={eval_every}",
        f"checkpoint.every_steps={every_steps}",
        "checkpoint.keep_best=1",
    )
    caplog.set_level("WARNING", "trainpod")
    trainer._warn_if_best_k_sees_few_evals()
    said = [r.getMessage() for r in caplog.records if "keep_best" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert f"eval_every={eval_every} and checkpoint.every_steps={every_steps}" in said[0]
