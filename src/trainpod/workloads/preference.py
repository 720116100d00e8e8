"""Finetune's preference objectives (`objective: dpo`, `orpo`, `simpo`): trained on preference pairs by their
loss (train/preference.py).

    TRAINPOD_CONFIG=configs/finetune/tiny-dpo.yaml TRAINPOD_VOLUME=./demo-volume trainpod run finetune

Not a workload of its own: `trainpod run finetune` picks this trainer for a config with a preference objective
(workloads/finetune.py, run), and everything else is the SFT finetune's: base model, adapters, checkpoints of
the adapter, the stop protocol, resume, export. What differs is the data (pairs of a chosen and a rejected
answer, sft/dataset.py PreferencePairs), the batches (chosen rows then rejected rows), the step's loss (the mean
loss over the step's pairs on every rank) and the eval: eval_loss is the validation pairs' mean loss,
with the reward accuracy and margin beside it, and the worst pairs written to eval/step-<N>.worst.jsonl.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from trainpod.config.finetune import OBJECTIVE_NAMES
from trainpod.errors import InputError
from trainpod.sft.batches import PreferenceBatches, preference_eval_batches
from trainpod.sft.dataset import IGNORE_INDEX, PreferencePairs, is_preference
from trainpod.train import distributed as D
from trainpod.train.batches import to_device
from trainpod.train.preference import PreferenceLoss
from trainpod.train.sharding import local_value
from trainpod.train.trainer import StepResult
from trainpod.workloads.finetune import Finetuner

log = logging.getLogger(__name__)

PAIR_INPUTS = ("input_ids", "attention_mask", "labels")
# Logged beside the loss: each a mean over the window's (or the eval's) pairs. Accuracy: the share of pairs whose
# chosen answer has the higher implicit reward; margin: chosen reward - rejected reward (TRL's rewards/*).
REWARD_METRICS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin")


def reward_sums(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Sums over pairs of what REWARD_METRICS average, in their order, and the pair count."""
    return torch.stack(
        [
            chosen.sum(),
            rejected.sum(),
            (chosen > rejected).float().sum(),
            (chosen - rejected).sum(),
            torch.tensor(float(chosen.numel()), device=chosen.device),
        ]
    ).float()


def reward_means(sums: torch.Tensor, prefix: str = "") -> dict[str, float]:
    count = max(float(sums[-1]), 1.0)
    return {
        f"{prefix}{name}": float(value) / count
        for name, value in zip(REWARD_METRICS, sums[:-1].tolist(), strict=True)
    }


def least_preferred(
    per_pair: list[tuple[float, int, float, float]], count: int
) -> list[tuple[float, int, float, float]]:
    """The `count` pairs (loss, pair index, chosen reward, rejected reward) the model prefers least: the lowest
    reward margin first, then by index. Not the highest loss: ORPO's holds the chosen answer's SFT loss, so its
    highest were the pairs with the unlikeliest chosen answers, preferred or not, and IPO's grows again past its
    target margin."""
    return sorted(per_pair, key=lambda item: (item[2] - item[3], item[1]))[:count]


