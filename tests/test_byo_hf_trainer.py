"""examples/hf_trainer: HF's Trainer with trainpod's callback, run as a `command` pod and interrupted.

Measured here: HF's own resume is exact on CPU (its RNG file, its sampler and its data skipping),
so a run interrupted and resumed through the commit protocol ends with the same weights, byte for
byte, as an uninterrupted one.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from support import REPO, refused_with_exit_2, run_trainpod, start_trainpod

pytestmark = pytest.mark.slow
RUN = "hf-trainer"
SCRIPT = REPO / "examples/hf_trainer/train.py"
ARGS = ["--max-steps", "20", "--save-steps", "5", "--sleep-per-step", "0.1"]


def setup(tmp_path: Path) -> tuple[Path, Path]:
    config = tmp_path / "command.yaml"
    config.write_text(
        yaml.safe_dump({"name": RUN, "command": ["python", str(SCRIPT), *ARGS], "workdir": str(REPO)})
    )
    volume = tmp_path / "volume"
    volume.mkdir()
    return config, volume


def run_dir(volume: Path) -> Path:
    return volume / "runs" / RUN


def final_weights(volume: Path) -> bytes:
    return (run_dir(volume) / "export/hf/model.safetensors").read_bytes()


def latest_step(volume: Path) -> int:
    return int((run_dir(volume) / "checkpoints/LATEST").read_text().strip().split("-")[1])


def finish(volume: Path, config: Path) -> str:
    result = run_trainpod("run", "command", "--config", str(config), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr  # the program's stderr (its warnings) stays on stderr


def signal_at_step(proc: subprocess.Popen, volume: Path, step: int, signum: int) -> str:
    """HF logs one loss line per step; the step-th one means `step` optimizer steps are done."""
    log = run_dir(volume) / "logs/program.log"
    deadline = time.monotonic() + 300
    while proc.poll() is None and (not log.exists() or len(re.findall(r"'loss'", log.read_text())) < step):
        assert time.monotonic() < deadline, f"step {step} was never reached"
        time.sleep(0.02)
    proc.send_signal(signum)
    return proc.communicate(timeout=300)[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    config, volume = setup(tmp_path_factory.mktemp("reference"))
    finish(volume, config)
    return final_weights(volume)


def test_sigterm_saves_inside_the_window_and_the_resumed_run_matches_byte_for_byte(tmp_path, uninterrupted):
    config, volume = setup(tmp_path)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    out = signal_at_step(proc, volume, 7, signal.SIGTERM)
    assert proc.returncode == 143, out
    stopped_at = latest_step(volume)
    assert 7 <= stopped_at < 20, "the step in flight is saved and committed, not only the last periodic save"
    assert f"resuming from {run_dir(volume)}/checkpoints/step-{stopped_at}" in finish(volume, config)
    assert final_weights(volume) == uninterrupted


def test_a_half_written_hf_checkpoint_is_never_resumed(tmp_path, uninterrupted):
    config, volume = setup(tmp_path)
    proc = start_trainpod("run", "command", "--config", str(config), volume=volume)
    signal_at_step(proc, volume, 13, signal.SIGKILL)
    assert latest_step(volume) == 10
    # What a kill during HF's own save of step 15 leaves: a folder HF's get_last_checkpoint would pick.
    half = run_dir(volume) / "hf-staging/checkpoint-15"
    half.mkdir(parents=True, exist_ok=True)
    (half / "model.safetensors").write_bytes(b"\0" * 100)
    out = finish(volume, config)
    assert f"resuming from {run_dir(volume)}/checkpoints/step-10" in out
    assert "discarding" in out and "checkpoint-15" in out
    assert final_weights(volume) == uninterrupted


def test_run_alone_with_no_time_left_in_the_window_it_exits_143_without_a_save(tmp_path):
    """Outside the command workload: the callback takes the lease itself and gets SIGTERM directly."""
    from support import child_env

    run = tmp_path / "runs" / RUN
    env = child_env({"TRAINPOD_RUN_DIR": str(run), "TRAINPOD_PREEMPTION_WINDOW_S": "0.001"})
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPT), *ARGS],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    seen = []
    for line in proc.stdout:  # HF logs a step's loss before its save: the first one after LATEST is step 6's
        seen.append(line)
        if "'loss'" in line and (run / "checkpoints/LATEST").exists():
            break
    # During training, past step 5's save (a SIGTERM during a save ends the run right after its commit).
    proc.send_signal(signal.SIGTERM)
    out = "".join(seen) + proc.communicate(timeout=300)[0]
    assert proc.returncode == 143, out
    assert "exiting without one" in out
    assert (run / "checkpoints/LATEST").read_text().strip() == "step-5"
    assert not (run / "LEASE").exists(), "the lease is released on the way out"


def _rank_decides_at_step_end(rank: int, world_size: int, init_file: str, run: str, answers: str) -> None:
    """One rank of a gloo group: only rank 1 has seen SIGTERM when both reach the end of step 6."""
    import json
    import os

    import torch.distributed as dist
    from transformers import TrainerControl, TrainerState

    from trainpod.checkpointer import Checkpointer
    from trainpod.integrations.hf import TrainpodCallback

    os.environ["TRAINPOD_LEASE_HELD"] = "1"  # the kit holds the run's lease for a command program
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    callback = TrainpodCallback(Checkpointer(run, watch_signals=False))
    if rank == 1:
        callback.ckpt.watch.request("SIGTERM")
    control = callback.on_step_end(None, TrainerState(global_step=6), TrainerControl())
    Path(answers, f"rank{rank}.json").write_text(json.dumps(control.should_save))
    dist.destroy_process_group()


def test_every_rank_stops_at_the_same_step_when_sigterm_reached_only_one_of_them(tmp_path):
    """A rank that saves while another trains on would wait in the save's barrier until SIGKILL."""
    import json

    import torch.multiprocessing as mp

    args = (2, str(tmp_path / "init"), str(tmp_path / "run"), str(tmp_path))
    mp.spawn(_rank_decides_at_step_end, args=args, nprocs=2, join=True)
    decisions = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert decisions == [True, True], "rank 0 must save with rank 1, which saw the SIGTERM"


