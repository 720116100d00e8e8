"""The data position: four integers restore the exact next batch, with no batches replayed."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from trainpod.errors import InputError
from trainpod.train.batches import TokenBatches, eval_batches, rescaled_accumulation


def fake_shards(count: int, length: int) -> tuple[list[Path], dict[Path, np.ndarray]]:
    """In-memory shards standing in for the token files: shard i holds i*1000 + position."""
    arrays = {Path(f"shard-{i}"): (np.arange(length) + i * 1000).astype(np.uint16) for i in range(count)}
    return list(arrays), arrays


def loader(
    rank: int = 0, world: int = 2, count: int = 3, length: int = 100, seed: int = 7, accum: int = 1
) -> TokenBatches:
    paths, arrays = fake_shards(count, length)
    return TokenBatches(
        paths,
        arrays.__getitem__,
        batch_size=2,
        seq_len=8,
        rank=rank,
        world_size=world,
        seed=seed,
        grad_accum_steps=accum,
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
    paths, arrays = fake_shards(3, 100)
    other_micro_batch = TokenBatches(paths, arrays.__getitem__, batch_size=4, seq_len=8, world_size=2)
    with pytest.raises(InputError, match="same settings"):
        other_micro_batch.load_state_dict(state)


def test_a_step_reads_the_same_tokens_on_two_ranks_as_on_one_rank_accumulating_two():
    """What lets a run resume on another GPU count: ranks x accumulation read the same windows per step,
    shard ends included (a step moves to the next shard only as a whole)."""
    two_ranks = [loader(rank=r, world=2, length=90) for r in (0, 1)]
    one_rank = loader(rank=0, world=1, length=90, accum=2)
    for _ in range(40):  # many steps: past shard ends (90 tokens fit 2 steps of 32, not 3) and epochs
        spread = torch.cat([ranks.next_batch()[0] for ranks in two_ranks])
        accumulated = torch.cat([one_rank.next_batch()[0] for _ in range(2)])
        assert torch.equal(spread, accumulated)
    assert one_rank.state_dict()["position"] == two_ranks[0].state_dict()["position"]


def test_a_position_taken_on_two_ranks_resumes_on_one_rank_accumulating_twice_as_much():
    two = loader(rank=0, world=2, accum=1)
    for _ in range(5):
        two.next_batch()
    one = loader(rank=0, world=1, accum=rescaled_accumulation(two.state_dict(), world_size=1, configured=1))
    one.load_state_dict(two.state_dict())
    twin = [loader(rank=r, world=2) for r in (0, 1)]
    for ranks in twin:
        ranks.load_state_dict(two.state_dict())
    assert torch.equal(
        torch.cat([one.next_batch()[0] for _ in range(2)]), torch.cat([r.next_batch()[0] for r in twin])
    )


def test_accumulation_is_rescaled_to_keep_the_global_batch_or_refused_with_the_counts_that_fit():
    saved = {"world_size": 2, "grad_accum_steps": 3}
    assert rescaled_accumulation(saved, world_size=1, configured=3) == 6
    assert rescaled_accumulation(saved, world_size=6, configured=3) == 1
    assert rescaled_accumulation(saved, world_size=2, configured=5) == 3, "same rank count: the checkpoint's"
    with pytest.raises(InputError, match=r"4 ranks cannot share them evenly. Resume on 1, 2, 3, 6 GPU"):
        rescaled_accumulation(saved, world_size=4, configured=3)


def test_a_rescaled_position_resumes_again_on_the_rank_count_that_rescaled_it():
    # 2 ranks x 1 (the config's accumulation) -> 1 rank x 2 -> 1 rank again: the second resume on one rank
    # must keep accumulating 2, though the config still says 1 (it was refused with exit 2).
    two = loader(rank=0, world=2, accum=1)
    for _ in range(3):
        two.next_batch()
    one = loader(rank=0, world=1, accum=rescaled_accumulation(two.state_dict(), world_size=1, configured=1))
    one.load_state_dict(two.state_dict())
    for _ in range(4):
        one.next_batch()
    again = loader(rank=0, world=1, accum=rescaled_accumulation(one.state_dict(), world_size=1, configured=1))
    again.load_state_dict(one.state_dict())
    assert again.grad_accum_steps == 2
    assert torch.equal(
        torch.cat([again.next_batch()[0] for _ in range(2)]),
        torch.cat([one.next_batch()[0] for _ in range(2)]),
    )


def test_a_position_whose_step_reads_other_windows_is_refused():
    state = loader(world=2, accum=2).state_dict()
    with pytest.raises(InputError, match="steps read 4 micro-batches"):
        loader(world=1, accum=3).load_state_dict(state)


def test_shards_that_all_hold_less_than_one_step_are_an_error_when_the_loader_is_made():
    with pytest.raises(
        InputError, match=r"no shard of .* holds one optimizer step .* = 33 tokens; the largest holds 20"
    ):
        loader(length=20)


def test_a_short_last_shard_is_skipped_and_the_epoch_goes_on_in_the_next_order():
    """datagen's last shard holds the leftover tokens; a step that does not fit in it reads the next
    epoch's first shard instead of failing at the end of the epoch."""
    paths, arrays = fake_shards(3, 100)
    arrays[paths[2]] = arrays[paths[2]][:20]  # less than one step of 2 ranks x 2 x 8 + 1 = 33 tokens
    ranks = [TokenBatches(paths, arrays.__getitem__, 2, 8, rank, 2, seed=7) for rank in (0, 1)]
    starts = [[int(r.next_batch()[0][0, 0]) for r in ranks] for _ in range(7)]
    assert [step[0] // 1000 for step in starts] == [0, 0, 0, 1, 1, 1, ranks[0]._epoch_order(1)[0]]
    assert [r.epoch for r in ranks] == [1, 1], "shard 2 was never read: the epoch ended after shard 1"
    assert all(b - a == 16 for a, b in starts), (
        "each step's windows are the two ranks' halves of one global window"
    )


def test_a_short_shard_is_skipped_alike_for_any_split_of_the_step_between_ranks_and_accumulation():
    paths, arrays = fake_shards(3, 100)
    arrays[paths[0]] = arrays[paths[0]][:40]  # holds 2 x 2 x 8 + 1 = 33 tokens, not 2 x 2 x 2 x 8 + 1
    one_rank = TokenBatches(paths, arrays.__getitem__, 2, 8, 0, 1, grad_accum_steps=4)
    two_ranks = [TokenBatches(paths, arrays.__getitem__, 2, 8, r, 2, grad_accum_steps=2) for r in (0, 1)]
    alone = torch.cat([one_rank.next_batch()[0] for _ in range(4)])
    together = torch.cat([torch.cat([r.next_batch()[0] for r in two_ranks]) for _ in range(2)])
    assert torch.equal(alone, together) and int(alone[0, 0]) == 1000, "both skipped shard 0"


def test_a_validation_split_too_small_for_one_eval_batch_names_the_sizes_and_the_fixes():
    paths, arrays = fake_shards(1, 16)
    with pytest.raises(InputError, match=r"2 x 8 \+ 1 = 17 tokens; the largest holds 16.*eval_every=0"):
        eval_batches(paths, arrays.__getitem__, 2, 8, count=4)


def test_eval_batches_are_the_same_every_time_and_do_not_wrap():
    paths, arrays = fake_shards(1, 100)
    first = eval_batches(paths, arrays.__getitem__, 2, 8, count=50)
    again = eval_batches(paths, arrays.__getitem__, 2, 8, count=50)
    assert len(first) == 6  # (100 - 1) // 16 windows, then it would wrap
    assert all(torch.equal(a[0], b[0]) for a, b in zip(first, again, strict=True))
