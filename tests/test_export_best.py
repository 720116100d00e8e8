"""export.weights: best exports the retained checkpoint with the best eval, not the last step's weights.

An early-stopped run (or any run with keep_best) ends `early_stopping_patience` evals past its best, and the
export held those last weights: the checkpoint keep_best kept was on the volume, but what a user deploys
(export/adapter, export/hf) was the worse model. The evals here are scripted (the model's eval loss would
not turn up in a test of seconds): best at step 4, then worse, as an overfitting finetune's are.

.venv/bin/pytest -q tests/test_export_best.py
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch
from test_export_stop import DRIVER as EXPORT_HELD_UNTIL_SIGTERM

from trainpod.errors import ExitCode

from finetune_support import FINETUNE_RUN, finetune_args
from support import RUN, TINY_PRETRAIN, child_env, sigterm_once_marked, trainpod_cmd

SCRIPTED_EVALS = """
import json, os
from trainpod.workloads.finetune import Finetuner
from trainpod.workloads.pretrain import Pretrainer

_scripted = {int(step): loss for step, loss in json.loads(os.environ["EVAL_LOSSES"]).items()}


def scripted(real_evaluate):
    def evaluate(self, model, step):
        real_evaluate(self, model, step)  # the real eval runs (worst samples, eval mode); its loss is replaced
        return _scripted[step]
    return evaluate


Finetuner.evaluate = scripted(Finetuner.evaluate)
Pretrainer.evaluate = scripted(Pretrainer.evaluate)
"""
# Each rank's DCP reads (dcp.load) recorded by the keys of the state it fills, one JSON line per load.
RECORDED_DCP_LOADS = """
import json, os
import torch.distributed.checkpoint as dcp

_load = dcp.load


def recorded_load(state_dict, *args, **kwargs):
    with open(os.environ["DCP_LOADS"], "a") as out:
        out.write(json.dumps({part: sorted(value) for part, value in state_dict.items()}) + "\\n")
    return _load(state_dict, *args, **kwargs)


dcp.load = recorded_load
"""
RUN_TRAINPOD = """
import runpy, sys
sys.argv = ["trainpod", *sys.argv[1:]]
runpy.run_module("trainpod", run_name="__main__")
"""
EVAL_LOSSES = {"2": 3.0, "4": 1.0, "6": 2.0, "8": 2.5}  # the best at step 4; keep_last 2 keeps 6 and 8
SETTINGS = (
    *("--set", "train.max_steps=8", "--set", "train.eval_every=2", "--set", "checkpoint.every_steps=2"),
    *("--set", "checkpoint.keep_last=2", "--set", "checkpoint.keep_best=1"),
)


def finetune(volume: Path, weights: str, run: str = FINETUNE_RUN) -> str:
    args = finetune_args(*SETTINGS, "--set", f"export.weights={weights}", "--run", run, method="lora")
    return run_with_scripted_evals(args, volume)


def run_with_scripted_evals(args: tuple[str, ...], volume: Path) -> str:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPTED_EVALS + RUN_TRAINPOD, *trainpod_cmd(*args, volume=volume)[3:]],
        env=child_env({"EVAL_LOSSES": json.dumps(EVAL_LOSSES)}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    assert result.returncode == ExitCode.DONE, output
    return output


def adapter_tensors(run: Path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(run / "export" / "adapter" / "adapter_model.safetensors")


def checkpoint_adapter(run: Path, step: int) -> dict[str, torch.Tensor]:
    """The LoRA tensors of a committed checkpoint, by the names peft's adapter file gives them."""
    trainable = safetensors.torch.load_file(run / "checkpoints" / f"step-{step}" / "trainable.safetensors")
    return {name.replace(".default.", "."): tensor for name, tensor in trainable.items()}


def assert_holds_the_weights_of(run: Path, step: int) -> None:
    exported, committed = adapter_tensors(run), checkpoint_adapter(run, step)
    assert exported.keys() == committed.keys()
    differing = [name for name in exported if not torch.equal(exported[name], committed[name])]
    assert not differing, f"the export is not step-{step}'s weights: {differing[:3]} differ"


@pytest.fixture
def finetune_volume(finetune_base_volume: Path, tmp_path: Path) -> Path:
    shutil.copytree(finetune_base_volume, tmp_path / "finetune-volume")
    return tmp_path / "finetune-volume"