def test_load_best_model_at_end_is_exit_2_when_the_trainer_is_made_not_ignored_at_its_end(tmp_path, caplog):
    """README: `load_best_model_at_end` is not supported. HF looked for the best checkpoint-<N>/ in the staging
    folder at the end, found it moved into the store, warned, and left the last weights in place of the best."""
    import torch
    from transformers import Trainer, TrainingArguments

    from trainpod import Checkpointer
    from trainpod.integrations.hf import TrainpodCallback

    callback = TrainpodCallback(Checkpointer(tmp_path / "run", watch_signals=False))
    args = TrainingArguments(
        output_dir=callback.staging_dir,
        load_best_model_at_end=True,
        eval_strategy="steps",
        save_strategy="steps",
        report_to=[],
        use_cpu=True,
    )
    try:
        refused_with_exit_2(
            lambda: Trainer(model=torch.nn.Linear(2, 2), args=args, eval_dataset=[0], callbacks=[callback]),
            caplog,
        )
        assert callback.ckpt.lease is None, "the lease is released at the exit"
    finally:
        callback.ckpt.close()
    assert re.search(r"load_best_model_at_end=True is not supported.*keep_best", caplog.text), caplog.text


class _Regression(__import__("torch").nn.Module):
    """A model HF's Trainer can train in a second: y = w.x + b, squared error as its loss."""

    def __init__(self):
        import torch

        super().__init__()
        self.linear = torch.nn.Linear(2, 1)

    def forward(self, x, labels):
        return {"loss": ((self.linear(x).squeeze(-1) - labels) ** 2).mean()}


