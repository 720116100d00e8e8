"""What a run shows while it trains: log lines, TensorBoard, status.json, metrics.jsonl, loss.png.

`trainpod status RUN` and the supervisor read `status.json`; everything here is written by rank 0
only, atomically where a reader may look at the same time. A log line reads
`step 120/5000 (2.4%) | loss 3.2100 | eval 3.3050 | ... | ETA 3h12m`; loss.png is redrawn at every
eval and when the run ends or stops, with a dashed line at each step a start resumed from
(logs/resumes.json).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainpod import atomic, cost
from trainpod.diskspace import is_disk_full
from trainpod.volume import RunDir

if TYPE_CHECKING:  # torch is imported where it is used: `trainpod status` and estimate read this module fast
    import torch

log = logging.getLogger(__name__)

# Dense bf16 tensor-core peak FLOP/s per GPU, for MFU (NVIDIA's datasheets, without sparsity), matched
# against torch's device name in this order: the first key found in it wins, so a chip's variants come
# before its plain name (an H100 PCIe peaks 24% below the SXM part).
PEAK_BF16_FLOPS = {
    "H200 NVL": 835e12,  # "NVIDIA H200 NVL", a RunPod type: the PCIe part (1,671 with sparsity)
    "H200": 989e12,  # "NVIDIA H200" (SXM); "NVIDIA GH200 480GB" too, the same chip's 989
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,  # SXM5, e.g. "NVIDIA H100 80GB HBM3"
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "A6000": 155e12,
    "4090": 165e12,
    "6000 Ada": 364e12,
    "A4000": 76.7e12,  # "NVIDIA RTX A4000" (153.4 with sparsity): before "A40", which its name contains
    "A40": 150e12,
    "L4": 121e12,
}


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    import torch

    return peak_flops_of(torch.cuda.get_device_name(device))


def peak_flops_of(device_name: str) -> float | None:
    """The dense bf16 peak of the GPU torch calls `device_name`, or None for one not in the table."""
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name), None)


class RunReporter:
    def __init__(
        self, run: RunDir, max_steps: int, resumed_step: int, enabled: bool = True, tracker: Any = None
    ):
        self.run = run
        self.tracker = tracker  # e.g. tracking.WandbTracker: gets every logged metric too
        self.max_steps = max_steps
        self.enabled = enabled
        self.hourly_usd = cost.hourly_usd()
        self.metrics_path = run.logs / "metrics.jsonl"
        self.resumes_path = run.logs / "resumes.json"
        self.last_eval_loss: float | None = None
        self._tb = None
        self._eval_metrics: dict[str, Any] = {}
        self._status = StatusWriter(run.status) if enabled else None
        # The newest metrics logged up to the resumed step: a start that trains no step (killed after the last
        # commit, before DONE) reports them in status.json and DONE, as the start that logged them would have.
        self.resumed_metrics: dict[str, Any] = {}
        if enabled:
            self._truncate_metrics(resumed_step)
            self._record_resume(resumed_step)
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events a previous attempt logged after the checkpoint we resumed from.
            self._tb = SummaryWriter(
                str(run.tensorboard), purge_step=resumed_step + 1 if resumed_step else None
            )

    def _truncate_metrics(self, resumed_step: int) -> None:
        """Drop lines logged after the resumed checkpoint: those steps are trained again."""
        if not self.metrics_path.exists():
            return
        kept = [(line, row) for line, row in self._logged_lines() if row["step"] <= resumed_step]
        atomic.write_text(self.metrics_path, "".join(line + "\n" for line, _ in kept))
        if kept and resumed_step:
            self.resumed_metrics = kept[-1][1]

    def _logged_lines(self) -> list[tuple[str, dict[str, Any]]]:
        """Each line of metrics.jsonl with its metrics, but for one cut short: the file is appended to, and
        an append that filled the volume (ENOSPC) leaves the first part of its line, which must not make
        every later start of the run fail to read the file (the truncation above drops it)."""
        logged = []
        for line in self.metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and "step" in row:
                logged.append((line, row))
        return logged

    def _record_resume(self, resumed_step: int) -> None:
        """Steps this run resumed from, for loss.png; later ones were trained again and are dropped."""
        steps = self.resume_steps()
        kept = [s for s in steps if s <= resumed_step]
        if resumed_step and resumed_step not in kept:
            kept.append(resumed_step)
        if kept != steps:
            atomic.write_json(self.resumes_path, kept)

    def resume_steps(self) -> list[int]:
        try:
            return [int(step) for step in atomic.read_json(self.resumes_path)]
        except (FileNotFoundError, ValueError, TypeError):
            return []

    def log_step(self, metrics: dict[str, Any], into_its_row: bool = False) -> dict[str, Any]:
        """Log `metrics` and return the row metrics.jsonl holds for their step. `into_its_row`: an eval of a
        step logged already (the step a run resumed from, whose eval a stop interrupted) joins that step's
        row, as an uninterrupted run logs a step and its eval in one row; a second row read as a duplicate
        step."""
        if not self.enabled:
            return metrics
        step = metrics["step"]
        if metrics.get("eval_loss") is not None:
            self.last_eval_loss = metrics["eval_loss"]
        log.info(self.progress_line(metrics))
        row = self._joined_to_its_row(metrics) if into_its_row else None
        if row is None:
            with open(self.metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(metrics) + "\n")
        for key, value in metrics.items():
            if key != "step" and isinstance(value, int | float) and math.isfinite(value):
                self._tb.add_scalar(_tensorboard_tag(key), value, step)
        if self.tracker is not None:
            self.tracker.log(metrics, step)
        return row or metrics

    def _joined_to_its_row(self, metrics: dict[str, Any]) -> dict[str, Any] | None:
        """Rewrite metrics.jsonl with `metrics` joined to the last row when that row is of the same step and
        has no eval yet, and return the joined row; None (nothing written) otherwise."""
        if not self.metrics_path.exists():
            return None
        logged = self._logged_lines()
        if not logged or logged[-1][1]["step"] != metrics["step"] or "eval_loss" in logged[-1][1]:
            return None
        row = {key: value for key, value in metrics.items() if key != "step"} | logged[-1][1]
        lines = [line for line, _ in logged[:-1]] + [json.dumps(row)]
        atomic.write_text(self.metrics_path, "".join(line + "\n" for line in lines))
        return row

    def _latest_eval_metrics(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Generation metrics (eval_cer, eval_wer, ...) of the latest eval that measured them, with its step:
        kept across the status writes of the steps in between."""
        measured = {k: v for k, v in metrics.items() if k.startswith("eval_") and k != "eval_loss"}
        if measured:
            self._eval_metrics = {"step": step, **measured}
        return self._eval_metrics

    def progress_line(self, metrics: dict[str, Any]) -> str:
        """`step 120/5000 (2.4%) | loss 3.2100 | eval 3.3050 | lr ... | ETA 3h12m`: what a person reads."""
        step = metrics["step"]
        parts = [f"step {step}/{self.max_steps} ({step / self.max_steps:.1%})"]
        if metrics.get("loss") is not None:
            parts.append(f"loss {metrics['loss']:.4f}")
        if self.last_eval_loss is not None:
            parts.append(f"eval {self.last_eval_loss:.4f}")
        shown = (("lr", ".2e"), ("grad_norm", ".3f"), ("tokens_per_s", ",.0f"), ("mfu", ".1%"))
        # DPO's (workloads/preference.py): how often the chosen answer wins, and by how much
        shown += (("rewards_accuracy", ".1%"), ("rewards_margin", ".3f"))
        for key, fmt in shown:
            if metrics.get(key) is not None:
                parts.append(f"{key} {metrics[key]:{fmt}}")
        if metrics.get("cost_usd") is not None:
            parts.append(f"${metrics['cost_usd']:.2f}")
        rate = metrics.get("steps_per_s")
        if rate:
            parts.append(f"ETA {hours_minutes((self.max_steps - step) / rate)}")
        return " | ".join(parts)

    def write_status(
        self,
        state: str,
        step: int,
        metrics: dict[str, Any],
        checkpoint: dict[str, Any] | None,
        elapsed_s: float,
    ) -> None:
        if not self.enabled:
            return
        rate = metrics.get("steps_per_s")
        eta = (self.max_steps - step) / rate if rate else None
        self._status.put(
            {
                "run": self.run.name,
                "state": state,
                "step": step,
                "max_steps": self.max_steps,
                "loss": metrics.get("loss"),
                "eval_loss": metrics.get("eval_loss"),
                "eval_metrics": self._latest_eval_metrics(step, metrics),
                "lr": metrics.get("lr"),
                "tokens_per_s": metrics.get("tokens_per_s"),
                "mfu": metrics.get("mfu"),
                "run_mfu": metrics.get("run_mfu"),
                "eta_s": eta,
                "elapsed_s": elapsed_s,
                "cost_usd": self.cost(elapsed_s),
                "latest_checkpoint": checkpoint,
                "updated_unix": time.time(),
                "pid": os.getpid(),
            },
        )

    def cost(self, elapsed_s: float) -> float | None:
        return None if self.hourly_usd is None else elapsed_s / 3600 * self.hourly_usd

    def plot_loss(self) -> None:
        if not self.enabled or not self.metrics_path.exists():
            return
        rows = [row for _, row in self._logged_lines()]
        train = [(r["step"], r["loss"]) for r in rows if r.get("loss") is not None]
        evals = [(r["step"], r["eval_loss"]) for r in rows if r.get("eval_loss") is not None]
        if not train and not evals:
            return
        resumes = self.resume_steps()
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        if train:
            ax.plot(*zip(*train, strict=True), label="train loss")
        if evals:
            ax.plot(*zip(*evals, strict=True), "o-", label="eval loss")
        for number, step in enumerate(resumes):
            ax.axvline(
                step, color="gray", linestyle="--", linewidth=1, label="resumed" if number == 0 else None
            )
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.set_title(self.run.name)
        ax.grid(alpha=0.3)
        ax.legend()
        tmp = atomic.temp_name(self.run.loss_plot)
        fig.savefig(tmp, format="png")
        plt.close(fig)
        os.replace(tmp, self.run.loss_plot)

    def close(self) -> None:
        """Flush what is still being written: status.json is on disk when this returns (the lifecycle
        writes the run's final state into it next)."""
        if self._status is not None:
            self._status.close()
        if self._tb is not None:
            self._tb.close()
        if self.tracker is not None:
            self.tracker.finish()


