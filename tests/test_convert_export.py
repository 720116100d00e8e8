"""Export: a committed pretrain checkpoint that is not the final one becomes an HF model that transformers
loads, holding exactly that step's weights; bad steps and corrupt checkpoints are exit 2.

.venv/bin/pytest -q tests/test_convert_export.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainpod.convert import run_convert
from trainpod.errors import ExitCode, InputError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume

from convert_support import convert_config
from support import RUN, TINY_PRETRAIN, run_trainpod, tree_snapshot


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory: pytest.TempPathFactory, tiny_dataset_volume: Path) -> Path:
    """A 4-step tiny pretrain run with checkpoints at steps 2 and 4 (made once for this file)."""
    import shutil

    root = tmp_path_factory.mktemp("export-volume")
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, root / folder)
    result = run_trainpod(
        "run",
        "pretrain",
        "--config",
        str(TINY_PRETRAIN),
        "--set",
        "train.max_steps=4",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "train.eval_every=0",
        "--set",
        "train.warmup_steps=1",
        volume=root,
    )
    assert result.returncode == 0, f"the tiny pretrain run failed:\n{result.stdout}\n{result.stderr}"
    return root


@pytest.fixture
def vol(pretrained: Path, tmp_path: Path) -> Volume:
    """A copy per test, so one test's outputs or corruption never reach another."""
    import shutil

    shutil.copytree(pretrained, tmp_path / "volume")
    return Volume(tmp_path / "volume")


def export(vol: Volume, **task) -> Path:
    [out] = run_convert(convert_config({"kind": "export"} | task, name=RUN), vol, PreemptionWatch())
    return out


def checkpoint_weights(vol: Volume, step: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load_file(vol.run(RUN).checkpoints / f"step-{step}" / "model.safetensors")


def test_a_non_final_checkpoint_exports_to_a_model_transformers_loads(vol: Volume) -> None:
    out = export(vol, step=2)
    assert out == vol.run(RUN).export / "hf-step-2"
    model = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    state = model.state_dict()
    stored = checkpoint_weights(vol, 2)
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor), f"{name} differs from step 2's checkpoint"
    final = checkpoint_weights(vol, 4)
    assert any(not torch.equal(stored[k], final[k]) for k in stored), "steps 2 and 4 must differ"
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    ids = tokenizer("Once upon a time", return_tensors="pt").input_ids
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3


def test_a_pretrains_export_and_a_checkpoints_carry_the_card_of_a_model_trained_from_scratch(
    vol: Volume,
) -> None:
    from huggingface_hub import ModelCard

    run = vol.run(RUN)
    done = json.loads((run.root / "DONE").read_text())
    card = ModelCard.load(run.export / "hf" / "README.md")
    assert card.data.base_model is None, "trained from scratch: no base model"
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert "trained from scratch with trainpod" in card.text and "`tiny-stories`" in card.text
    assert f"| tokens seen | {done['tokens_seen']:,} |" in card.text
    assert f"| final train loss | {done['loss']:.4f} |" in card.text
    assert f"| parameters | {done['parameters']:,} |" in card.text
    assert "README.md" in json.loads((run.export / "hf" / "manifest.json").read_text())["files"]

    out = export(vol, step=2)
    state = json.loads((run.checkpoints / "step-2" / "trainer_state.json").read_text())
    card = ModelCard.load(out / "README.md")
    assert card.data.library_name == "transformers" and card.data.base_model is None
    assert "| steps | 2 |" in card.text
    assert f"| tokens seen | {state['progress']['tokens_seen']:,} |" in card.text
    assert "README.md" in json.loads((out / "manifest.json").read_text())["files"]


def test_latest_exports_the_newest_committed_step(vol: Volume) -> None:
    out = export(vol, dtype="bfloat16")
    assert out.name == "hf-step-4"
    weights = safetensors.torch.load_file(out / "model.safetensors")
    for name, tensor in checkpoint_weights(vol, 4).items():
        assert torch.equal(weights[name], tensor.to(torch.bfloat16))