def evaluated_and_saved_at_every_step(tmp_path, model, learning_rate: float, **arguments):
    """Six steps of HF's Trainer on a regression, evaluated and saved at each, through the callback
    (keep_last=2, keep_best=1); the Trainer, trained, its Checkpointer closed. `arguments`: more of
    TrainingArguments', and compute_metrics."""
    import torch
    from transformers import Trainer, TrainingArguments

    from trainpod import Checkpointer
    from trainpod.integrations.hf import TrainpodCallback

    compute_metrics = arguments.pop("compute_metrics", None)
    generator = torch.Generator().manual_seed(0)
    rows = [{"x": x, "labels": x.sum()} for x in torch.randn(16, 2, generator=generator)]
    callback = TrainpodCallback(Checkpointer(tmp_path / "run", keep_last=2, keep_best=1, watch_signals=False))
    args = TrainingArguments(
        output_dir=callback.staging_dir,
        max_steps=6,
        per_device_train_batch_size=4,
        learning_rate=learning_rate,
        lr_scheduler_type="constant",
        eval_strategy="steps",
        eval_steps=1,
        save_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        **arguments,
    )
    torch.manual_seed(0)  # the model's initial weights: HF seeds only once it trains
    trainer = Trainer(
        model=model(),
        args=args,
        train_dataset=rows,
        eval_dataset=rows,
        compute_metrics=compute_metrics,
        callbacks=[callback],
    )
    try:
        trainer.train()
    finally:
        callback.ckpt.close()
    return trainer


def test_each_hf_checkpoint_records_its_eval_loss_so_keep_best_ranks_them(tmp_path):
    """README: use `keep_best` (instead of load_best_model_at_end). The callback committed HF's checkpoints
    without their eval loss, so best-k retention had nothing to rank and kept no best one."""
    import json

    # Too high a learning rate, and constant: the evals overshoot, so the best is not the newest.
    trainer = evaluated_and_saved_at_every_step(tmp_path, _Regression, learning_rate=1.0)
    logged = {e["step"]: e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e}
    kept = {
        int(p.name.split("-")[1]): json.loads((p / "manifest.json").read_text()).get("eval_loss")
        for p in (tmp_path / "run/checkpoints").glob("step-*")
    }
    assert kept and all(kept[step] == logged[step] for step in kept), f"manifests {kept}, HF logged {logged}"
    best = min(logged, key=lambda step: (logged[step], -step))
    assert best not in (5, 6), f"the evals {logged} no longer overshoot: this test cannot tell best from last"
    assert set(kept) == {best, 5, 6}, f"keep_last=2 and keep_best=1 keep {sorted(kept)}; HF logged {logged}"


def test_keep_best_ranks_by_hf_metric_for_best_model_and_its_greater_is_better(tmp_path):
    """HF's metric_for_best_model (an accuracy, a BLEU: greater is better) was ignored and keep_best kept the
    checkpoints of the lowest eval loss, so the one the user's own metric calls best could be deleted. Here the
    metric is the squared error itself with greater_is_better=True: its best is the eval loss's worst, so a
    ranking by the eval loss keeps another checkpoint."""
    import json

    import numpy as np

    def squared_error(prediction):
        return {
            "squared_error": float(np.mean((prediction.predictions.reshape(-1) - prediction.label_ids) ** 2))
        }

    # A small learning rate: the error falls at each step, so the greatest is the first eval's.
    trainer = evaluated_and_saved_at_every_step(
        tmp_path,
        _Predictor,
        learning_rate=0.05,
        compute_metrics=squared_error,
        metric_for_best_model="squared_error",
        greater_is_better=True,
    )
    logged = {
        e["step"]: e["eval_squared_error"] for e in trainer.state.log_history if "eval_squared_error" in e
    }
    best = max(logged, key=lambda step: (logged[step], step))
    by_loss = min(logged, key=lambda step: (logged[step], -step))
    assert best not in (by_loss, 5, 6), f"the evals {logged} no longer tell the metric's best from the loss's"
    kept = sorted(int(p.name.split("-")[1]) for p in (tmp_path / "run/checkpoints").glob("step-*"))
    assert kept == sorted({best, 5, 6}), f"keep_last=2 and keep_best=1 keep {kept}; HF logged {logged}"
    score = json.loads((tmp_path / f"run/checkpoints/step-{best}/manifest.json").read_text())["score"]
    assert score == {"metric": "-eval_squared_error", "value": -logged[best]}