class PreferenceFinetuner(Finetuner):
    model_inputs = PAIR_INPUTS

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._window_rewards = torch.zeros(len(REWARD_METRICS) + 1, device=self.dist.device)

    # ------------------------------------------------------------------------------- setup
    def _check_data_kind(self, folder: Path) -> None:
        if not is_preference(self.data.manifest):
            raise InputError(
                f"objective={self.cfg.objective} trains on pairs of a chosen and a rejected answer, and the dataset "
                f"at {folder} holds "
                "SFT samples (made without sft.preference); make it with sft.preference: true and each dataset's "
                "chosen and rejected columns, or set objective: sft"
            )
        self.pairs = PreferencePairs(self.data.train)
        self.val_pairs = PreferencePairs(self.data.val)

    @property
    def split_rows(self) -> tuple[int, str]:
        """A pair: both its samples are in the row's split (sft/prepare.py), so a share of 1/samples holds out
        half a pair."""
        return len(self.pairs), "pair"

    def _parallel(self) -> str:
        """DDP always: the preference loss runs the model whole (PreferenceLoss wraps it after the SFT setup, where
        FSDP would have sharded the SFT loss module instead). train.parallel=fsdp is refused at load; `auto`, which
        picks fsdp for a full finetune of 1B parameters or more on several GPUs, replicates here."""
        return "ddp"

    def _training_batches(self, packing: bool) -> PreferenceBatches:
        t = self.train_cfg
        return PreferenceBatches(
            self.pairs,
            t.micro_batch_size,
            self.max_len,
            t.seed,
            self.dist.rank,
            self.dist.world_size,
            self.data.pad_id,
            pin_memory=self.dist.device.type == "cuda",
            grad_accum_steps=t.grad_accum_steps,
        )

    def _setup_model(self) -> None:
        super()._setup_model()
        objective = self.cfg.objective
        settings = getattr(self.cfg, objective)  # its section: dpo, orpo or simpo
        # The model with the preference loss, where DDP wraps it (wrap_for_training) and the step calls it.
        self.loss_module = PreferenceLoss(
            self.model,
            settings.beta,
            getattr(settings, "loss", "sigmoid"),
            getattr(settings, "label_smoothing", 0.0),
            self.chunked_loss,
            objective=objective,
            gamma=getattr(settings, "gamma", 0.0),
        )
        log.info(
            "%s: %d training pairs, %s; %s",
            OBJECTIVE_NAMES[objective],
            len(self.pairs),
            ", ".join(f"{key} {value}" for key, value in settings.model_dump().items()),
            "the reference model is the base with the adapters off"
            if objective == "dpo"
            else "no reference model",
        )
        if self.loss_module.dropout_turned_off:
            log.info(
                "%s: the base model's dropout is off in %d modules (as TRL's trainers have it), so that the "
                "log-probabilities are the same at every forward; lora.dropout still applies to the adapters",
                OBJECTIVE_NAMES[objective],
                self.loss_module.dropout_turned_off,
            )

    # ---------------------------------------------------------------------------- training
    def train_step(self, model: torch.nn.Module, step: int) -> StepResult:
        t = self.train_cfg
        micro_batches, real_tokens = self._begin_step(step)
        # The loss is the mean over every pair of the step on every rank, as if there were one big batch (the
        # SFT step's mean over trained tokens, per pair): each micro batch's summed loss over that global count,
        # times the rank count, which DDP's gradient averaging divides out again.
        local_pairs = sum(b["input_ids"].shape[0] // 2 for b in micro_batches)
        global_pairs = D.all_reduce_sum(self.dist, float(local_pairs))
        total = torch.zeros((), device=self.dist.device)
        for i, batch in enumerate(micro_batches):
            inputs = {k: to_device(batch[k], self.dist.device) for k in PAIR_INPUTS}
            with self._gradient_sync(model, i == len(micro_batches) - 1), self._autocast():
                losses, chosen, rejected = model(**inputs)
                loss = losses.sum() / max(global_pairs, 1.0)
                (loss * self.dist.world_size).backward()
            total += loss.detach()
            self._window_rewards += reward_sums(chosen, rejected)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable.values(), t.grad_clip or float("inf"))
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        rank_mean = total * global_pairs / max(local_pairs, 1)  # this rank's own mean, for the log
        return StepResult(rank_mean, local_value(grad_norm), real_tokens)

    def _step_metrics(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The log line's metrics and the window's reward means over every rank's pairs."""
        sums = D.all_reduce_sum_tensor(self.dist, self._window_rewards.clone())
        self._window_rewards.zero_()
        return super()._step_metrics(*args, **kwargs) | reward_means(sums)

    # -------------------------------------------------------------------------------- eval
    @property
    def has_eval_data(self) -> bool:
        return len(self.val_pairs) > 0

    @torch.no_grad()
    def evaluate(self, model: torch.nn.Module, step: int) -> float:
        """The validation pairs' mean loss (the objective's); the reward means go to eval_metrics as eval_rewards_*."""
        model.eval()
        t = self.train_cfg
        batches = preference_eval_batches(
            self.val_pairs, t.micro_batch_size, self.max_len, self.data.pad_id, t.eval_batches
        )
        sums = torch.zeros(len(REWARD_METRICS) + 1, device=self.dist.device)
        loss_sum = 0.0
        per_pair: list[tuple[float, int, float, float]] = []
        for batch in self.until_stop(batches[self.dist.rank :: self.dist.world_size]):
            if batch is None:  # this rank's batches ran out first
                continue
            inputs = {k: to_device(batch[k], self.dist.device) for k in PAIR_INPUTS}
            with self._autocast():
                losses, chosen, rejected = self.loss_module(**inputs)
            loss_sum += float(losses.sum())
            sums += reward_sums(chosen, rejected)
            per_pair += list(
                zip(
                    losses.tolist(),
                    batch["pair_index"].tolist(),
                    chosen.tolist(),
                    rejected.tolist(),
                    strict=True,
                )
            )
        sums = D.all_reduce_sum_tensor(self.dist, sums)
        loss_sum = D.all_reduce_sum(self.dist, loss_sum)
        self.eval_metrics |= reward_means(sums, prefix="eval_")
        gathered = D.gather_to_main(self.dist, per_pair)
        if self.dist.is_main and t.worst_samples:
            self._write_worst_pairs(step, [p for rank in gathered for p in rank])
        return loss_sum / max(float(sums[-1]), 1.0)

    def _write_worst_pairs(self, step: int, per_pair: list[tuple[float, int, float, float]]) -> None:
        """The validation pairs the model prefers least (least_preferred): prompt, chosen and rejected decoded."""
        worst = least_preferred(per_pair, self.train_cfg.worst_samples)
        records = []
        for loss, index, chosen_reward, rejected_reward in worst:
            chosen, rejected = self.val_pairs[index]
            trained = chosen.labels != IGNORE_INDEX
            record = {
                "step": step,
                "loss": loss,
                "val_pair": index,
                "source_row": chosen.row_index,
                "reward_chosen": chosen_reward,
                "reward_rejected": rejected_reward,
                "prompt": self.tokenizer.decode(chosen.input_ids[~trained].tolist()),
                "chosen": self.tokenizer.decode(chosen.input_ids[trained].tolist()),
                "rejected": self.tokenizer.decode(
                    rejected.input_ids[rejected.labels != IGNORE_INDEX].tolist()
                ),
            }
            records.append(record)
        self._write_worst(step, records)

    # ------------------------------------------------------------------------------ finish
    def training_summary(self) -> dict[str, Any]:
        summary = super().training_summary()
        objective = self.cfg.objective
        summary["objective"] = objective
        summary[objective] = getattr(self.cfg, objective).model_dump(mode="json")
        summary["data"] |= {"train_pairs": len(self.pairs), "val_pairs": len(self.val_pairs)}
        return summary

    def summary(self) -> dict[str, Any]:
        return super().summary() | {"objective": self.cfg.objective}