def test_exporting_again_rewrites_nothing(vol: Volume) -> None:
    out = export(vol, step=2)
    before = tree_snapshot(out)
    export(vol, step=2)
    assert tree_snapshot(out) == before
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["step"] == 2 and "checkpoint/manifest.json" in manifest["inputs"]


def tokenizer_ids(folder: Path) -> list[int]:
    return AutoTokenizer.from_pretrained(str(folder))("Once upon a time, a tiny model").input_ids


def test_a_run_exports_after_its_dataset_and_tokenizer_were_removed(vol: Volume, pretrained: Path) -> None:
    """The export found its tokenizer through the dataset's manifest: a dataset deleted after pretraining (its
    shards are gigabytes on a billed volume) made every checkpoint of the run unexportable."""
    import shutil

    final = AutoModelForCausalLM.from_pretrained(str(vol.run(RUN).export / "hf"))
    expected = tokenizer_ids(pretrained / "tokenizers" / "tiny-stories-1k")
    shutil.rmtree(vol.root / "datasets")
    shutil.rmtree(vol.root / "tokenizers")
    out = export(vol, step=2)
    assert tokenizer_ids(out) == expected
    assert AutoModelForCausalLM.from_pretrained(str(out)).config.vocab_size == final.config.vocab_size


def test_a_start_with_the_same_tokenizer_leaves_the_runs_copy_as_it_is(vol: Volume) -> None:
    """An export's inputs are known by path, size and mtime: a copy made again at every resume would have every
    finished export of the run made again (minutes for a large model) at the next convert."""
    from trainpod.context import RunContext

    kept = vol.run(RUN).tokenizer
    before = tree_snapshot(kept), {p.name: p.stat().st_mtime_ns for p in kept.iterdir()}
    ctx = RunContext(vol, vol.run(RUN), PreemptionWatch())
    ctx.carry_tokenizer(vol.tokenizer("tiny-stories-1k"), ctx.carried_tokenizer()[1])
    assert (tree_snapshot(kept), {p.name: p.stat().st_mtime_ns for p in kept.iterdir()}) == before


def test_a_run_started_before_runs_carried_their_tokenizer_exports_through_its_dataset(
    vol: Volume, pretrained: Path
) -> None:
    import shutil

    shutil.rmtree(vol.run(RUN).root / "tokenizer")
    out = export(vol, step=2)
    assert tokenizer_ids(out) == tokenizer_ids(pretrained / "tokenizers" / "tiny-stories-1k")


def test_a_step_that_is_not_committed_is_exit_2_listing_the_committed_ones(vol: Volume) -> None:
    with pytest.raises(InputError) as caught:
        export(vol, step=3)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "step-3" in str(caught.value) and "2, 4" in str(caught.value)


def test_latest_naming_a_checkpoint_that_is_gone_is_exit_2_listing_the_committed_ones(vol: Volume) -> None:
    """A step-4 folder deleted by hand (LATEST still naming it) was a FileNotFoundError traceback, exit 1."""
    import shutil

    shutil.rmtree(vol.run(RUN).checkpoints / "step-4")
    with pytest.raises(InputError) as caught:
        export(vol)
    assert "LATEST names step-4" in str(caught.value) and "committed steps: 2" in str(caught.value)


def test_a_checkpoint_removed_after_the_plan_is_exit_75_not_a_traceback(vol: Volume) -> None:
    """Another run's retention may delete the step an export of it planned while earlier tasks are made."""
    import shutil

    from trainpod.convert import plan_convert
    from trainpod.errors import TemporaryError

    plan = plan_convert(convert_config([{"kind": "export", "step": 2}], name=RUN), vol)
    shutil.rmtree(vol.run(RUN).checkpoints / "step-2")
    with pytest.raises(TemporaryError) as caught:
        plan.make(PreemptionWatch())
    assert "step-2" in str(caught.value) and "was removed" in str(caught.value)