def test_export_weights_best_exports_the_best_retained_checkpoint_and_last_the_final_step(
    finetune_volume: Path,
):
    output = finetune(finetune_volume, "best")
    run = finetune_volume / "runs" / FINETUNE_RUN
    assert sorted(p.name for p in (run / "checkpoints").glob("step-*")) == ["step-4", "step-6", "step-8"]
    assert_holds_the_weights_of(run, 4)
    assert "exporting the weights of step 4" in output, output
    manifest = json.loads((run / "export" / "adapter" / "manifest.json").read_text())
    assert manifest["weights"] == {"chosen": "best", "step": 4, "metric": "eval_loss", "value": 1.0}
    summary = json.loads((run / "export" / "adapter" / "training_summary.json").read_text())
    assert summary["results"]["exported_weights"]["step"] == 4
    assert json.loads((run / "DONE").read_text())["exported_weights"]["step"] == 4

    finetune(finetune_volume, "last", run="last-run")
    last = finetune_volume / "runs" / "last-run"
    assert_holds_the_weights_of(last, 8)
    assert json.loads((last / "export" / "adapter" / "manifest.json").read_text())["weights"] == {
        "chosen": "last",
        "step": 8,
    }


def test_an_export_of_the_best_stopped_and_started_again_exports_the_same_checkpoint(
    finetune_volume: Path, tmp_path
):
    args = finetune_args(*SETTINGS, "--set", "export.weights=best", method="lora")
    code, out = sigterm_once_marked(
        SCRIPTED_EVALS + EXPORT_HELD_UNTIL_SIGTERM,
        args,
        finetune_volume,
        tmp_path / "exporting",
        {"EVAL_LOSSES": json.dumps(EVAL_LOSSES)},
        "export",
    )
    run = finetune_volume / "runs" / FINETUNE_RUN
    assert code == ExitCode.PREEMPTED, out
    assert not (run / "export" / "adapter").exists(), out

    resumed = finetune(finetune_volume, "best")
    assert "resumed from step-8" in resumed
    assert_holds_the_weights_of(run, 4)
    assert json.loads((run / "export" / "adapter" / "manifest.json").read_text())["weights"]["step"] == 4


def test_every_scored_checkpoint_damaged_exports_the_last_step_saying_why(finetune_volume: Path):
    """The export fell back to the last step's weights, rightly, but warned that no kept checkpoint was scored by
    an eval, though two were and both failed verification: the user looked for a missing eval, not bit rot."""
    args = finetune_args(
        *SETTINGS, "--set", "train.max_steps=9", "--set", "export.weights=best", "--run", "rot", method="lora"
    )
    run_with_scripted_evals(args, finetune_volume)  # evals at 2, 4, 6, 8; kept: step-4 (best), 8 and 9
    run = finetune_volume / "runs" / "rot"
    scored = sorted(
        path.parent.name
        for path in (run / "checkpoints").glob("step-*/manifest.json")
        if json.loads(path.read_text()).get("eval_loss") is not None
    )
    assert scored == ["step-4", "step-8"], scored
    for name in scored:
        flip_a_byte(run / "checkpoints" / name / "trainable.safetensors")
    (run / "DONE").unlink()
    shutil.rmtree(run / "export")
    output = run_with_scripted_evals(args, finetune_volume)  # resumes from step-9, which is whole
    assert "every kept checkpoint an eval scored (step-4, step-8) fails verification" in output, output
    assert "no kept checkpoint was scored" not in output, output
    assert (
        json.loads((run / "export" / "adapter" / "manifest.json").read_text())["weights"]["chosen"] == "last"
    )


BEST_VERIFIED_UNTIL_KILLED = """
import os, time
from pathlib import Path
from trainpod.train.trainer import Trainer


def _best_checkpoint(self):
    # Hashing the best checkpoint's every file (weights and optimizer state: minutes for a 7B model on the
    # network volume) in Python between hashlib's C calls, as CheckpointStore.verify does; longer than a test.
    Path(os.environ["STOP_MARKER"]).touch()
    for _ in range(60_000):
        time.sleep(0.01)


Trainer._best_checkpoint = _best_checkpoint
"""