class _Predictor(_Regression):
    """_Regression that also returns its predictions, which HF's compute_metrics gets."""

    def forward(self, x, labels):
        prediction = self.linear(x).squeeze(-1)
        return {"loss": ((prediction - labels) ** 2).mean(), "logits": prediction}


def _resume_to_the_end(trainer, callback) -> None:
    """Train on from the checkpoint the callback resumes from, to max_steps; the Checkpointer closed after."""
    try:
        trainer.train(resume_from_checkpoint=callback.resume_from_checkpoint())
    finally:
        callback.ckpt.close()


def _exit_of_a_sigterm_at_step(step: int, trainer, callback) -> int:
    """Train until a SIGTERM arrives during `step` (asked before the callback's on_step_end sees the step's end);
    the exit code the callback ends the process with."""
    from transformers import TrainerCallback

    class SigtermAtStep(TrainerCallback):
        def on_step_end(self, args, state, control, **_):
            if state.global_step == step:
                callback.ckpt.watch.request("SIGTERM")

    trainer.callback_handler.callbacks.insert(0, SigtermAtStep())
    return _exit_code_of_training(trainer, callback)


def _exit_code_of_training(trainer, callback) -> int:
    """Train until the callback ends the process at a stop; the exit code it ends it with."""
    try:
        with pytest.raises(SystemExit) as stopped:
            trainer.train()
    finally:
        callback.ckpt.close()
    return stopped.value.code


def _regression_trainer(run: Path, max_steps: int):
    import torch
    from transformers import Trainer, TrainingArguments

    from trainpod import Checkpointer
    from trainpod.integrations.hf import TrainpodCallback

    generator = torch.Generator().manual_seed(0)
    rows = [{"x": x, "labels": x.sum()} for x in torch.randn(16, 2, generator=generator)]
    callback = TrainpodCallback(Checkpointer(run, watch_signals=False))
    args = TrainingArguments(
        output_dir=callback.staging_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        save_steps=2,
        report_to=[],
        use_cpu=True,
        seed=0,
    )
    torch.manual_seed(0)
    return Trainer(model=_Regression(), args=args, train_dataset=rows, callbacks=[callback]), callback


def test_hfs_own_resume_idiom_never_finds_a_checkpoint_a_kill_left_half_written_in_staging(tmp_path):
    """HF's run_clm.py resumes from get_last_checkpoint(output_dir) (or resume_from_checkpoint=True): the newest
    checkpoint-<N>/ by name, which in staging is one a kill interrupted while HF wrote it."""
    from transformers.trainer_utils import get_last_checkpoint

    from trainpod import Checkpointer
    from trainpod.integrations.hf import TrainpodCallback

    half_written = tmp_path / "run/hf-staging/checkpoint-6"
    half_written.mkdir(parents=True)
    (half_written / "model.safetensors").write_bytes(b"torn")
    callback = TrainpodCallback(Checkpointer(tmp_path / "run", watch_signals=False))
    try:
        assert get_last_checkpoint(callback.staging_dir) is None, "the half-written checkpoint-6 is discarded"
    finally:
        callback.ckpt.close()


def test_a_checkpoint_of_the_users_own_in_an_output_dir_other_than_staging_is_never_deleted(tmp_path):
    """A script that kept its own output_dir (holding an earlier run's checkpoint-1000/, the one it resumes from)
    had that folder deleted when training began, logged as a save a kill had interrupted."""
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from trainpod import Checkpointer
    from trainpod.integrations.hf import TrainpodCallback

    users_own = tmp_path / "out/checkpoint-1000"
    users_own.mkdir(parents=True)
    (users_own / "model.safetensors").write_bytes(b"weights of an earlier run")
    callback = TrainpodCallback(Checkpointer(tmp_path / "run", watch_signals=False))
    try:
        args = TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True)
        callback.on_train_begin(args, TrainerState(), TrainerControl())
    finally:
        callback.ckpt.close()
    assert (users_own / "model.safetensors").read_bytes() == b"weights of an earlier run", (
        "a folder outside the kit's staging is the user's: leave it"
    )


