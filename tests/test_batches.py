"""The data position: four integers restore the exact next batch, with no batches replayed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trainpod.errors import InputError
from trainpod.train.batches import TokenBatches, eval_batches


def fake_shards(count: int, length: int) -> tuple[list[Path], dict[Path, np.ndarray]]:
    """In-memory shards standing in for the token files: shard i holds i*1000 + position."""
    arrays = {Path(f"shard-{i}"): (np.arange(length) + i * 1000).astype(np.uint16) for i in range(count)}
    return list(arrays), arrays


def loader(rank: int = 0, world: int = 2, count: int = 3, length: int = 100, seed: int = 7) -> TokenBatches:
    paths, arrays = fake_shards(count, length)
    return TokenBatches(
        paths, arrays.__getitem__, batch_size=2, seq_len=8, rank=rank, world_size=world, seed=seed
    )


def test_targets_are_inputs_shifted_by_one():
    inputs, targets = loader().next_batch()
    assert torch.equal(inputs.flatten()[1:], targets.flatten()[:-1])


def test_ranks_read_disjoint_windows_of_the_same_global_batch():
    first, second = loader(rank=0).next_batch()[0], loader(rank=1).next_batch()[0]
    assert set(first.flatten().tolist()).isdisjoint(second.flatten().tolist())


def test_restored_position_gives_the_same_batches_as_continuing():
    original = loader()
    for _ in range(37):  # past several shard ends and an epoch boundary
        original.next_batch()
    restored = loader()
    restored.load_state_dict(original.state_dict())
    for _ in range(20):
        a, b = original.next_batch(), restored.next_batch()
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def test_restore_reads_no_batches(monkeypatch):
    state = loader().state_dict() | {"epoch": 5_000, "shard_index": 2, "position": 64}
    fresh = loader()
    opened = []
    fresh._open = lambda path: opened.append(path) or fake_shards(3, 100)[1][path]
    fresh.load_state_dict(state)
    assert opened == [], "restoring the position must not touch any shard"
    fresh.next_batch()
    assert len(opened) == 1


def test_epochs_after_the_first_visit_shards_in_a_seeded_order():
    batches = loader(count=6, length=40)
    orders = []
    for epoch in range(1, 4):
        orders.append(batches._epoch_order(epoch))
    assert all(sorted(order) == list(range(6)) for order in orders)
    assert len({tuple(o) for o in orders}) > 1
    assert loader(count=6, length=40)._epoch_order(2) == orders[1], "the order depends on (seed, epoch) only"


def test_changed_batch_layout_on_resume_is_refused():
    state = loader(world=2).state_dict()
    with pytest.raises(InputError, match="same settings and GPU count"):
        loader(world=1).load_state_dict(state)


def test_shard_smaller_than_a_global_batch_is_a_clear_error():
    with pytest.raises(InputError, match="fewer than one global batch"):
        loader(length=20).next_batch()


def test_eval_batches_are_the_same_every_time_and_do_not_wrap():
    paths, arrays = fake_shards(1, 100)
    first = eval_batches(paths, arrays.__getitem__, 2, 8, count=50)
    again = eval_batches(paths, arrays.__getitem__, 2, 8, count=50)
    assert len(first) == 6  # (100 - 1) // 16 windows, then it would wrap
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