def test_a_finetune_run_is_exit_2_saying_export_takes_pretrain_runs(vol: Volume) -> None:
    """Its config read as a pretrain one listed eight unrelated config problems instead."""
    from finetune_support import TINY_FINETUNE

    finetune_run = vol.run("tiny-finetune")
    finetune_run.create()
    finetune_run.config.write_text(TINY_FINETUNE.read_text())
    with pytest.raises(InputError) as caught:
        export(vol, run="tiny-finetune")
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "tiny-finetune is a finetune run" in str(caught.value) and "`merge` task" in str(caught.value)


def flip_a_byte_near_the_end(path: Path) -> None:
    """Damage a checkpoint file the way a bad disk would: same size, one byte changed (sha256 finds it)."""
    data = bytearray(path.read_bytes())
    data[-10] ^= 0xFF
    path.write_bytes(bytes(data))


def test_a_corrupt_checkpoint_is_exit_2_and_nothing_is_written(vol: Volume) -> None:
    weights = vol.run(RUN).checkpoints / "step-2" / "model.safetensors"
    flip_a_byte_near_the_end(weights)
    with pytest.raises(InputError) as caught:
        export(vol, step=2)
    assert "fails verification" in str(caught.value) and "sha256" in str(caught.value)
    assert not (vol.run(RUN).export / "hf-step-2").exists()
    assert not list(vol.run(RUN).export.glob("hf-step-2.tmp-*"))


def convert(vol: Volume, tasks: list[dict]) -> list[Path]:
    return run_convert(
        convert_config([{"kind": "export"} | task for task in tasks], name=RUN), vol, PreemptionWatch()
    )


def test_a_bad_export_task_is_exit_2_before_any_task_is_written(vol: Volume) -> None:
    """Each export task's step was looked up when its turn came: the tasks before it (an hour's merge, say)
    were written first, and the typo found after them."""
    with pytest.raises(InputError) as caught:
        convert(vol, [{"step": 2}, {"step": 3}])
    assert "step-3" in str(caught.value)
    assert not list(vol.run(RUN).export.glob("hf-step-2*")), "the first task was written before the check"


def test_a_corrupt_checkpoint_of_a_later_task_is_exit_2_before_any_task_is_written(vol: Volume) -> None:
    weights = vol.run(RUN).checkpoints / "step-4" / "model.safetensors"
    flip_a_byte_near_the_end(weights)
    with pytest.raises(InputError) as caught:
        convert(vol, [{"step": 2}, {"step": 4}])
    assert "step-4" in str(caught.value) and "fails verification" in str(caught.value)
    assert not list(vol.run(RUN).export.glob("hf-step-2*")), "the first task was written before the check"


def test_a_finished_export_is_not_verified_again(vol: Volume) -> None:
    """Reading every checkpoint file to skip an output that is up to date would cost as much as writing it."""
    out = export(vol, step=2)
    before = tree_snapshot(out)
    (vol.run(RUN).checkpoints / "step-2" / "optimizer.safetensors").write_bytes(b"not read")
    assert export(vol, step=2) == out and tree_snapshot(out) == before


def test_two_exports_into_the_same_folder_are_exit_2_before_anything_is_written(vol: Volume) -> None:
    """Both went to hf-step-4: the bfloat16 one replaced the float32 one, and every rerun wrote both again."""
    with pytest.raises(InputError) as caught:
        convert(vol, [{"step": 4, "dtype": "float32"}, {"step": 4, "dtype": "bfloat16"}])
    assert "tasks 1 (export, step 4, dtype float32) and 2 (export, step 4, dtype bfloat16)" in str(
        caught.value
    )
    assert "hf-step-4" in str(caught.value) and "`output`" in str(caught.value)
    assert not list(vol.run(RUN).export.glob("hf-step-4*"))