def test_a_trainer_that_did_not_resume_from_the_newest_commit_is_exit_2_before_its_first_step(
    tmp_path, caplog
):
    """A script that resumes the HF way (get_last_checkpoint(output_dir): None, since every checkpoint is moved
    into the store) trained from step 0 at every start: each spot stop lost everything since the first."""
    trainer, callback = _regression_trainer(tmp_path / "run", max_steps=4)
    try:
        trainer.train()
    finally:
        callback.ckpt.close()
    assert (tmp_path / "run/checkpoints/LATEST").read_text() == "step-4\n"
    trainer, callback = _regression_trainer(tmp_path / "run", max_steps=8)
    try:
        refused_with_exit_2(trainer.train, caplog)
    finally:
        callback.ckpt.close()
    assert re.search(r"starts at step 0.*resume_from_checkpoint=callback", caplog.text), caplog.text
    assert trainer.state.global_step == 0, "refused before any step is trained"
    trainer, callback = _regression_trainer(tmp_path / "run", max_steps=8)
    _resume_to_the_end(trainer, callback)
    assert (tmp_path / "run/checkpoints/LATEST").read_text() == "step-8\n"


def test_a_sigterm_during_a_save_stops_right_after_its_commit_without_another_step(tmp_path):
    """The stop was read at the step's end alone: a SIGTERM during HF's save (or its commit) trained one more
    step and saved again, inside what was left of the window, instead of exiting after the commit."""
    from transformers import TrainerCallback

    class SigtermDuringTheSave(
        TrainerCallback
    ):  # before the callback's on_save: HF has written checkpoint-2/
        def on_save(self, args, state, control, **_):
            callback.ckpt.watch.request("SIGTERM")

    trainer, callback = _regression_trainer(tmp_path / "run", max_steps=6)
    trainer.callback_handler.callbacks.insert(0, SigtermDuringTheSave())
    try:
        with pytest.raises(SystemExit) as stopped:
            trainer.train()
    finally:
        callback.ckpt.close()
    assert stopped.value.code == 143
    assert trainer.state.global_step == 2, "no step after the save the SIGTERM came in"
    assert (tmp_path / "run/checkpoints/LATEST").read_text() == "step-2\n"


def test_the_hub_token_given_to_training_arguments_never_reaches_a_committed_checkpoint(tmp_path):
    """HF pickles its TrainingArguments whole into each checkpoint (training_args.bin): TrainingArguments(
    hub_token=...), HF's way to push to the hub, put the token on the volume in every commit."""
    import torch
    from transformers import Trainer, TrainingArguments

    from trainpod import Checkpointer
    from trainpod.integrations.hf import TrainpodCallback

    token = "hf_hubtoken0123456789abcdef"
    rows = [
        {"x": x, "labels": x.sum()} for x in torch.randn(16, 2, generator=torch.Generator().manual_seed(0))
    ]

    def trainer(max_steps: int) -> tuple[Trainer, TrainpodCallback]:
        callback = TrainpodCallback(Checkpointer(tmp_path / "run", watch_signals=False))
        args = TrainingArguments(
            output_dir=callback.staging_dir,
            max_steps=max_steps,
            per_device_train_batch_size=4,
            save_steps=2,
            report_to=[],
            use_cpu=True,
            hub_token=token,
        )
        return Trainer(model=_Regression(), args=args, train_dataset=rows, callbacks=[callback]), callback

    first, callback = trainer(2)
    try:
        first.train()
    finally:
        callback.ckpt.close()
    committed = tmp_path / "run/checkpoints/step-2"
    leaked = [p.name for p in committed.rglob("*") if p.is_file() and token.encode() in p.read_bytes()]
    assert leaked == [], f"the hub token is in {leaked} on the volume"
    saved = torch.load(committed / "training_args.bin", weights_only=False)
    assert saved.hub_token is None and saved.max_steps == 2 and saved.save_steps == 2, "the rest kept"
    assert first.args.hub_token == token, "the running Trainer keeps its token to push with"

    resumed, callback = trainer(4)
    _resume_to_the_end(resumed, callback)
    assert (tmp_path / "run/checkpoints/LATEST").read_text() == "step-4\n"


