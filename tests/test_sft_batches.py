"""SFT batches: packing gives the same loss as padding and never attends across samples; exact resume.

The model checks run a tiny LlamaForCausalLM built here (fp32, CPU), through transformers' own
mask construction: the packed batches carry only position_ids, as the trainer will pass them.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from trainpod.config.loader import validate_tree
from trainpod.config.sft import SftDataConfig
from trainpod.errors import InputError
from trainpod.sft import IGNORE_INDEX, SftBatches, SftExample, eval_batches, load_sft, prepare_sft

from sft_support import make_tiny_tokenizer, write_alpaca_jsonl

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    tokenizer_dir = make_tiny_tokenizer(root / "tok")
    write_alpaca_jsonl(root / "vol" / "a.jsonl", 40, seed=3)
    config = validate_tree(
        SftDataConfig, {"datasets": [{"path": "a.jsonl"}], "template": "chatml", "val_ratio": 0.2}
    )
    return load_sft(prepare_sft(config, tokenizer_dir, root / "out", root / "vol"))


def tiny_llama(vocab_size: int, attn: str = "sdpa") -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    config._attn_implementation = attn
    return LlamaForCausalLM(config).eval()


def synthetic(count: int, seed: int = 0) -> list[SftExample]:
    """Examples whose first token is 100 + their index, so a batch row says which sample it holds."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        ids = rng.integers(0, 90, size=int(rng.integers(4, 14)))
        ids[0] = 100 + i
        labels = np.where(np.arange(len(ids)) >= len(ids) // 2, ids, IGNORE_INDEX)
        out.append(SftExample(ids.astype(np.int64), labels.astype(np.int64), i))
    return out


@pytest.mark.parametrize(("micro", "flatten"), [(1, True), (3, False)], ids=["flattened", "rows"])
def test_packed_loss_equals_unpacked_loss_on_the_same_samples(data, micro, flatten):
    model = tiny_llama(400)
    packed = SftBatches(
        data.train, micro, 64, True, seed=1, rank=0, world_size=1, pad_id=data.pad_id, flatten_packed=flatten
    )
    unpacked = SftBatches(
        data.train, len(data.train), 64, False, seed=1, rank=0, world_size=1, pad_id=data.pad_id
    )
    assert packed.steps_per_epoch >= 2, "the samples must spread over several packed rows with padding"
    with torch.no_grad():
        total = trained = 0.0
        for _ in range(packed.steps_per_epoch):
            batch = packed.next_batch()
            assert set(batch) == {"input_ids", "labels", "position_ids"}
            total += model(**batch, use_cache=False).loss.item() * packed.last_trained_tokens
            trained += packed.last_trained_tokens
        batch = unpacked.next_batch()
        assert set(batch) == {"input_ids", "labels", "attention_mask"}
        reference = model(**batch, use_cache=False).loss.item()
    assert trained == unpacked.last_trained_tokens
    assert abs(total / trained - reference) < 1e-5


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("flatten", [True, False], ids=["flattened", "rows"])
def test_no_sample_attends_across_its_boundary_in_a_packed_row(attn, flatten):
    examples = synthetic(3)
    model = tiny_llama(128, attn)
    width = sum(len(e.input_ids) for e in examples)
    batches = SftBatches(
        examples, 1, width, True, seed=0, rank=0, world_size=1, pad_id=0, flatten_packed=flatten
    )
    batch = batches.next_batch()
    order = [
        int(t) - 100 for t, p in zip(batch["input_ids"][0], batch["position_ids"][0], strict=True) if p == 0
    ]
    spans, start = {}, 0
    for i in order:
        spans[i] = slice(start, start + len(examples[i].input_ids))
        start = spans[i].stop
    with torch.no_grad():
        logits = model(**batch, use_cache=False).logits[0]
        changed = dict(batch, input_ids=batch["input_ids"].clone())
        middle = order[1]
        changed["input_ids"][0, spans[middle]] = (changed["input_ids"][0, spans[middle]] + 7) % 90
        logits_changed = model(**changed, use_cache=False).logits[0]
        for i in order:
            alone = model(input_ids=torch.from_numpy(examples[i].input_ids)[None]).logits[0]
            assert torch.allclose(logits[spans[i]], alone, atol=1e-5), f"sample {i} differs from itself alone"
    for i in order:
        moved = not torch.allclose(logits[spans[i]], logits_changed[spans[i]], atol=1e-6)
        assert moved == (i == middle), (
            f"sample {i}: changing sample {middle} {'moved' if moved else 'kept'} it"
        )


def test_an_opt_model_reads_a_packed_row_across_its_samples_which_finetune_refuses():
    """The premise of PACKING_MIXES_SAMPLES (finetune refuses packing for these types, exit 2): OPT takes
    positions from the attention mask, not from the restarted position_ids, so its packed samples differ
    from themselves alone. Should transformers keep them apart one day, this fails: take opt off the list."""
    from transformers import OPTConfig, OPTForCausalLM

    from trainpod.train.base_model import PACKING_MIXES_SAMPLES

    torch.manual_seed(0)
    config = OPTConfig(
        vocab_size=128, hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=32,
    )  # fmt: skip
    model = OPTForCausalLM(config).eval()
    examples = synthetic(2)
    batch = SftBatches(examples, 1, 64, True, seed=0, rank=0, world_size=1, pad_id=0).next_batch()
    second = next(i for i, p in enumerate(batch["position_ids"][0].tolist()) if i and p == 0)
    which = int(batch["input_ids"][0, second]) - 100
    with torch.no_grad():
        packed = model(**batch, use_cache=False).logits[0, second:]
        alone = model(input_ids=torch.from_numpy(examples[which].input_ids)[None]).logits[0]
    assert not torch.allclose(packed, alone, atol=1e-4), "OPT kept packed samples apart"
    assert "opt" in PACKING_MIXES_SAMPLES


def test_packed_rows_are_padded_as_segments_of_their_own_with_ignored_labels():
    examples = synthetic(12)
    batches = SftBatches(examples, 3, 40, True, seed=0, rank=0, world_size=1, pad_id=0, flatten_packed=False)
    batch = batches.next_batch()
    rows = batches._rows[:3]
    assert batch["input_ids"].shape[0] == 3
    for r, row in enumerate(rows):
        used = sum(len(examples[i].input_ids) for i in row)
        assert (batch["labels"][r, used:] == IGNORE_INDEX).all()
        if used < batch["input_ids"].shape[1]:
            assert batch["position_ids"][r, used].item() == 0, "padding starts a segment of its own"
        assert (batch["position_ids"][r] == 0).sum().item() == len(row) + (used < batch["input_ids"].shape[1])


def test_packed_positions_restart_and_first_label_of_each_sample_is_ignored():
    examples = synthetic(5)
    batch = SftBatches(examples, 1, 64, True, seed=0, rank=0, world_size=1, pad_id=0).next_batch()
    starts = (batch["position_ids"][0] == 0).nonzero().flatten().tolist()
    assert len(starts) == len(examples) and batch["input_ids"].shape == (
        1,
        sum(len(e.input_ids) for e in examples),
    )
    assert [batch["labels"][0, s].item() for s in starts] == [IGNORE_INDEX] * len(examples)


def test_unpacked_batches_are_right_padded_with_ignored_labels(data):
    batch = SftBatches(
        data.train, 4, 64, False, seed=0, rank=0, world_size=1, pad_id=data.pad_id
    ).next_batch()
    pad = batch["attention_mask"] == 0
    assert (batch["input_ids"][pad] == data.pad_id).all() and (batch["labels"][pad] == IGNORE_INDEX).all()
    trained = batch["labels"] != IGNORE_INDEX
    assert torch.equal(batch["labels"][trained], batch["input_ids"][trained])


@pytest.mark.parametrize("packing", [False, True])
def test_resume_from_state_dict_continues_the_uninterrupted_order(packing):
    examples = synthetic(23)

    def batches() -> SftBatches:
        return SftBatches(examples, 2, 16, packing, seed=5, rank=0, world_size=1, pad_id=0)

    straight = batches()
    expected = [straight.next_batch() for _ in range(3 * straight.steps_per_epoch + 1)]
    first = batches()
    for _ in range(straight.steps_per_epoch + 2):
        first.next_batch()
    state = first.state_dict()
    assert all(isinstance(v, int) for v in state.values())
    resumed = batches()
    resumed.load_state_dict(state)
    assert resumed.epoch == first.epoch
    for want in expected[straight.steps_per_epoch + 2 :]:
        got = resumed.next_batch()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_each_epoch_is_a_new_permutation_split_between_ranks():
    examples = synthetic(20)
    ranks = [SftBatches(examples, 2, 16, False, seed=9, rank=r, world_size=2, pad_id=0) for r in range(2)]
    steps = ranks[0].steps_per_epoch
    assert steps == 5
    epochs = []
    for _ in range(2):
        seen = {r: [] for r in range(2)}
        for _ in range(steps):
            for r, batches in enumerate(ranks):
                seen[r] += (batches.next_batch()["input_ids"][:, 0] - 100).tolist()
        assert not set(seen[0]) & set(seen[1])
        assert sorted(seen[0] + seen[1]) == list(range(20))
        epochs.append(seen[0] + seen[1])
    assert epochs[0] != epochs[1]
    assert ranks[0].epoch == 2.0
    ranks[0].next_batch()
    assert ranks[0].epoch == pytest.approx(2.2)


def test_packing_efficiency_is_reported_and_matches_the_batches():
    """Real tokens per token a step may hold: padded tensor size unpacked, micro_batch x max_len packed."""
    examples = synthetic(60)
    efficiency = {}
    for packing in (False, True):
        batches = SftBatches(examples, 2, 32, packing, seed=0, rank=0, world_size=1, pad_id=0)
        real = slots = 0
        for _ in range(batches.steps_per_epoch):
            batch = batches.next_batch()
            real += batches.last_real_tokens
            slots += 2 * 32 if packing else batch["input_ids"].numel()
            if packing:
                assert batch["input_ids"].shape == (1, batches.last_real_tokens)
        efficiency[packing] = batches.packing_efficiency
        assert efficiency[packing] == pytest.approx(real / slots)
    assert efficiency[True] > 0.9 > efficiency[False]


def test_state_of_other_settings_is_refused():
    state = SftBatches(synthetic(10), 2, 16, False, seed=0, rank=0, world_size=1, pad_id=0).state_dict()
    other = SftBatches(synthetic(10), 1, 16, False, seed=0, rank=0, world_size=1, pad_id=0)
    with pytest.raises(InputError, match="micro_batch_size 2 -> 1"):
        other.load_state_dict(state)


def test_too_few_samples_for_one_optimizer_step_is_an_input_error():
    with pytest.raises(
        InputError, match=r"3 training samples make 3 rows, fewer than one optimizer step of 2 rank\(s\) x 1"
    ):
        SftBatches(synthetic(3), 2, 16, False, seed=0, rank=0, world_size=2, pad_id=0)


def test_samples_left_out_of_every_epoch_for_want_of_a_whole_step_are_a_warning(caplog):
    """23 samples in steps of 4: 3 (13%) are left out of each epoch, which the user learnt nowhere."""
    with caplog.at_level(logging.INFO, logger="trainpod.sft.batches"):
        sft_batches(0, 1, 2)
        sft_batches(1, 2, 1)  # rank 1 leaves the report to rank 0
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned
    assert "3 of the 23 samples of an epoch (13.0%) do not fill a whole optimizer step of 4" in warned[0]
    assert "train.grad_accum_steps" in warned[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="trainpod.sft.batches"):
        SftBatches(synthetic(24), 2, 16, False, seed=0, rank=0, world_size=1, pad_id=0, grad_accum_steps=2)
    assert not [r for r in caplog.records if r.levelno == logging.WARNING]


def first_tokens(batches: SftBatches) -> torch.Tensor:
    """Which samples the next micro batch holds (a row's first token is 100 + its sample's index)."""
    return batches.next_batch()["input_ids"][:, 0]


def sft_batches(rank: int, world: int, accum: int) -> SftBatches:
    return SftBatches(
        synthetic(23), 2, 16, False, seed=0, rank=rank, world_size=world, pad_id=0, grad_accum_steps=accum
    )


def test_a_step_takes_the_same_rows_on_two_ranks_as_on_one_rank_accumulating_two_across_epochs():
    """23 samples hold 5 whole steps of 4 rows: both layouts end each epoch after 5 steps, not mid-step."""
    two_ranks, one_rank = [sft_batches(r, 2, 1) for r in (0, 1)], sft_batches(0, 1, 2)
    assert two_ranks[0].steps_per_epoch // 1 == one_rank.steps_per_epoch // 2 == 5
    for _ in range(12):  # over two epoch ends
        spread = torch.cat([first_tokens(ranks) for ranks in two_ranks])
        accumulated = torch.cat([first_tokens(one_rank) for _ in range(2)])
        assert torch.equal(spread, accumulated)


def test_a_position_taken_on_two_ranks_continues_on_one_rank_at_the_same_rows():
    two = [sft_batches(r, 2, 1) for r in (0, 1)]
    for _ in range(3):
        for ranks in two:
            ranks.next_batch()
    one = sft_batches(0, 1, 2)
    one.load_state_dict(two[0].state_dict())
    assert torch.equal(
        torch.cat([first_tokens(one) for _ in range(2)]), torch.cat([first_tokens(ranks) for ranks in two])
    )
    with pytest.raises(InputError, match="steps take 2 micro batches"):
        sft_batches(0, 1, 3).load_state_dict(two[0].state_dict())


def test_eval_batches_are_deterministic_with_sample_indices(data):
    batches = eval_batches(data.val, 3, 64, data.pad_id, limit=None)
    indices = torch.cat([b["sample_index"] for b in batches]).tolist()
    assert indices == list(range(len(data.val)))
    again = eval_batches(data.val, 3, 64, data.pad_id, limit=2)
    assert len(again) == 2 and all(
        torch.equal(a[k], b[k]) for a, b in zip(again, batches[:2], strict=True) for k in a
    )
    for batch in batches:
        for row, index in enumerate(batch["sample_index"].tolist()):
            n = len(data.val[index].input_ids)
            assert batch["input_ids"][row, :n].tolist() == data.val[index].input_ids.tolist()
            assert batch["attention_mask"][row].sum() == n


def test_samples_longer_than_max_len_are_cut_in_batches(tmp_path: Path):
    examples = synthetic(4)
    batch = SftBatches(examples, 4, 5, False, seed=0, rank=0, world_size=1, pad_id=0).next_batch()
    assert batch["input_ids"].shape == (4, 5)


def test_every_epoch_fills_its_steps_when_another_order_packs_into_fewer_rows():
    """The steps of an epoch are the first epoch's; a later order that packs tighter must not run out of rows."""
    lengths = np.random.default_rng(4).integers(2, 30, size=23)  # 16 rows in epoch 0, 15 in epoch 1 unsplit
    examples = [
        SftExample(
            np.arange(1, n + 1, dtype=np.int64), np.r_[IGNORE_INDEX, np.arange(2, n + 1)].astype(np.int64), i
        )
        for i, n in enumerate(lengths)
    ]
    batches = SftBatches(examples, 1, 32, True, seed=1, rank=0, world_size=1, pad_id=0, flatten_packed=False)
    seen = []
    for _ in range(3 * batches.steps_per_epoch):
        batch = batches.next_batch()
        assert batch["input_ids"].shape[0] == 1
        seen.append(int((batch["position_ids"] == 0).sum()))
    assert sum(seen[batches.steps_per_epoch : 2 * batches.steps_per_epoch]) == len(examples)


def test_a_later_epoch_packing_into_more_rows_says_once_how_many_it_leaves_out(caplog):
    """Every epoch takes the first epoch's steps; another order that packs into more rows (here the second
    epoch's: 6 rows of the 12 samples, the first's 5) left the extra row out without a word."""
    batches = SftBatches(synthetic(12), 1, 20, True, seed=21, rank=0, world_size=1, pad_id=0)
    assert batches.steps_per_epoch == 5
    with caplog.at_level(logging.INFO, logger="trainpod.sft.batches"):
        for _ in range(4 * batches.steps_per_epoch):
            batches.next_batch()
    said = [r.getMessage() for r in caplog.records if "more than the first epoch's" in r.getMessage()]
    assert said == [
        "epoch 2 packs into 6 rows, 1 more than the first epoch's 5, which set the steps of every "
        "epoch: they are left out of it (as later epochs' extra rows are, another set each; said once)"
    ]
