"""The pretrain eval loss is over the same validation windows on any rank count: a run resumed on another
GPU count (train/batches.py rescales its steps to read the same tokens) evaluates what it evaluated before,
so its eval curve and best-k retention compare like with like.

Two gloo ranks on CPU, in-process (as tests/test_eval_stop.py runs them), against one rank, with the same
freshly initialised weights (the same seed on every rank).
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest
import torch
from test_eval_stop import join_two_ranks, leave_two_ranks, pretrainer

pytestmark = pytest.mark.slow

EVAL = ("train.eval_batches=3",)  # odd: two ranks hold 2 and 1 windows, the second rank runs one uncounted


def _eval_loss(volume: Path, *settings: str) -> float:
    trainer = pretrainer(volume, *EVAL, *settings)
    return trainer.evaluate(trainer.wrap_for_training(), 0)


def _rank_worker(rank: int, port: int, volume: str, settings: tuple[str, ...]) -> None:
    join_two_ranks(rank, port)
    torch.set_num_threads(1)
    loss = _eval_loss(Path(volume), *settings)
    Path(volume, f"eval-{rank}").write_text(repr(loss))
    leave_two_ranks()


def _two_rank_eval_losses(volume: Path, *settings: str) -> list[float]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spawn = torch.multiprocessing.get_context("spawn")
    workers = [
        spawn.Process(target=_rank_worker, args=(rank, port, str(volume), settings)) for rank in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=300)
    for worker in workers:
        if worker.exitcode is None:
            worker.kill()
    assert [worker.exitcode for worker in workers] == [0, 0], "a rank failed or hung in the eval"
    return [float((volume / f"eval-{rank}").read_text()) for rank in range(2)]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_the_eval_loss_on_two_ranks_is_the_one_rank_eval_loss_of_the_same_weights(
    tmp_path: Path, tiny_dataset_volume: Path, parallel: str
):
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, tmp_path / folder)
    one_rank = _eval_loss(tmp_path)
    on_two = _two_rank_eval_losses(tmp_path, f"train.parallel={parallel}")
    assert on_two[0] == on_two[1], "every rank reports the same eval loss"
    assert on_two[0] == pytest.approx(one_rank, rel=1e-5), "two ranks evaluated other windows than one rank"