def test_an_eval_before_a_save_is_not_counted_as_the_saves_time_at_a_stop(tmp_path):
    """eval_steps = save_steps, a common setting: HF evaluates and then saves. The callback timed the save from
    the step's end, the eval included, so with an eval of a few seconds a stop never saved (it needed more than
    the 5 s window) and lost every step since the last save, though the save (with no eval at a stop) takes
    a fraction of a second."""
    import time

    class SlowToEvaluate(_Regression):
        def forward(self, x, labels):
            if not self.training:
                time.sleep(1)  # an eval of 4 s: 16 rows in batches of 4
            return super().forward(x, labels)

    trainer, callback = _regression_trainer(tmp_path / "run", max_steps=6)
    trainer.args.eval_strategy = "steps"
    trainer.args.eval_steps = 2
    trainer.args.per_device_eval_batch_size = 4
    trainer.eval_dataset = trainer.train_dataset
    trainer.model.__class__ = SlowToEvaluate
    assert _exit_of_a_sigterm_at_step(3, trainer, callback) == 143
    assert (tmp_path / "run/checkpoints/LATEST").read_text() == "step-3\n", "the stop's save fits the window"


def test_a_stop_saves_when_the_last_saves_measured_time_fits_whatever_the_size_guess_says(
    tmp_path, monkeypatch
):
    """README: a save is made if the last one's duration fits the window. The callback took the larger of that
    and a guess from the checkpoint's size at 200 MB/s (0.5 s + 5 s per GB), so a checkpoint of 1 GB or more
    never saved at a stop however fast the last save was. (A 0.7 s window here stands for 5 s with such a
    checkpoint: the guess alone, 0.5 s x 1.5, does not fit it; the last save, a fraction of it, does.)"""
    monkeypatch.setenv("TRAINPOD_PREEMPTION_WINDOW_S", "0.7")
    trainer, callback = _regression_trainer(tmp_path / "run", max_steps=6)
    assert _exit_of_a_sigterm_at_step(3, trainer, callback) == 143
    assert callback.save_seconds * 1.5 < 0.7, f"the last save took {callback.save_seconds:.2f} s: no test"
    assert (tmp_path / "run/checkpoints/LATEST").read_text() == "step-3\n", "the stop's save fits the window"


class _SlowToEvaluate(_Regression):
    """An eval batch takes 0.05 s (an eval set of 40 rows: 2 s, against a window of 1 s below)."""

    eval_forwards = 0

    def forward(self, x, labels):
        import time

        if not self.training:
            type(self).eval_forwards += 1
            time.sleep(0.05)
        return super().forward(x, labels)


def _sigterm_in_the_eval_of_step(step: int, rows: int, trainer, callback) -> tuple[int, int]:
    """Train with an eval of `rows` batches every 2 or 3 steps until a SIGTERM arrives during the eval of `step`
    (at its first batch); the exit code and the eval batches run after the SIGTERM."""
    from transformers import TrainerCallback

    class SigtermInTheEval(TrainerCallback):
        forwards_at_the_signal = None

        def on_prediction_step(self, args, state, control, **_):
            if state.global_step == step and self.forwards_at_the_signal is None:
                self.forwards_at_the_signal = _SlowToEvaluate.eval_forwards
                callback.ckpt.watch.request("SIGTERM")

    signal_at = SigtermInTheEval()
    trainer.eval_dataset = trainer.train_dataset[:1] * rows
    trainer.args.eval_strategy = "steps"
    trainer.args.per_device_eval_batch_size = 1
    trainer.model.__class__ = _SlowToEvaluate
    trainer.callback_handler.callbacks.insert(0, signal_at)
    code = _exit_code_of_training(trainer, callback)
    return code, _SlowToEvaluate.eval_forwards - signal_at.forwards_at_the_signal


