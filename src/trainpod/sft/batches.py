"""SFT training batches: shuffled per epoch, optionally packed, with an O(1) position to checkpoint.

Each epoch's order is a permutation drawn from (seed, epoch); packing then fills rows of max_len
first-fit in that order. The rows of an epoch (its "plan") are a pure function of (seed, epoch, the
sample lengths), so the data position is (epoch, step): restoring it recomputes the plan and jumps
there, no batch is replayed. Every optimizer-level step takes world_size * micro_batch_size rows;
rank r takes its own micro_batch_size of them. The last rows of an epoch that do not fill a global
batch are left out, so every rank makes the same number of steps.

Labels are not shifted: transformers' causal LM loss shifts them itself. Unpacked batches carry an
`attention_mask` (right padding). Packed batches are one row (1, tokens) of the micro batch's
samples with `position_ids` restarting at 0 for each sample and no attention_mask, like
transformers' DataCollatorWithFlattening: transformers 5.x then builds a block-diagonal causal
mask under SDPA/eager (masking_utils.find_packed_sequence_indices) and flash-attention-2 runs
varlen on the same position_ids, so no token attends across a sample boundary. The model MUST be
called with use_cache=False (or config.use_cache=False): with a cache, masking_utils skips the
packed-sequence detection and SDPA/eager attend across samples. A sample's first label is always
-100 (set when it was stored), so the previous sample's last token is never trained to predict it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np
import torch

from trainpod.errors import InputError
from trainpod.sft.dataset import IGNORE_INDEX

log = logging.getLogger(__name__)

LEFT_OUT_WARNING_SHARE = 0.01  # rows an epoch leaves out (not a whole step) worth a warning
OPEN_ROWS = 32  # packing keeps this many partly filled rows open: >95% fill on mixed lengths, O(n) time


def pack_first_fit(order: np.ndarray, lengths: np.ndarray, max_len: int) -> list[list[int]]:
    """Rows of sample indices, each summing to at most max_len, filled first-fit in `order`."""
    rows: list[list[int]] = []
    open_rows: list[tuple[list[int], int]] = []  # (row, room left)
    for index in order.tolist():
        length = int(lengths[index])
        for slot, (row, room) in enumerate(open_rows):
            if length <= room:
                row.append(index)
                open_rows[slot] = (row, room - length)
                break
        else:
            open_rows.append(([index], max_len - length))
            if len(open_rows) > OPEN_ROWS:
                rows.append(open_rows.pop(0)[0])
    rows.extend(row for row, _ in open_rows)
    return rows


def _pad(rows: list[np.ndarray], value: int, width: int) -> torch.Tensor:
    out = np.full((len(rows), width), value, dtype=np.int64)
    for i, row in enumerate(rows):
        out[i, : len(row)] = row
    return torch.from_numpy(out)


def unpacked_batch(
    examples: Sequence, indices: Sequence[int], max_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """Right-padded to the batch's longest sample, with an attention_mask."""
    ids = [examples[i].input_ids[:max_len] for i in indices]
    labels = [examples[i].labels[:max_len] for i in indices]
    width = max(len(row) for row in ids)
    return {
        "input_ids": _pad(ids, pad_id, width),
        "labels": _pad(labels, IGNORE_INDEX, width),
        "attention_mask": _pad([np.ones(len(row), np.int64) for row in ids], 0, width),
    }


def packed_batch(examples: Sequence, rows: Sequence[Sequence[int]], max_len: int) -> dict[str, torch.Tensor]:
    """The rows' samples flattened into one row of shape (1, tokens), position_ids restarting at 0.

    One row because flash-attention-2 in transformers reads packed position_ids only when the
    batch size is 1 (modeling_flash_attention_utils._is_packed_sequence); SDPA and eager find the
    boundaries in any shape. No padding is needed.
    """
    samples = [examples[i] for row in rows for i in row]
    ids = np.concatenate([s.input_ids[:max_len] for s in samples])
    labels = np.concatenate([s.labels[:max_len] for s in samples])
    positions = np.concatenate([np.arange(min(len(s.input_ids), max_len)) for s in samples])
    return {
        "input_ids": torch.from_numpy(ids.astype(np.int64))[None],
        "labels": torch.from_numpy(labels.astype(np.int64))[None],
        "position_ids": torch.from_numpy(positions.astype(np.int64))[None],
    }