def test_an_export_named_like_another_tasks_default_folder_is_exit_2(vol: Volume) -> None:
    with pytest.raises(InputError) as caught:
        convert(vol, [{"step": 2, "output": "hf-step-4"}, {"step": 4}])
    assert "tasks 1 (export, step 2" in str(caught.value)


def test_two_tasks_naming_the_same_export_differently_make_it_once(vol: Volume) -> None:
    outputs = convert(vol, [{"step": 4}, {"step": "latest", "dtype": "float32"}])
    assert outputs == [vol.run(RUN).export / "hf-step-4"] * 2
    before = tree_snapshot(outputs[0])
    convert(vol, [{"step": 4}, {"step": "latest", "dtype": "float32"}])
    assert tree_snapshot(outputs[0]) == before, "a rerun rewrote the export"


def run_convert_workload(vol: Volume, tmp_path: Path, name: str, task: dict):
    config = tmp_path / "convert.yaml"
    config.write_text(json.dumps({"name": name, "task": [{"kind": "export"} | task]}))
    return run_trainpod("run", "convert", "--config", str(config), volume=vol.root)


def test_a_bad_input_is_exit_2_while_a_training_run_holds_the_lease(vol: Volume, tmp_path: Path) -> None:
    """The lease was taken before the inputs were checked: a typo was exit 75, 'leased by another writer',
    at every start of the convert pod until the training run ended, and only then exit 2."""
    from trainpod.checkpoint import Lease

    training = Lease(vol.run(RUN).lease)
    training.acquire()
    try:
        result = run_convert_workload(vol, tmp_path, RUN, {"step": 3})
    finally:
        training.release()
    assert result.returncode == ExitCode.BAD_INPUT, result.stdout + result.stderr
    assert "step-3" in result.stdout and "leased" not in result.stdout


def test_a_misspelt_run_name_is_exit_2_and_leaves_no_run_folder(vol: Volume, tmp_path: Path) -> None:
    result = run_convert_workload(vol, tmp_path, "tiny-pretrian", {"step": 2})
    assert result.returncode == ExitCode.BAD_INPUT, result.stdout + result.stderr
    assert "tiny-pretrian" in result.stdout
    assert not vol.run("tiny-pretrian").root.exists(), "an empty run folder was left under the typo"


def test_another_runs_step_is_not_exported_over_a_finished_export_of_the_same_step(vol: Volume) -> None:
    """One convert config collecting several runs' exports: run B's step 2 went to hf-step-2, replacing
    run A's export of its step 2 without a word (and A's weights, once its retention had deleted step-2)."""
    import shutil

    shutil.copytree(vol.run(RUN).root, vol.run("other-pretrain").root)
    collect = {"name": "collected"}
    [first] = run_convert(
        convert_config({"kind": "export", "run": RUN, "step": 2}, **collect), vol, PreemptionWatch()
    )
    before = tree_snapshot(first)
    with pytest.raises(InputError) as caught:
        run_convert(
            convert_config({"kind": "export", "run": "other-pretrain", "step": 2}, **collect),
            vol,
            PreemptionWatch(),
        )
    assert "holds the export of another run's step 2" in str(caught.value)
    assert "hf-other-pretrain-step-2" in str(caught.value)
    assert tree_snapshot(first) == before
    [again] = run_convert(
        convert_config({"kind": "export", "run": RUN, "step": 2, "dtype": "bfloat16"}, **collect),
        vol,
        PreemptionWatch(),
    )
    assert again == first, "the same run's step in another dtype is made again in its place"
    shutil.move(vol.root, vol.root.with_name("mounted-elsewhere"))  # another pod mounts the volume elsewhere
    elsewhere = Volume(vol.root.with_name("mounted-elsewhere"))
    [moved] = run_convert(
        convert_config({"kind": "export", "run": RUN, "step": 2}, **collect), elsewhere, PreemptionWatch()
    )
    assert moved == elsewhere.run("collected").export / "hf-step-2"