def test_a_sigterm_during_an_eval_too_long_for_the_window_abandons_it_and_exits_143_at_once(
    tmp_path, monkeypatch
):
    """HF saves after its eval, and the callback read the stop at the step's end and the save alone: a SIGTERM
    during an eval of minutes was answered after it, the SIGKILL came in the eval (the lease held, the new pod
    waiting out its TTL) or in the save HF then began. Now the eval is abandoned at its next batch when its rest
    and a save do not fit the window, and the run exits 143 with its committed checkpoints as they were."""
    monkeypatch.setenv("TRAINPOD_PREEMPTION_WINDOW_S", "1")
    trainer, callback = _regression_trainer(tmp_path / "run", max_steps=6)
    trainer.args.eval_steps = 2  # = save_steps: the eval of step 4 comes before its save
    code, batches_after = _sigterm_in_the_eval_of_step(4, 40, trainer, callback)
    assert code == 143
    assert batches_after <= 1, f"the eval ran {batches_after} more batches (~2 s) in a 1 s window"
    assert (tmp_path / "run/checkpoints/LATEST").read_text() == "step-2\n", (
        "no save begun it could not finish"
    )
    assert not list((tmp_path / "run/hf-staging").glob("checkpoint-*")), "no partial save left"


def test_a_sigterm_during_an_eval_that_fits_the_window_saves_its_step_right_after_it(tmp_path):
    """An eval of 0.2 s and a save fit the 5 s window: the eval ends and its step is saved at once. HF saves only
    at save_steps, so a stop in the eval of step 3 trained step 4 before the step-end check saved it."""
    trainer, callback = _regression_trainer(tmp_path / "run", max_steps=6)
    trainer.args.eval_steps = 3
    code, batches_after = _sigterm_in_the_eval_of_step(3, 4, trainer, callback)
    assert code == 143 and batches_after == 3, "the eval ran to its end"
    assert trainer.state.global_step == 3, "no step after the eval the SIGTERM came in"
    assert (tmp_path / "run/checkpoints/LATEST").read_text() == "step-3\n"