def test_a_stop_while_the_best_checkpoint_is_verified_for_the_export_ends_it_at_once(
    finetune_volume: Path, tmp_path
):
    """The verification came before the export's abandoning part, so the stop was answered only after it: the
    spot pod's SIGKILL came with the run's lease held, and a new pod on another host waited out its TTL."""
    args = finetune_args(*SETTINGS, "--set", "export.weights=best", method="lora")
    code, out = sigterm_once_marked(
        SCRIPTED_EVALS + BEST_VERIFIED_UNTIL_KILLED + RUN_TRAINPOD,
        args,
        finetune_volume,
        tmp_path / "verifying",
        {"EVAL_LOSSES": json.dumps(EVAL_LOSSES)},
        "verification of the best checkpoint",
    )
    run = finetune_volume / "runs" / FINETUNE_RUN
    assert code == ExitCode.PREEMPTED, out
    assert not (run / "export" / "adapter").exists() and not (run / "LEASE").exists(), out


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "train.eval_every=0",
            "export.weights='best' exports the checkpoint of the best eval, and train.eval_every=0",
        ),
        (
            "checkpoint.keep_best=0",
            "export.weights='best' needs that checkpoint kept: set checkpoint.keep_best",
        ),
        ("checkpoint.every_steps=3", "checkpoint.every_steps=3 does not divide train.eval_every=10"),
        ("data.sft.val_ratio=0", "export.weights=best needs a validation split, and the data has none"),
    ],
)
def test_export_weights_best_with_no_best_checkpoint_to_export_is_exit_2_naming_the_fix(
    finetune_volume: Path, setting: str, message: str
):
    args = finetune_args("--set", "export.weights=best", "--set", setting, method="lora")
    result = subprocess.run(
        trainpod_cmd(*args, volume=finetune_volume),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = result.stdout + result.stderr
    assert result.returncode == ExitCode.BAD_INPUT, output
    assert message in output and "export.weights=last" in output and "Traceback" not in output
    assert not (finetune_volume / "runs" / FINETUNE_RUN).exists()


def test_a_pretrains_export_weights_best_exports_the_best_checkpoints_weights(volume: Path):
    args = (
        *("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "train.warmup_steps=1"),
        *SETTINGS,
        *("--set", "export.weights=best"),
    )
    output = run_with_scripted_evals(args, volume)
    run = volume / "runs" / RUN
    exported = safetensors.torch.load_file(run / "export" / "hf" / "model.safetensors")
    committed = safetensors.torch.load_file(run / "checkpoints" / "step-4" / "model.safetensors")
    differing = [name for name in exported if not torch.equal(exported[name], committed[name])]
    assert exported and not differing, f"the export is not step-4's weights: {differing[:3]} differ"
    assert json.loads((run / "export" / "hf" / "manifest.json").read_text())["weights"]["step"] == 4, output


def run_on_two_fsdp_ranks_recording_dcp_loads(
    args: tuple[str, ...], volume: Path, tmp_path: Path
) -> list[dict]:
    """`args` on two FSDP ranks with scripted evals; the DCP loads they made, by the state's parts."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SCRIPTED_EVALS + RECORDED_DCP_LOADS)  # both ranks' evals scripted
    dcp_loads = tmp_path / "dcp_loads.jsonl"
    env = {
        "EVAL_LOSSES": json.dumps(EVAL_LOSSES),
        "DCP_LOADS": str(dcp_loads),
        "PYTHONPATH": os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
    }
    args = (*args, "--set", "export.weights=best", "--nproc-per-node", "2", "--set", "train.parallel=fsdp")
    result = subprocess.run(
        trainpod_cmd(*args, volume=volume), env=child_env(env), capture_output=True, text=True, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == ExitCode.DONE, output
    assert "exporting the weights of step 4" in output, output
    loads = [json.loads(line) for line in dcp_loads.read_text().splitlines()]
    assert len(loads) == 2 and all(load["model"] for load in loads), f"one load of step 4 per rank: {loads}"
    return loads


def assert_read_the_weights_alone(loads: list[dict]) -> None:
    assert [sorted(load) for load in loads] == [["model"], ["model"]], (
        f"the best export read more than the weights of step 4 (AdamW's state is twice them, read from the "
        f"network volume for nothing): {[sorted(load) for load in loads]}"
    )


def test_two_fsdp_ranks_export_the_best_checkpoints_weights_as_one_rank_does(volume: Path, tmp_path: Path):
    """Sharded: each rank loads its shards of the best checkpoint (a collective) before the export gathers them,
    the weights alone."""
    args = (
        *("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "train.warmup_steps=1"),
        *SETTINGS,
    )
    loads = run_on_two_fsdp_ranks_recording_dcp_loads(args, volume, tmp_path)
    assert_read_the_weights_alone(loads)
    run = volume / "runs" / RUN
    assert json.loads((run / "export" / "hf" / "manifest.json").read_text())["weights"]["step"] == 4
    # The best checkpoint's shards converted on their own (`convert` task export of step 4).
    convert = tmp_path / "convert.yaml"
    convert.write_text(json.dumps({"name": RUN, "task": [{"kind": "export", "step": 4}]}))
    converted = subprocess.run(
        trainpod_cmd("run", "convert", "--config", str(convert), volume=volume),
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert converted.returncode == ExitCode.DONE, converted.stdout + converted.stderr
    exported = safetensors.torch.load_file(run / "export" / "hf" / "model.safetensors")
    step_4 = safetensors.torch.load_file(run / "export" / "hf-step-4" / "model.safetensors")
    differing = [name for name in exported if not torch.equal(exported[name], step_4[name])]
    assert exported and not differing, f"the export is not step-4's weights: {differing[:3]} differ"


def test_a_full_finetune_on_two_fsdp_ranks_exports_the_best_checkpoints_weights_alone(
    finetune_volume: Path, tmp_path: Path
):
    args = finetune_args(*SETTINGS, "--set", "train.grad_accum_steps=1", method="full")
    loads = run_on_two_fsdp_ranks_recording_dcp_loads(args, finetune_volume, tmp_path)
    assert_read_the_weights_alone(loads)
    run = finetune_volume / "runs" / FINETUNE_RUN
    exported = safetensors.torch.load_file(next((run / "export").glob("*/model.safetensors")))
    # The shards of step 4 gathered by torch itself, as transformers names the weights.
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(run / "checkpoints" / "step-4" / "model", tmp_path / "step-4.pt")
    step_4 = {k.removeprefix("model."): v for k, v in torch.load(tmp_path / "step-4.pt")["model"].items()}
    differing = [
        name for name in exported if name in step_4 and not torch.equal(exported[name], step_4[name])
    ]
    assert exported and not differing, f"the export is not step-4's weights: {differing[:3]} differ"


def test_export_weights_best_where_no_kept_checkpoint_was_scored_exports_the_last_step_saying_so(
    volume: Path,
):
    """A run shorter than its eval_every: no eval scored a checkpoint, and the export is the last step's, as
    README says, with a warning and `chosen: last` in the export's manifest."""
    args = (
        *("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "train.warmup_steps=1"),
        *SETTINGS,
        *("--set", "train.max_steps=1", "--set", "export.weights=best"),
    )
    result = subprocess.run(
        trainpod_cmd(*args, volume=volume), env=child_env(), capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == ExitCode.DONE, output
    assert (
        "no kept checkpoint was scored by an eval at its own step; exporting the last step's weights"
        in output
    )
    manifest = json.loads((volume / "runs" / RUN / "export" / "hf" / "manifest.json").read_text())
    assert manifest["weights"] == {"chosen": "last", "step": 1}, manifest


def test_a_pretrains_export_weights_best_on_a_dataset_without_a_validation_split_is_exit_2(volume: Path):
    """No split to evaluate on: no checkpoint is ever scored, and the export was the last step's after a whole
    paid run, with a warning at its end."""
    manifest_file = volume / "datasets" / "tiny-stories" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["splits"]["val"]
    manifest_file.write_text(json.dumps(manifest))
    args = ("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "export.weights=best")
    result = subprocess.run(
        trainpod_cmd(*args, volume=volume), env=child_env(), capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == ExitCode.BAD_INPUT, output
    assert "export.weights=best needs a validation split" in output and "export.weights=last" in output
    assert not (volume / "runs" / RUN).exists(), output


def flip_a_byte(file: Path) -> None:
    """Bit rot of one byte, the size kept."""
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    file.write_bytes(bytes(data))


def export_again(volume: Path, run: Path) -> str:
    """The export made again at the next start, as after a stop during it."""
    (run / "DONE").unlink()
    shutil.rmtree(run / "export")
    return finetune(volume, "best")


def test_the_best_checkpoint_is_verified_by_the_files_its_export_reads_not_its_optimizer_state(
    finetune_volume: Path,
):
    """The verification before the export hashed the best checkpoint's every file, its optimizer state too (twice
    the weights: minutes of reads on the network volume for a large run), which the export never reads: damaged
    there, the best weights were passed over for a worse checkpoint's."""
    finetune(finetune_volume, "best")
    run = finetune_volume / "runs" / FINETUNE_RUN
    flip_a_byte(run / "checkpoints" / "step-4" / "optimizer.safetensors")
    output = export_again(finetune_volume, run)
    assert "exporting the weights of step 4" in output and "invalid" not in output, output
    assert_holds_the_weights_of(run, 4)

    flip_a_byte(run / "checkpoints" / "step-4" / "trainable.safetensors")  # what the export reads: verified
    output = export_again(finetune_volume, run)
    assert "step-4 ranks best but is invalid (trainable.safetensors does not match its sha256" in output, (
        output
    )
    assert json.loads((run / "export" / "adapter" / "manifest.json").read_text())["weights"]["step"] == 6