def test_a_training_export_carries_a_manifest_that_pull_checks_every_file_by(tmp_path: Path) -> None:
    # RunPod's S3 ETags may be no MD5s: without a manifest, `trainpod pull` could check export/hf by size alone.
    from trainpod import atomic
    from trainpod.remote.pull import manifest_expectations
    from trainpod.train.export import export_hf

    from convert_support import llama_config, save_tokenizer

    tokenizer = tmp_path / "tokenizer"
    save_tokenizer(tokenizer)
    target = export_hf(
        AutoModelForCausalLM.from_config(llama_config()), tokenizer, tmp_path / "hf", torch.float32
    )
    manifest = atomic.read_json(target / "manifest.json")
    on_disk = sorted(p.name for p in target.iterdir() if p.name != "manifest.json")
    assert sorted(manifest["files"]) == on_disk and "model.safetensors" in on_disk
    expected = manifest_expectations("export/hf/manifest.json", manifest)
    for name in on_disk:
        assert expected[f"export/hf/{name}"].matches(target / name)
    assert AutoModelForCausalLM.from_pretrained(target) is not None, "the manifest does not disturb loading"
    (target / "config.json").write_text("{}")  # a file changed after the export no longer matches
    assert not expected["export/hf/config.json"].matches(target / "config.json")


def test_a_sharded_fsdp_checkpoint_exports_as_its_run_exported_that_step(
    tmp_path, tiny_dataset_volume
) -> None:
    """README: `export` converts any committed pretrain checkpoint. One an FSDP run wrote (train.parallel=fsdp, what
    `auto` picks for 1B parameters or more on several GPUs) holds its weights in DCP shards, no model.safetensors:
    the export read that file and crashed (FileNotFoundError, a traceback and exit 1), though such a long run is
    where a user exports an earlier (best) step."""
    import shutil

    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, tmp_path / "volume" / folder)
    settings = ("train.max_steps=4", "checkpoint.every_steps=2", "train.eval_every=0", "train.warmup_steps=1")
    args = [arg for setting in (*settings, "train.parallel=fsdp") for arg in ("--set", setting)]
    result = run_trainpod(
        "run", "pretrain", "--config", str(TINY_PRETRAIN), *args, volume=tmp_path / "volume"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    vol = Volume(tmp_path / "volume")
    assert not (vol.run(RUN).checkpoints / "step-2" / "model.safetensors").exists(), "no sharded checkpoint"

    final = safetensors.torch.load_file(vol.run(RUN).export / "hf" / "model.safetensors")
    at_4 = safetensors.torch.load_file(export(vol, step=4) / "model.safetensors")
    assert at_4.keys() == final.keys() and all(torch.equal(at_4[k], final[k]) for k in final), (
        "step 4's shards, exported, must be the weights the run itself exported at step 4"
    )
    model = AutoModelForCausalLM.from_pretrained(str(export(vol, step=2)), dtype=torch.float32)
    assert any(not torch.equal(model.state_dict()[k], final[k]) for k in final), "steps 2 and 4 must differ"


def test_a_step_whose_optimizer_state_is_damaged_exports_its_intact_weights(vol: Volume) -> None:
    """The verification hashed the optimizer state too (twice the weights: minutes of reads on the network volume
    for a large run), which an export never reads, and refused the step for it (exit 2) though its weights were
    whole."""
    flip_a_byte_near_the_end(vol.run(RUN).checkpoints / "step-2" / "optimizer.safetensors")
    weights = safetensors.torch.load_file(export(vol, step=2) / "model.safetensors")
    for name, tensor in checkpoint_weights(vol, 2).items():
        assert torch.equal(weights[name], tensor), f"{name} differs from step 2's checkpoint"