def _rank_decides_in_an_eval(rank: int, world_size: int, init_file: str, run: str, answers: str) -> None:
    """One rank of a gloo group at an eval batch of a long eval: only rank 1 has seen SIGTERM."""
    import json
    import os

    import torch.distributed as dist
    from transformers import TrainerControl, TrainerState

    from trainpod.checkpointer import Checkpointer
    from trainpod.integrations.hf import TrainpodCallback

    os.environ["TRAINPOD_LEASE_HELD"] = "1"
    os.environ["TRAINPOD_PREEMPTION_WINDOW_S"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    callback = TrainpodCallback(Checkpointer(run, watch_signals=False))
    callback.on_step_end(None, TrainerState(global_step=6), TrainerControl())
    if rank == 1:
        callback.ckpt.watch.request("SIGTERM")
    code = None
    try:
        time.sleep(0.1)  # one eval batch of 10,000: the eval's rest is far beyond the window
        callback.on_prediction_step(
            None, TrainerState(global_step=6), TrainerControl(), eval_dataloader=range(10_000)
        )
    except SystemExit as stopped:
        code = stopped.code
    Path(answers, f"rank{rank}.json").write_text(json.dumps(code))
    if dist.is_initialized():
        dist.destroy_process_group()


def test_every_rank_abandons_the_eval_at_the_same_batch_when_sigterm_reached_only_one_of_them(tmp_path):
    """A rank that exits while another goes on evaluating leaves it waiting in the next batch's gather."""
    import json

    import torch.multiprocessing as mp

    args = (2, str(tmp_path / "init"), str(tmp_path / "run"), str(tmp_path))
    mp.spawn(_rank_decides_in_an_eval, args=args, nprocs=2, join=True)
    decisions = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert decisions == [143, 143], "rank 0 must leave the eval with rank 1, which saw the SIGTERM"


def test_a_save_during_which_the_lease_was_taken_over_is_not_committed_and_every_rank_exits_75(tmp_path):
    """HF's save of a large model takes minutes; another pod that took the run's lease over meanwhile owns LATEST
    and retention. The callback committed the save all the same; it now commits nothing and exits 75, as the
    lease lost at a step's end does."""
    import json

    from transformers import TrainerControl, TrainerState, TrainingArguments

    from trainpod import Checkpointer
    from trainpod.checkpoint import Lease
    from trainpod.integrations.hf import TrainpodCallback

    run = tmp_path / "run"
    run.mkdir()
    ckpt = Checkpointer(run, watch_signals=False)
    ckpt.lease = Lease(run / "LEASE", ttl_seconds=0.8)  # a heartbeat every 0.2 s
    ckpt.lease.acquire()
    callback = TrainpodCallback(ckpt)
    saved = Path(callback.staging_dir) / "checkpoint-5"
    saved.mkdir(parents=True)
    (saved / "model.safetensors").write_bytes(b"\0" * 64)
    held = json.loads((run / "LEASE").read_text())  # HF writing: another pod takes the run over
    held["owner"] = {"id": "rival", "host": "elsewhere", "pid": 7, "pod_id": "pod-rival"}
    (run / "LEASE").write_text(json.dumps(held))
    assert ckpt.lease.lost.wait(10)
    args = TrainingArguments(output_dir=callback.staging_dir, report_to=[], use_cpu=True)
    with pytest.raises(SystemExit) as exited:
        callback.on_save(args, TrainerState(global_step=5), TrainerControl())
    assert exited.value.code == 75
    assert not (run / "checkpoints/LATEST").exists() and not (run / "checkpoints/step-5").exists()
    assert json.loads((run / "LEASE").read_text())["owner"]["id"] == "rival", "the new writer's lease stays"


REFUSED_TRAINERS = """
import sys, torch
from transformers import Trainer, TrainingArguments
from trainpod import Checkpointer
from trainpod.integrations.hf import TrainpodCallback
class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(2, 1)
    def forward(self, x, labels):
        return {"loss": ((self.linear(x).squeeze(-1) - labels) ** 2).mean()}
run = sys.argv[1]
with Checkpointer(run) as ckpt:
    ckpt.commit(4, model=Regression())
callback = TrainpodCallback()
rows = [{"x": x, "labels": x.sum()} for x in torch.randn(16, 2)]
args = TrainingArguments(
    output_dir=callback.staging_dir, max_steps=8, save_steps=2, report_to=[], use_cpu=True
)
trainer = Trainer(model=Regression(), args=args, train_dataset=rows, callbacks=[callback])
trainer.train()  # not resumed from the run's step 4
print("went on after the refusal")
"""


def test_a_script_whose_trainer_the_callback_refuses_exits_2_with_its_line_and_nothing_touched(tmp_path):
    """The callback's ConfigError went out through the user's Trainer and script: a traceback and exit 1, a crash
    that every start repeated (and counted) into the same refusal. Run alone (the callback takes the lease), the
    lease is released and the run's checkpoints stay as they were. One case (7 s: transformers' import): the
    refusal inside trainer.train(); the one when the Trainer is made ends through the same exit, tested above."""
    run = tmp_path / "run"
    said = "the Trainer starts at step 0, but the run's newest committed checkpoint is"
    result = subprocess.run(
        [sys.executable, "-c", REFUSED_TRAINERS, str(run)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "TRAINPOD_RUN_DIR": str(run)},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output and "went on" not in output, output
    *_, line, last = output.splitlines()
    assert said in line and last == "exiting 2", output
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["LATEST", "step-4"]
    assert (run / "checkpoints" / "LATEST").read_text().strip() == "step-4"
    assert not list(run.glob("hf-staging/checkpoint-*")), "HF saved nothing"
    assert not (run / "LEASE").exists(), "the lease is released at the exit"
