"""DPO as a user runs it (`objective: dpo` in a finetune config): the exported adapter, loaded by peft on its base,
prefers the chosen answers more than the base does; a run stopped like a spot pod resumes to the same adapter
bytes; what DPO here does not do is exit 2 before anything is written."""

from __future__ import annotations

import json
import math
import re
import shutil
import signal
from pathlib import Path

import pytest
import torch

from trainpod.config import load_config
from trainpod.config.finetune import FinetuneConfig
from trainpod.config.loader import SET_FLAG
from trainpod.errors import ConfigError

from finetune_support import BASE
from support import CONFIGS, run_trainpod, signal_when_step_reached, start_trainpod

pytestmark = pytest.mark.slow

TINY_DPO = CONFIGS / "finetune/tiny-dpo.yaml"
RUN = "tiny-dpo"


def dpo_args(*extra: str) -> tuple[str, ...]:
    """The shipped tiny DPO config on the test's base model (the embedded preference pairs as they ship)."""
    return ("run", "finetune", "--config", str(TINY_DPO), "--set", f"base_model.path={BASE}", *extra)


@pytest.fixture
def volume(finetune_base_volume: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, copy)
    return copy


@pytest.fixture(scope="module")
def trained(finetune_base_volume: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A volume with tiny-dpo trained to its end, uninterrupted."""
    volume = tmp_path_factory.mktemp("dpo-uninterrupted")
    shutil.copytree(finetune_base_volume, volume, dirs_exist_ok=True)
    result = run_trainpod(*dpo_args(), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    return volume


def adapter_bytes(volume: Path) -> bytes:
    return (volume / "runs" / RUN / "export" / "adapter" / "adapter_model.safetensors").read_bytes()


def _answer_logps(model, pairs) -> torch.Tensor:
    """Each pair's log p(chosen) - log p(rejected) under `model`, over the answers' tokens, by a plain forward."""
    margins = []
    for chosen, rejected in pairs:
        totals = []
        for sample in (chosen, rejected):
            ids = torch.from_numpy(sample.input_ids)[None]
            labels = torch.from_numpy(sample.labels)[None]
            with torch.no_grad():
                logps = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1)
            targets = labels[:, 1:]
            trained = targets != -100
            totals.append((logps.gather(2, targets.where(trained, 0)[..., None]).squeeze(2) * trained).sum())
        margins.append(totals[0] - totals[1])
    return torch.stack(margins)


def test_the_exported_adapter_prefers_the_chosen_answers_more_than_its_base_does(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from trainpod.sft.dataset import PreferencePairs, load_sft

    run = trained / "runs" / RUN
    adapter = run / "export" / "adapter"
    summary = json.loads((adapter / "training_summary.json").read_text())
    assert summary["objective"] == "dpo" and summary["dpo"]["beta"] == 0.1
    assert summary["data"]["train_pairs"] > 300 and summary["results"]["step"] == 20

    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    evals = [row for row in rows if "eval_loss" in row]
    assert [row["step"] for row in evals] == [10, 20]
    # Before any step the policy is the reference: every pair's loss is log 2. The evals must beat that.
    assert evals[-1]["eval_loss"] < math.log(2) and evals[-1]["eval_rewards_accuracy"] > 0.5
    assert all("rewards_margin" in row for row in rows if row["step"] % 5 == 0)
    worst = [json.loads(line) for line in (run / "eval" / "step-20.worst.jsonl").read_text().splitlines()]
    assert len(worst) == 5 and {"prompt", "chosen", "rejected", "loss"} <= set(worst[0])

    # Independently of the trainer's own loss: peft loads the adapter on its base, and on the validation pairs the
    # chosen answer gained on the rejected one against the base.
    data = load_sft(next((trained / "cache" / "sft").iterdir()))
    pairs = [PreferencePairs(data.val)[i] for i in range(min(len(PreferencePairs(data.val)), 12))]
    base = AutoModelForCausalLM.from_pretrained(trained / BASE)
    before = _answer_logps(base, pairs)
    tuned = PeftModel.from_pretrained(base, adapter)
    after = _answer_logps(tuned, pairs)
    assert (after - before).mean() > 0, (before, after)


def test_status_shows_the_latest_evals_reward_accuracy_in_percent_as_the_log_does(trained):
    result = run_trainpod("status", RUN, volume=trained)
    assert result.returncode == 0, result.stdout + result.stderr
    assert re.search(r"rewards_accuracy \d+\.\d%, .*\(step 20\)", result.stdout), result.stdout


def test_the_dpo_adapter_merges_into_a_model_whose_card_says_dpo(trained, tmp_path):
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    config = tmp_path / "convert.yaml"
    config.write_text(f"name: {RUN}\nadapter: run:{RUN}\nbase_model: {BASE}\ntask:\n  - kind: merge\n")
    result = run_trainpod("run", "convert", "--config", str(config), volume=trained)
    assert result.returncode == 0, result.stdout + result.stderr
    merged = trained / "runs" / RUN / "export" / "merged"
    assert AutoModelForCausalLM.from_pretrained(merged).config.model_type == "llama"
    card = ModelCard.load(merged / "README.md")
    assert "dpo" in card.data.tags
    assert "DPO with beta 0.1" in card.text and "training preference pairs" in card.text


@pytest.mark.parametrize(("objective", "method"), [("orpo", "full"), ("simpo", "lora")])
def test_reference_free_objectives_learn_the_preference_with_any_method(volume, objective, method):
    """ORPO and SimPO need no reference model, so a full finetune takes them (DPO refuses it); the export's
    model card names the objective."""
    from huggingface_hub import ModelCard
    from transformers import AutoModelForCausalLM

    result = run_trainpod(
        *dpo_args("--set", f"objective={objective}", "--set", f"method={method}"), volume=volume
    )
    assert result.returncode == 0, result.stdout + result.stderr
    name = {"orpo": "ORPO", "simpo": "SimPO"}[objective]  # as the papers write them
    assert f"{name}: " in result.stdout and "no reference model" in result.stdout
    run = volume / "runs" / RUN
    rows = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    first, last = [row for row in rows if "eval_loss" in row]
    assert last["eval_loss"] < first["eval_loss"] and last["eval_rewards_accuracy"] > 0.5, (first, last)
    export = run / "export" / ("hf" if method == "full" else "adapter")
    summary = json.loads((export / "training_summary.json").read_text())
    assert summary["objective"] == objective and "beta" in summary[objective]
    card = ModelCard.load(export / "README.md")  # the Hub lists it under its objective, as TRL's models
    assert card.data.tags == ["trainpod", method, objective] and f"{name} with beta" in card.text
    assert card.data.library_name == ("transformers" if method == "full" else "peft")
    if method == "full":
        assert AutoModelForCausalLM.from_pretrained(export).config.model_type == "llama"


def test_a_dpo_run_stopped_like_a_spot_pod_resumes_to_the_same_adapter(volume, trained):
    proc = start_trainpod(*dpo_args(), volume=volume)
    out = signal_when_step_reached(proc, volume, 7, signal.SIGTERM, run=RUN)
    assert proc.returncode == 143, out
    result = run_trainpod(*dpo_args(), volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "resumed from step-" in result.stdout + result.stderr
    assert adapter_bytes(volume) == adapter_bytes(trained)
    card = Path("runs", RUN, "export", "adapter", "README.md")
    assert (volume / card).read_bytes() == (trained / card).read_bytes(), "the card holds no time of its own"


def test_a_dpo_run_stopped_on_two_ranks_resumes_on_one_to_the_adapter_of_the_one_rank_run(volume, trained):
    """Two gloo ranks, one micro batch each a step, stopped like a spot pod; resumed on one rank, which takes the
    two micro batches a step (accumulation rescaled): every step's loss is the mean over all its pairs, the
    ranks' gradients summed by DDP and the rank's accumulated alike, and the data position counts pairs, so the
    adapter is the one of the run that trained on one rank with accumulation 2 throughout."""
    one_a_step = ("--set", "train.grad_accum_steps=1")
    proc = start_trainpod(*dpo_args(*one_a_step), "--nproc-per-node", "2", volume=volume)
    out = signal_when_step_reached(proc, volume, 7, signal.SIGTERM, run=RUN)
    assert proc.returncode == 143, out
    result = run_trainpod(*dpo_args(*one_a_step), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    assert "the checkpoint was written by 2 rank(s); on 1, train.grad_accum_steps becomes 2" in output, output
    assert adapter_bytes(volume) == adapter_bytes(trained)


@pytest.mark.parametrize(
    ("setting", "named"),
    [
        ("method=full", "method: lora"),
        ("data.sft.preference=false", "data.sft.preference: true"),  # SFT data, which DPO cannot train on
        ("generation_eval.every_evals=1", "generation_eval.every_evals=0"),
        ("dpo.loss=ipo", "dpo.label_smoothing"),
    ],
)
def test_what_dpo_here_does_not_do_is_exit_2_before_anything_is_written(volume, setting, named):
    extra = {
        "dpo.loss=ipo": ("--set", "dpo.label_smoothing=0.1"),
        "data.sft.preference=false": ("--set", 'data.sft.datasets=[{"path": "builtin:sft-tiny"}]'),
    }.get(setting, ())
    result = run_trainpod(*dpo_args("--set", setting, *extra), volume=volume)
    assert result.returncode == 2, result.stdout + result.stderr
    assert named in result.stdout + result.stderr
    assert not (volume / "runs" / RUN).exists() and not (volume / "cache").exists()


@pytest.mark.parametrize(
    ("overrides", "fix"),
    [
        (["train.early_stopping_metric=cer"], "set train.early_stopping_metric: eval_loss"),
        (
            ["train.early_stopping_metric=cer", "generation_eval.every_evals=1"],
            "set train.early_stopping_metric: eval_loss, and generation_eval.every_evals=0",
        ),
        (["train.parallel=fsdp"], "set train.parallel: ddp (or auto)"),
    ],
)
def test_an_sft_setting_dpo_cannot_take_is_refused_with_a_fix_that_dpo_takes(overrides, fix):
    """The SFT refusals' fixes, generation_eval on for a generation metric and method full for fsdp, are what DPO
    refuses: a user who followed one was refused by the other, back and forth."""
    with pytest.raises(ConfigError) as caught:
        load_config(FinetuneConfig, TINY_DPO, overrides, SET_FLAG)
    [problem] = caught.value.problems
    assert fix in problem, problem
    assert "every_evals to 1" not in problem and "method: full" not in problem


def test_dpo_settings_in_an_sft_config_are_refused_not_ignored():
    """A `dpo:` section without `objective: dpo` (the objective forgotten) trained SFT with the section unread."""
    with pytest.raises(ConfigError) as caught:
        load_config(FinetuneConfig, CONFIGS / "finetune/tiny.yaml", ["dpo.beta=0.2"], SET_FLAG)
    [problem] = caught.value.problems
    assert "applies to objective=dpo" in problem and "set objective: dpo" in problem, problem


def test_early_stopping_with_a_val_ratio_that_held_out_no_pair_names_the_pairs_and_the_share_of_one(volume):
    """val_ratio picks rows, a pair's two samples together: the refusal counted the samples, twice the pairs, and
    its 'a share of at least 1/<samples> holds out one sample' held out half a pair."""
    settings = ("--set", "data.sft.val_ratio=0.001", "--set", "train.early_stopping_patience=2")
    result = run_trainpod(*dpo_args(*settings), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    [dataset] = (volume / "cache" / "sft").iterdir()
    pairs = json.loads((dataset / "manifest.json").read_text())["counts"]["train_pairs"]
    assert f"data.sft.val_ratio=0.001 held out none of the {pairs} pairs" in output, output
    assert f"a share of at least 1/{pairs} holds out one pair" in output, output
    assert not list((volume / "runs" / RUN).glob("checkpoints/step-*")), "no step may have trained"


def test_sft_on_preference_pairs_is_exit_2_naming_each_preference_objective(volume):
    result = run_trainpod(
        *dpo_args("--set", "objective=sft", "--set", "lora.dropout=0.05"),
        volume=volume,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "set objective: dpo, orpo or simpo" in result.stdout + result.stderr