class StatusWriter:
    """Writes status.json (atomically, fsynced) on a thread of its own, the newest value winning.

    The training thread hands a status over and goes on: the write's two fsyncs take ~1 ms on a local
    disk and tens of ms on a network volume, at every log line and every commit. A status handed over
    while another is being written replaces any still waiting, since only the newest matters. A write that
    failed for a full volume is raised on the training thread by the next `put` or by `close` (exit 5: the
    next commit could not land either); any other failure (a network volume's I/O error) is logged once and
    training goes on, since status.json is advisory (`trainpod status`, a supervisor's view) and a crash
    would lose the steps since the last commit. `close` returns once the last status is on disk.
    """

    def __init__(self, path: Path):
        self._path = path
        self._waiting: dict[str, Any] | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._warned = False  # a failed write that is no full volume is said once, not at every log line
        self._changed = threading.Condition()
        # A daemon: a write hung on a dead volume must not keep the process from exiting.
        self._thread = threading.Thread(target=self._write_newest, name="status-writer", daemon=True)
        self._thread.start()

    def put(self, status: dict[str, Any]) -> None:
        with self._changed:
            self._raise_error()
            if self._closed:
                raise RuntimeError("status.json's writer is closed")
            self._waiting = status
            self._changed.notify()

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify()
        self._thread.join()
        with self._changed:
            self._raise_error()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error

    def _write_newest(self) -> None:
        while True:
            with self._changed:
                while self._waiting is None and not self._closed:
                    self._changed.wait()
                if self._waiting is None:
                    return  # closed, and the last status is written
                status, self._waiting = self._waiting, None
            try:
                atomic.write_json(self._path, status)
            except Exception as exc:
                if not is_disk_full(exc):
                    if not self._warned:
                        log.warning("could not write %s (%s); training goes on without it", self._path, exc)
                        self._warned = True
                    continue
                with self._changed:
                    self._error = exc


def _tensorboard_tag(key: str) -> str:
    """eval_loss -> eval/loss, eval_cer -> eval/cer; everything else under train/."""
    return f"eval/{key.removeprefix('eval_')}" if key.startswith("eval_") else f"train/{key}"


def hours_minutes(seconds: float) -> str:
    """4h05m, 12m, <1m: durations as a person reads them."""
    minutes = round(seconds / 60)
    if minutes < 1:
        return "<1m"
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"