def packed_rows_batch(
    examples: Sequence, rows: Sequence[Sequence[int]], max_len: int, pad_id: int
) -> dict[str, torch.Tensor]:
    """One row per packed row, shape (rows, longest row), position_ids restarting at 0 per sample.

    For SDPA and eager attention, which find the sample boundaries in any shape: the attention
    cost is rows x width^2 instead of (rows x width)^2 for the single flattened row. The padding
    at a row's end restarts its positions at 0 too, so it is a segment of its own that no sample
    attends to; its labels are ignored.
    """
    flat = [packed_batch(examples, [row], max_len) for row in rows]
    width = max(b["input_ids"].shape[1] for b in flat)
    out = {"input_ids": [], "labels": [], "position_ids": []}
    for b in flat:
        pad = width - b["input_ids"].shape[1]
        out["input_ids"].append(torch.cat([b["input_ids"][0], torch.full((pad,), pad_id)]))
        out["labels"].append(torch.cat([b["labels"][0], torch.full((pad,), IGNORE_INDEX)]))
        out["position_ids"].append(torch.cat([b["position_ids"][0], torch.arange(pad)]))
    return {key: torch.stack(values) for key, values in out.items()}


class SftBatches:
    unit = "samples"  # what one planned row holds, as the log names it
    label = "SFT batches"

    def __init__(
        self,
        examples: Sequence,
        micro_batch_size: int,
        max_len: int,
        packing: bool,
        seed: int,
        rank: int,
        world_size: int,
        pad_id: int,
        flatten_packed: bool = True,
        pin_memory: bool = False,
        grad_accum_steps: int = 1,
    ):
        """`flatten_packed`: packed micro batches as one (1, tokens) row, which flash-attention-2
        needs; False gives one row per packed row (packed_rows_batch), far cheaper under SDPA/eager.
        `pin_memory`: batches in page-locked memory, for non-blocking copies to a GPU
        (train.batches.to_device); CUDA only.

        An epoch holds whole optimizer steps (ranks x `grad_accum_steps` micro batches each), and a step
        takes its micro batches' rows in a row: so a step's rows depend only on ranks x accumulation,
        and a run resumes on another GPU count with the accumulation rescaled (train/batches.py)."""
        self.flatten_packed = flatten_packed
        self.pin_memory = pin_memory
        self.examples = examples
        self.micro_batch_size = micro_batch_size
        self.max_len = max_len
        self.packing = packing
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        self.pad_id = pad_id
        self.grad_accum_steps = grad_accum_steps
        self.lengths = np.minimum(self._lengths(examples), max_len)
        self.last_trained_tokens = 0  # label != -100 in the latest micro batch of this rank
        self.last_real_tokens = 0  # non-padding tokens in the latest micro batch of this rank
        self._epoch = 0
        self._step = 0
        self._extra_rows_reported = False
        self._rows = self._plan(0)
        self._planned_rows = len(self._rows)  # the first epoch's: every epoch takes this many steps
        if self.steps_per_epoch == 0:
            raise InputError(
                f"{len(examples)} training {self.unit} make {len(self._rows)} rows, fewer than one optimizer step of "
                f"{world_size} rank(s) x {grad_accum_steps} accumulation x {micro_batch_size}; lower the micro "
                "batch size or train.grad_accum_steps, turn packing off, or add data"
            )
        self._report_rows_left_out()
        log.info(
            "%s: %d %s, %d steps per epoch, %s, %.1f%% of the batch tokens are real tokens",
            self.label,
            len(examples),
            self.unit,
            self.steps_per_epoch,
            "packed" if packing else "padded",
            100 * self.packing_efficiency,
        )

    def _report_rows_left_out(self) -> None:
        """Rows that do not fill a whole step are left out of every epoch: a warning once they are 1% or more
        (a small dataset under a large batch trains on a share of its samples per epoch, not all of them)."""
        step_rows = self._global_rows * self.grad_accum_steps
        left_out = self._planned_rows - self.steps_per_epoch * self._global_rows
        if not left_out or self.rank:
            return
        share = left_out / self._planned_rows
        (log.warning if share >= LEFT_OUT_WARNING_SHARE else log.info)(
            "%d of the %d %s of an epoch (%.1f%%) do not fill a whole optimizer step of %d (%d rank(s) x %d "
            "accumulation x %d) and are left out, another random set each epoch; lower train.grad_accum_steps "
            "or train.micro_batch_size, or add data, to train on more of them",
            left_out,
            self._planned_rows,
            "packed rows" if self.packing else self.unit,
            100 * share,
            step_rows,
            self.world_size,
            self.grad_accum_steps,
            self.micro_batch_size,
        )

    def _report_extra_rows(self, epoch: int, rows: int) -> None:
        """Another order may pack into more rows than the first epoch's, whose count sets every epoch's steps:
        the rows past them are left out of that epoch on top of the ones the start reported. Said once a run,
        with the count, as it is a few rows and another set each epoch."""
        if self._extra_rows_reported or self.rank:
            return
        self._extra_rows_reported = True
        log.info(
            "epoch %d packs into %d rows, %d more than the first epoch's %d, which set the steps of every epoch: "
            "they are left out of it (as later epochs' extra rows are, another set each; said once)",
            epoch + 1,
            rows,
            rows - self._planned_rows,
            self._planned_rows,
        )

    @staticmethod
    def _lengths(examples: Sequence) -> np.ndarray:
        if hasattr(examples, "lengths"):
            return np.asarray(examples.lengths)
        return np.array([len(e.input_ids) for e in examples], dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        """Micro batches per rank and epoch: whole optimizer steps only."""
        step_rows = self._global_rows * self.grad_accum_steps
        return self._planned_rows // step_rows * self.grad_accum_steps

    @property
    def _global_rows(self) -> int:
        return self.world_size * self.micro_batch_size

    def _plan(self, epoch: int) -> list[list[int]]:
        """Epoch `epoch`'s rows: its shuffled samples, packed; from the second epoch on, as many as the
        first epoch's (`_planned_rows`, set right after planning epoch 0)."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.lengths))
        if not self.packing:
            return [[int(i)] for i in order]
        rows = pack_first_fit(order, self.lengths, self.max_len)
        if epoch == 0:
            return rows
        if len(rows) > self._planned_rows:
            self._report_extra_rows(epoch, len(rows))
        # Every epoch takes the first epoch's steps, but another order may pack into fewer rows: split
        # rows (their last sample into a row of its own) until it has as many. There are enough samples
        # to split off: the first epoch made that many rows of the same samples.
        missing = self._planned_rows - len(rows)
        extra: list[list[int]] = []
        for row in rows:
            while len(extra) < missing and len(row) > 1:
                extra.append([row.pop()])
        return rows + extra

    @property
    def epoch(self) -> float:
        """Progress in epochs, e.g. 1.25: a quarter into the second pass."""
        return self._epoch + self._step / self.steps_per_epoch

    @property
    def packing_efficiency(self) -> float:
        """Real tokens / the tokens a step may hold, over this epoch's steps.

        Unpacked: a micro batch holds micro_batch_size x its longest sample (the rest is padding).
        Packed: it may hold micro_batch_size x max_len (rows are filled up to max_len, not padded).
        """
        used = self._rows[: self.steps_per_epoch * self._global_rows]
        real = slots = 0
        for start in range(0, len(used), self.micro_batch_size):
            row_lengths = [
                int(self.lengths[row].sum()) for row in used[start : start + self.micro_batch_size]
            ]
            real += sum(row_lengths)
            slots += (self.max_len if self.packing else max(row_lengths)) * len(row_lengths)
        return real / slots

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self._step == self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
            self._rows = self._plan(self._epoch)
        start = self._step * self._global_rows + self.rank * self.micro_batch_size
        rows = self._rows[start : start + self.micro_batch_size]
        self._step += 1
        batch = self.micro_batch(self.examples, rows)
        self.last_trained_tokens = int((batch["labels"] != IGNORE_INDEX).sum())
        self.last_real_tokens = self._real_tokens(rows)
        if self.pin_memory:
            batch = {key: value.pin_memory() for key, value in batch.items()}
        return batch

    def _real_tokens(self, rows: Sequence[Sequence[int]]) -> int:
        return int(sum(self.lengths[row].sum() for row in rows))

    def micro_batch(self, examples: Sequence, rows: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        """`rows` (lists of indices into `examples`) as this run lays out a micro batch: packed into one
        flattened row or one row each, or (unpacked) each row's one sample, padded."""
        if self.packing and self.flatten_packed:
            return packed_batch(examples, rows, self.max_len)
        if self.packing:
            return packed_rows_batch(examples, rows, self.max_len, self.pad_id)
        return unpacked_batch(examples, [row[0] for row in rows], self.max_len, self.pad_id)

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self._epoch,
            "step": self._step,
            "seed": self.seed,
            "world_size": self.world_size,
            "grad_accum_steps": self.grad_accum_steps,
            "micro_batch_size": self.micro_batch_size,
            "max_len": self.max_len,
            "packing": int(self.packing),
            "num_examples": len(self.lengths),
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Continue at the saved position (taken between optimizer steps). Written by another rank count,
        it fits when this run's ranks x accumulation take as many micro batches per step."""
        mine = self.state_dict()
        layout = ("seed", "micro_batch_size", "max_len", "packing", "num_examples")
        differ = [f"{key} {state[key]} -> {mine[key]}" for key in layout if state[key] != mine[key]]
        if differ:
            raise InputError(
                f"the checkpoint's data position was taken with other batch settings ({', '.join(differ)}); "
                "resume with the same dataset, seed, batch size, max length and packing, or start a new run name"
            )
        saved_world = int(state["world_size"])
        saved_windows = saved_world * int(state.get("grad_accum_steps", self.grad_accum_steps))
        if saved_windows != self.world_size * self.grad_accum_steps:
            raise InputError(
                f"the checkpoint's steps take {saved_windows} micro batches ({saved_world} rank(s)), this run "
                f"takes {self.world_size * self.grad_accum_steps}; resume on a rank count that divides "
                f"{saved_windows}, or start a new run name"
            )
        rows_done = int(state["step"]) * saved_world * self.micro_batch_size  # of this epoch, over all ranks
        self._epoch, self._step = int(state["epoch"]), rows_done // self._global_rows
        self._rows = self._plan(self._epoch)


class PreferenceBatches(SftBatches):
    """DPO batches (train/preference.py): micro batches of pairs, each laid out as its chosen samples then their
    rejected ones, padded to the longest; never packed. `pairs` is a PreferencePairs view (sft/dataset.py): the
    shuffle, the epochs and the checkpointed position count pairs, the plan's lengths are each pair's longer."""

    unit = "pairs"
    label = "DPO batches"

    def __init__(self, pairs: Sequence, micro_batch_size: int, max_len: int, seed: int, rank: int, world_size: int,
                 pad_id: int, pin_memory: bool = False, grad_accum_steps: int = 1):  # fmt: skip
        self.flat = pairs.flat
        self.sample_lengths = np.minimum(self.flat.lengths, max_len)  # chosen 2k, rejected 2k+1, as batched
        super().__init__(
            pairs,
            micro_batch_size,
            max_len,
            False,
            seed,
            rank,
            world_size,
            pad_id,
            pin_memory=pin_memory,
            grad_accum_steps=grad_accum_steps,
        )

    def micro_batch(self, examples: Sequence, rows: Sequence[Sequence[int]]) -> dict[str, torch.Tensor]:
        return pair_batch(self.flat, [row[0] for row in rows], self.max_len, self.pad_id)

    def _real_tokens(self, rows: Sequence[Sequence[int]]) -> int:
        return int(self.sample_lengths[_pair_rows(rows)].sum())

    @property
    def packing_efficiency(self) -> float:
        """Real tokens / the tokens this epoch's micro batches hold: each is 2P rows, chosen and rejected, padded
        to the longest. (SftBatches' count took a pair for one row of its longer sample: a pair of 600 and 150
        tokens read as 100% real where its batch of two rows is 62.5%.)"""
        used = self._rows[: self.steps_per_epoch * self._global_rows]
        real = slots = 0
        for start in range(0, len(used), self.micro_batch_size):
            lengths = self.sample_lengths[_pair_rows(used[start : start + self.micro_batch_size])]
            real += int(lengths.sum())
            slots += int(lengths.max()) * len(lengths)
        return real / slots


def _pair_rows(rows: Sequence[Sequence[int]]) -> list[int]:
    """The stored samples of planned rows of pairs (a row: [pair]): each pair's chosen 2k and rejected 2k+1."""
    return [2 * row[0] + side for row in rows for side in (0, 1)]


def pair_batch(flat: Sequence, pairs: Sequence[int], max_len: int, pad_id: int) -> dict[str, torch.Tensor]:
    """Pairs `pairs` of the stored samples `flat` (chosen 2k, rejected 2k+1): the chosen rows, then the rejected."""
    rows = [2 * k for k in pairs] + [2 * k + 1 for k in pairs]
    return unpacked_batch(flat, rows, max_len, pad_id)


def preference_eval_batches(
    pairs: Sequence, micro_batch_size: int, max_len: int, pad_id: int, limit: int | None
) -> list[dict[str, torch.Tensor]]:
    """The validation pairs in stored order, at most `limit` batches, each with `pair_index`."""
    out = []
    for indices in in_stored_order(len(pairs), micro_batch_size, limit):
        batch = pair_batch(pairs.flat, indices, max_len, pad_id)
        batch["pair_index"] = torch.tensor(indices, dtype=torch.long)
        out.append(batch)
    return out


def in_stored_order(count: int, micro_batch_size: int, limit: int | None) -> list[list[int]]:
    """The indices of `count` items in stored order, micro_batch_size a batch, at most `limit` batches (None: all)."""
    starts = range(0, count, micro_batch_size)
    if limit is not None:
        starts = starts[:limit]
    return [list(range(start, min(start + micro_batch_size, count))) for start in starts]


def eval_batches(
    examples: Sequence, micro_batch_size: int, max_len: int, pad_id: int, limit: int | None
) -> list[dict[str, torch.Tensor]]:
    """The validation samples in stored order, unpacked, at most `limit` batches (None: all).

    Each batch also has `sample_index` (the sample's index in `examples`), for per-sample losses.
    """
    out = []
    for indices in in_stored_order(len(examples), micro_batch_size, limit):
        batch = unpacked_batch(examples, indices, max_len, pad_id)
        batch["sample_index"] = torch.tensor(indices, dtype=torch.long)
        out.append(batch)
    return out
