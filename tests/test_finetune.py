"""The finetune workload as a user runs it: outputs that peft/transformers load, eval reports,
early stopping, the budget, W&B (offline), bad input, and the kit's own pretrain export as base."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

from finetune_support import BASE, FINETUNE_RUN, SFT_FILE, TINY_FINETUNE, finetune_args, latest_step
from sft_support import key_before_encodings_were_recorded, write_alpaca_jsonl
from support import TINY_PRETRAIN, run_trainpod, signal_when_step_reached, start_trainpod, tree_snapshot

pytestmark = pytest.mark.slow


@pytest.fixture
def volume(finetune_base_volume: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, copy)
    return copy


def run_dir(volume: Path) -> Path:
    return volume / "runs" / FINETUNE_RUN


def ok(result) -> str:
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def test_qlora_adapter_loads_in_peft_with_the_tokenizer_summary_and_eval_reports(volume):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    output = ok(run_trainpod(*finetune_args(), volume=volume))
    # The console is a pod's log: no per-tensor progress bar, no library deprecation the user can't act on.
    assert "Loading weights" not in output and "FutureWarning" not in output, output
    adapter = run_dir(volume) / "export" / "adapter"
    summary = json.loads((adapter / "training_summary.json").read_text())
    assert summary["method"] == "qlora"
    assert summary["base_model"] == BASE
    assert summary["quantization"] == {"quant_type": "nf4", "double_quant": True, "compute_dtype": "float32"}
    assert summary["results"]["step"] == 30

    base = AutoModelForCausalLM.from_pretrained(volume / BASE)
    tuned = PeftModel.from_pretrained(base, adapter)
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    inputs = tokenizer("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n", return_tensors="pt")
    with torch.no_grad():
        out = tuned.generate(**inputs, max_new_tokens=4, do_sample=False, pad_token_id=tokenizer.pad_token_id)
    assert out.shape[1] == inputs["input_ids"].shape[1] + 4
    lora_b = [p for n, p in tuned.named_parameters() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b), "the exported adapter must hold trained weights"

    worst = (run_dir(volume) / "eval" / "step-30.worst.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in worst]
    assert len(records) == 5
    assert [r["loss"] for r in records] == sorted((r["loss"] for r in records), reverse=True)
    assert all(r["answer"] and "<|im_start|>assistant" in r["prompt"] for r in records)
    assert list((run_dir(volume) / "tensorboard").glob("events.out.tfevents.*"))
    done = json.loads((run_dir(volume) / "DONE").read_text())
    assert done["eval_loss"] == pytest.approx(summary["results"]["eval_loss"])
    assert 0 < done["packing_efficiency"] <= 1


HUB_BASE = "org/tiny-base"
HUB_COMMIT = "0123456789abcdef0123456789abcdef01234567"


def as_hub_download(volume: Path) -> None:
    """The test's base model as the volume's cache/hf holds a download of the hub id HUB_BASE at HUB_COMMIT,
    which a run with HF_HUB_OFFLINE=1 takes from there as it would from the Hub."""
    repo = volume / "cache" / "hf" / f"models--{HUB_BASE.replace('/', '--')}"
    shutil.copytree(volume / BASE, repo / "snapshots" / HUB_COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(HUB_COMMIT)


def test_lora_and_full_finetunes_export_what_peft_and_transformers_load_with_the_card_a_push_sends(
    volume, monkeypatch
):
    from huggingface_hub import ModelCard, constants
    from peft import PeftConfig
    from transformers import AutoModelForCausalLM

    from trainpod.config.convert import ConvertConfig
    from trainpod.config.loader import validate_tree
    from trainpod.convert import run_convert
    from trainpod.preemption import PreemptionWatch
    from trainpod.volume import Volume

    from fake_hub import running_hub

    steps = ("--set", "train.max_steps=4", "--set", "train.eval_every=2")
    as_hub_download(volume)
    hub_base = ("--set", f"base_model.path={HUB_BASE}")
    ok(
        run_trainpod(
            *finetune_args(*steps, *hub_base, method="lora"), volume=volume, env={"HF_HUB_OFFLINE": "1"}
        )
    )
    adapter = run_dir(volume) / "export" / "adapter"
    config = PeftConfig.from_pretrained(adapter)
    assert config.r == 8 and config.lora_alpha == 16
    # In place of peft's template ("[More Information Needed]"): the Hub lists it among its base's adapters.
    card = ModelCard.load(adapter / "README.md")
    assert card.data.library_name == "peft" and card.data.pipeline_tag == "text-generation"
    assert card.data.base_model == HUB_BASE and card.data.base_model_relation == "adapter"
    assert f"`{HUB_BASE}` at commit `{HUB_COMMIT}`" in card.text and "AutoPeftModelForCausalLM" in card.text
    assert "More Information Needed" not in card.text and "| steps | 4 |" in card.text

    ok(run_trainpod(*finetune_args(*steps, "--run", "full-run", method="full"), volume=volume))
    exported = volume / "runs" / "full-run" / "export" / "hf"
    model = AutoModelForCausalLM.from_pretrained(exported)
    base = AutoModelForCausalLM.from_pretrained(volume / BASE)
    moved = [
        name
        for name, p in model.named_parameters()
        if not torch.equal(p, dict(base.named_parameters())[name])
    ]
    assert len(moved) == len(list(model.parameters())), "a full finetune trains every weight"
    assert json.loads((exported / "training_summary.json").read_text())["method"] == "full"
    card = ModelCard.load(exported / "README.md")
    assert card.data.base_model is None, "a base on the volume is no Hub model to link to"
    assert card.data.library_name == "transformers" and card.data.tags == ["trainpod", "full"]
    assert "full finetune" in card.text and "AutoModelForCausalLM.from_pretrained" in card.text

    # Each export's manifest lists its card, so that a hub task pushes it.
    token = "fake-write-token-for-the-fake-hub"
    with running_hub({token: "write"}) as hub:
        monkeypatch.setattr(constants, "ENDPOINT", hub.url)
        monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)
        monkeypatch.setenv("HF_TOKEN", token)
        for run, source in ((FINETUNE_RUN, "adapter"), ("full-run", "hf")):
            task = {"kind": "hub", "source": source, "repo_id": f"someone/{source}"}
            config = validate_tree(ConvertConfig, {"name": run, "task": [task]})
            run_convert(config, Volume(volume), PreemptionWatch())
        pushed = {repo: hub.repos[f"someone/{repo}"].tree("main") for repo in ("adapter", "hf")}
    assert pushed["adapter"]["README.md"] == (adapter / "README.md").read_bytes()
    assert pushed["hf"]["README.md"] == (exported / "README.md").read_bytes()
    assert [card["library_name"] for card in hub.model_cards] == ["peft", "transformers"]


def test_an_eval_plateau_stops_early_commits_and_exports(volume):
    plateau = (
        "--set",
        "train.eval_every=5",
        "--set",
        "train.early_stopping_patience=2",
        "--set",
        "train.early_stopping_min_delta=100",  # no eval can beat the best by 100: every one is a plateau
    )
    output = ok(run_trainpod(*finetune_args(*plateau), volume=volume))
    done = json.loads((run_dir(volume) / "DONE").read_text())
    assert done["step"] == 15, "the first eval sets the best, two more without improvement stop"
    assert "has not improved" in done["finished_early"]
    assert "stopping early at step 15" in output
    assert latest_step(volume) == 15
    assert (run_dir(volume) / "export" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_spent_budget_commits_and_exits_3_and_a_restart_does_not_train_on(volume):
    budget = {"TRAINPOD_GPU_HOURLY_USD": "3600", "TRAINPOD_BUDGET_USD": "0.3"}  # $1 per second of training
    result = run_trainpod(*finetune_args(), volume=volume, env=budget)
    output = result.stdout + result.stderr
    assert result.returncode == 3, output
    assert "90% of TRAINPOD_BUDGET_USD spent" in output
    step = latest_step(volume)
    assert 0 < step < 30, "the budget stop commits the step it stopped at"
    status = json.loads((run_dir(volume) / "status.json").read_text())
    assert status["state"] == "stopped" and status["step"] == step
    assert not (run_dir(volume) / "DONE").exists()
    again = run_trainpod(*finetune_args(), volume=volume, env=budget)
    assert again.returncode == 3, again.stdout + again.stderr
    assert latest_step(volume) in (step, step + 1), "a spent budget allows at most the step in flight"


def test_wandb_offline_resumed_run_keeps_its_run_id_and_the_key_stays_out_of_files(volume, tmp_path):
    secret = "wandb-key-4f1c9e-must-not-leak"
    env = {"WANDB_MODE": "offline", "WANDB_API_KEY": secret, "WANDB_SILENT": "true", "HOME": str(tmp_path)}
    proc = start_trainpod(*finetune_args(), volume=volume, env=env)
    first = signal_when_step_reached(proc, volume, 12, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, first
    state = json.loads(
        (run_dir(volume) / "checkpoints" / f"step-{latest_step(volume)}" / "trainer_state.json").read_text()
    )
    run_id = state["tracker"]["wandb_run_id"]
    assert run_id
    second = run_trainpod(*finetune_args(), volume=volume, env=env)
    ok(second)
    assert json.loads((run_dir(volume) / "DONE").read_text())["wandb_run_id"] == run_id
    offline_runs = sorted((run_dir(volume) / "wandb").glob("offline-run-*"))
    assert len(offline_runs) == 2 and all(p.name.endswith(run_id) for p in offline_runs)
    assert secret not in first + second.stdout + second.stderr
    for path in volume.rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), f"the W&B key leaked into {path}"


def test_a_missing_base_model_is_exit_2_naming_the_field_and_nothing_is_written(volume):
    before = tree_snapshot(volume)
    result = run_trainpod(*finetune_args("--set", "base_model.path=models/nope"), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "base_model.path='models/nope'" in output and "config.json" in output
    assert tree_snapshot(volume) == before


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("data.sft.val_ratio=0", "train.early_stopping_patience=3 needs a validation split"),
        ("train.eval_every=0", "train.early_stopping_patience=3 never acts with train.eval_every=0"),
    ],
)
def test_early_stopping_that_could_never_act_is_exit_2_before_anything_is_written(volume, setting, message):
    """It trained, silently, to the last paid step."""
    before = tree_snapshot(volume)
    settings = ("--set", "train.early_stopping_patience=3", "--set", setting)
    result = run_trainpod(*finetune_args(*settings), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert message in output and "Traceback" not in output
    assert tree_snapshot(volume) == before


def test_a_base_model_without_sdpa_finetunes_with_an_attention_it_implements(volume):
    """Gemma 2 implements no SDPA: `auto` asked for it anyway and transformers raised ValueError while the
    model loaded, exit 1 at every start."""
    from transformers import AutoTokenizer, Gemma2Config, Gemma2ForCausalLM

    folder = volume / BASE
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    for weights in folder.glob("model*.safetensors"):
        weights.unlink()
    Gemma2ForCausalLM(config).save_pretrained(folder)
    steps = ("--set", "train.max_steps=2", "--set", "train.eval_every=0")
    output = ok(run_trainpod(*finetune_args(*steps, method="lora"), volume=volume))
    assert "attention eager" in output

    result = run_trainpod(
        *finetune_args(*steps, "--set", "base_model.attention=sdpa", "--run", "sdpa-run", method="lora"),
        volume=volume,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "base_model.attention=sdpa: the model does not implement it" in result.stdout + result.stderr


def test_packing_on_a_model_that_mixes_packed_samples_is_exit_2_before_data_or_training(volume):
    """An OPT (or Mamba-like) base reads a packed row across its samples: the run went through, each sample
    trained partly on its neighbour's text, with no word. Now exit 2 naming the setting and the fix."""
    from transformers import AutoTokenizer, OPTConfig, OPTForCausalLM

    folder = volume / BASE
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = OPTConfig(
        vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=32, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    for weights in folder.glob("model*.safetensors"):
        weights.unlink()
    OPTForCausalLM(config).save_pretrained(folder)
    result = run_trainpod(*finetune_args("--set", "train.max_steps=2", method="lora"), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert (
        "data.sft.packing=true: the base model (opt) carries" in output and "set data.packing=false" in output
    )
    assert "Traceback" not in output
    assert not list(volume.glob("cache/sft/*")), "the SFT data is not prepared for a run refused"
    assert not list(run_dir(volume).glob("checkpoints/step-*"))

    steps = ("--set", "train.max_steps=2", "--set", "train.eval_every=0", "--set", "data.packing=false")
    assert "step 2" in ok(run_trainpod(*finetune_args(*steps, method="lora"), volume=volume))


LEAKY_MODEL_CODE = """from transformers import OPTConfig, OPTForCausalLM


class LeakyConfig(OPTConfig):
    model_type = "leaky_opt"


class LeakyForCausalLM(OPTForCausalLM):
    config_class = LeakyConfig
"""


def test_remote_code_that_mixes_packed_samples_is_exit_2_before_a_step_leaving_the_volume(volume):
    """A model type the list of known leaking types lacks (here remote code: OPT under another name) went
    through with packing, each sample trained partly on its neighbour. The probe runs it on a packed row
    before the first step: exit 2 naming the setting, the type and the fix; nothing on the volume changed."""
    import importlib.util

    from transformers import AutoTokenizer

    folder = volume / BASE
    (folder / "leaky.py").write_text(LEAKY_MODEL_CODE)
    spec = importlib.util.spec_from_file_location("leaky", folder / "leaky.py")
    leaky = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(leaky)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = leaky.LeakyConfig(
        vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=256, word_embed_proj_dim=32, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        auto_map={"AutoConfig": "leaky.LeakyConfig", "AutoModelForCausalLM": "leaky.LeakyForCausalLM"},
    )  # fmt: skip
    for weights in folder.glob("model*.safetensors"):
        weights.unlink()
    torch.manual_seed(0)
    leaky.LeakyForCausalLM(config).save_pretrained(folder)
    before = tree_snapshot(volume)
    remote = ("--set", "base_model.trust_remote_code=true", "--set", "train.max_steps=2")
    result = run_trainpod(*finetune_args(*remote, method="lora"), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "data.sft.packing=true: the base model (leaky_opt, attention sdpa) reads one" in output
    assert "set data.packing=false" in output and "Traceback" not in output
    after = tree_snapshot(volume)
    assert {path: after.get(path) for path in before} == before, "the refusal changed the volume"
    assert not list(run_dir(volume).glob("checkpoints/step-*"))
    assert not list((run_dir(volume) / "export").iterdir())

    steps = ("--set", "train.eval_every=0", "--set", "data.packing=false")
    assert "step 2" in ok(run_trainpod(*finetune_args(*remote, *steps, method="lora"), volume=volume))


def test_early_stopping_with_a_val_ratio_that_held_out_no_sample_is_exit_2_before_training(volume):
    """val_ratio 0.002 of 240 rows picks none of them: no eval ever ran, so early stopping never acted and the
    run trained, silently, to its last paid step."""
    settings = ("--set", "data.sft.val_ratio=0.002", "--set", "train.early_stopping_patience=2")
    result = run_trainpod(*finetune_args(*settings, method="lora"), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "data.sft.val_ratio=0.002 held out none of the 240 samples" in output, output
    assert "Traceback" not in output
    assert not list(run_dir(volume).glob("checkpoints/step-*")), "no step may have trained"


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (("train.parallel=fsdp",), "train.parallel=fsdp shards full finetuning; method qlora"),
        (
            ("method=full", "train.parallel=fsdp", "train.optimizer=adamw_8bit"),
            "cannot step the sharded parameters",
        ),
        (
            ("method=full", "train.parallel=fsdp", "generation_eval.every_evals=1"),
            "generation_eval runs on rank 0 alone",
        ),
    ],
)
def test_what_fsdp_cannot_do_is_exit_2_before_anything_is_written(volume, settings, message):
    """README: fsdp with an 8-bit optimizer is exit 2; so is fsdp for an adapter. Both were found only once the
    base model had loaded (a download of GBs on a paid GPU), after the run folder, lease and config were written."""
    before = tree_snapshot(volume)
    result = run_trainpod(*finetune_args(*(arg for s in settings for arg in ("--set", s))), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert message in output and "Traceback" not in output
    assert tree_snapshot(volume) == before


def test_tracking_asked_for_without_wandb_installed_is_exit_2_before_anything_is_written(volume, tmp_path):
    """wandb is an extra (trainpod[tracking]; the image has it): hidden from the child here, as on a machine
    without it, the key in the environment is refused at preflight, and never printed."""
    hidden = tmp_path / "no-wandb"
    hidden.mkdir()
    (hidden / "sitecustomize.py").write_text("import sys\nsys.modules['wandb'] = None\n")
    secret = "wandb-key-9d2e-must-not-leak"
    path = os.pathsep.join(filter(None, [str(hidden), os.environ.get("PYTHONPATH")]))
    before = tree_snapshot(volume)
    result = run_trainpod(*finetune_args(), volume=volume, env={"WANDB_API_KEY": secret, "PYTHONPATH": path})
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "WANDB_API_KEY is set" in output and "wandb is not installed" in output and secret not in output
    assert tree_snapshot(volume) == before


def test_a_new_run_on_edited_sft_data_tokenizes_the_data_anew(volume):
    """cache/sft/<key> is keyed by the data files too (README): a run after the data file was edited was
    refused, exit 2, for a cache "built from other contents", telling the user to pick a dataset name."""
    steps = ("--set", "train.max_steps=1", "--set", "train.eval_every=0")
    ok(run_trainpod(*finetune_args(*steps, method="lora"), volume=volume))
    write_alpaca_jsonl(volume / SFT_FILE, 250, seed=4)  # more rows, other rows
    ok(run_trainpod(*finetune_args(*steps, "--set", "name=edited-data", method="lora"), volume=volume))
    rows = sorted(
        json.loads(m.read_text())["counts"]["rows"] for m in volume.glob("cache/sft/*/manifest.json")
    )
    assert rows == [240, 250]


def test_a_resume_trains_on_the_data_its_first_start_tokenized_though_the_file_went_or_changed(volume):
    """The cache is keyed by the data files' contents: a resume after the file was removed found no key
    (exit 2), and one after it was edited would have trained on other samples from the middle of its epoch."""
    args = finetune_args("--set", "train.max_steps=6", "--set", "checkpoint.every_steps=1", method="lora")
    proc = start_trainpod(*args, volume=volume)
    first = signal_when_step_reached(proc, volume, 2, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, first
    (volume / SFT_FILE).unlink()
    proc = start_trainpod(*args, volume=volume)
    second = signal_when_step_reached(proc, volume, latest_step(volume) + 1, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, second
    write_alpaca_jsonl(volume / SFT_FILE, 250, seed=4)
    ok(run_trainpod(*args, volume=volume))
    assert len(list(volume.glob("cache/sft/*/manifest.json"))) == 1, "a resume tokenized other data"


def as_tokenized_before_manifests_recorded_their_encoding(volume: Path, run: str = FINETUNE_RUN) -> Path:
    """The run's cache/sft/<key> and its pin rewritten as a trainpod before the "\\n" fix left them (sft/encode.py:
    an answer's first "\\n" merged into the prompt's under Qwen2's and Llama 3's tokenizers): no `encoding` in the
    manifest, and the keys (the folder's name, the pin's) hashed from its format, settings and tokenizer alone."""
    pin = volume / "runs" / run / "sft_data.json"
    folder = volume / "cache" / "sft" / json.loads(pin.read_text())["key"]
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.pop("encoding", None)
    settings_key = key_before_encodings_were_recorded(manifest, volume / BASE)
    contents = [[[f["bytes"], f["sha256"]] for f in source["files"]] for source in manifest["sources"]]
    old_key = hashlib.sha256(
        json.dumps([settings_key, contents], separators=(",", ":")).encode()
    ).hexdigest()[:16]
    (folder / "manifest.json").write_text(json.dumps({**manifest, "key": settings_key}))
    old = folder.rename(folder.with_name(old_key))
    pin.write_text(json.dumps({"settings_key": settings_key, "key": old_key}))
    return old


def test_a_new_run_tokenizes_anew_data_an_earlier_encoder_cached(volume):
    """A cache made before the "\\n" fix holds its old labels; its key did not change with the fix, so a new run
    on the same data and tokenizer trained on them without a word."""
    steps = ("--set", "train.max_steps=1", "--set", "train.eval_every=0")
    ok(run_trainpod(*finetune_args(*steps, method="lora"), volume=volume))
    stale = as_tokenized_before_manifests_recorded_their_encoding(volume)
    ok(run_trainpod(*finetune_args(*steps, "--set", "name=new-run", method="lora"), volume=volume))
    pinned = json.loads((volume / "runs" / "new-run" / "sft_data.json").read_text())["key"]
    assert pinned != stale.name, "the new run trains on the labels of the earlier encoder"
    assert "encoding" in json.loads((volume / "cache" / "sft" / pinned / "manifest.json").read_text())


def test_a_run_resuming_on_data_an_earlier_encoder_cached_keeps_it_for_an_exact_resume(volume):
    """Its steps so far trained on those samples, in their order: other ids (a newline token more here and
    there) would move every later row of its epoch. It keeps them, and says a new run name tokenizes anew."""
    args = finetune_args("--set", "train.max_steps=6", "--set", "checkpoint.every_steps=1", method="lora")
    proc = start_trainpod(*args, volume=volume)
    first = signal_when_step_reached(proc, volume, 2, signal.SIGTERM, run=FINETUNE_RUN)
    assert proc.returncode == 143, first
    stale = as_tokenized_before_manifests_recorded_their_encoding(volume)
    output = ok(run_trainpod(*args, volume=volume))
    assert "resumed from step-" in output, output
    assert [p.name for p in (volume / "cache" / "sft").iterdir() if not p.name.startswith(".")] == [
        stale.name
    ]
    assert "tokenized by an earlier trainpod" in output, output


def test_both_or_neither_data_source_is_a_config_error(volume):
    result = run_trainpod(*finetune_args("--set", "data.dataset=sft-tiny"), volume=volume)
    assert result.returncode == 2
    assert "give exactly one: dataset (made by datagen) or sft" in result.stdout + result.stderr


def test_the_kits_own_pretrain_export_is_a_base_model(tiny_dataset_volume, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    volume = tmp_path / "volume"
    for folder in ("datasets", "tokenizers"):
        shutil.copytree(tiny_dataset_volume / folder, volume / folder)
    pretrain = ("run", "pretrain", "--config", str(TINY_PRETRAIN), "--set", "train.max_steps=4")
    ok(run_trainpod(*pretrain, "--set", "train.warmup_steps=1", volume=volume))
    ok(
        run_trainpod(
            "run", "finetune", "--config", str(TINY_FINETUNE), "--set", "train.max_steps=3", volume=volume
        )
    )
    base = AutoModelForCausalLM.from_pretrained(volume / "runs/tiny-pretrain/export/hf")
    PeftModel.from_pretrained(base, volume / "runs/tiny-finetune/export/adapter")


def test_an_unreachable_hub_model_is_a_temporary_failure_for_the_supervisor(volume):
    outage = {"HF_ENDPOINT": "http://127.0.0.1:9"}  # a hub refusing connections, as in an outage
    result = run_trainpod(
        *finetune_args("--set", "base_model.path=someorg/somemodel"), volume=volume, env=outage
    )
    output = result.stdout + result.stderr
    assert result.returncode == 75, output
    assert "downloading base_model.path='someorg/somemodel' failed" in output


def test_a_hub_model_missing_from_the_cache_offline_is_exit_2_naming_hf_hub_offline(volume):
    """HF_HUB_OFFLINE=1 reads the volume's cache/hf alone: a base not there was exit 75 'will retry on the
    next start', and every start read the same cache until the pod was marked FAILED."""
    result = run_trainpod(
        *finetune_args("--set", "base_model.path=someorg/somemodel"),
        volume=volume,
        env={"HF_HUB_OFFLINE": "1"},
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "someorg/somemodel" in output and "HF_HUB_OFFLINE" in output


def test_a_hub_base_is_fetched_without_its_weights_in_another_layout(tmp_path, monkeypatch):
    """Mistral's repos hold consolidated.safetensors beside the HF weights, as large as the model, which
    transformers never reads: it doubled the download and the volume space."""
    import fnmatch

    import huggingface_hub

    from trainpod.config.finetune import BaseModelConfig
    from trainpod.train.base_model import resolve_base_model
    from trainpod.volume import Volume

    hub_repo = {
        "config.json": "{}",
        "model.safetensors": "w",
        "consolidated.safetensors": "w",
        "params.json": "{}",
    }

    def snapshot_download(repo_id, allow_patterns, ignore_patterns=(), cache_dir=None, **kwargs):
        """The hub's: the files the patterns allow and do not ignore."""
        snapshot = Path(cache_dir) / "snapshot"
        snapshot.mkdir(parents=True)
        for name, text in hub_repo.items():
            allowed = any(fnmatch.fnmatch(name, p) for p in allow_patterns)
            if allowed and not any(fnmatch.fnmatch(name, p) for p in ignore_patterns or ()):
                (snapshot / name).write_text(text)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    folder = resolve_base_model(BaseModelConfig(path="mistralai/Tiny-v0.3"), Volume(tmp_path))
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "params.json"]


def test_the_paged_8bit_optimizer_state_round_trips_through_a_checkpoint(volume):
    paged = ("--set", "train.optimizer=paged_adamw_8bit", "--set", "checkpoint.every_steps=3")
    ok(run_trainpod(*finetune_args(*paged, "--set", "train.max_steps=3"), volume=volume))
    (run_dir(volume) / "DONE").unlink()  # as if the run had been stopped right after its step-3 commit
    output = ok(run_trainpod(*finetune_args(*paged, "--set", "train.max_steps=6"), volume=volume))
    assert "resumed from step-3" in output
    assert latest_step(volume) == 6


def test_a_text_finetune_is_evaluated_by_generation_and_keeps_its_best_checkpoints_by_cer(volume):
    """Generation eval is not for images only: greedy answers to validation prompts, scored by CER, with
    checkpoints ranked by it."""
    ok(
        run_trainpod(
            *finetune_args(
                "--set", "train.max_steps=10", "--set", "generation_eval.every_evals=1",
                "--set", "generation_eval.max_samples=3", "--set", "generation_eval.max_new_tokens=4",
                "--set", "train.early_stopping_metric=cer",
            ),
            volume=volume,
            timeout=900,
        )
    )  # fmt: skip
    records = [
        json.loads(line)
        for line in (run_dir(volume) / "eval/step-10.predictions.jsonl").read_text().splitlines()
    ]
    assert len(records) == 3 and all(r["reference"] and "cer" in r["scores"] for r in records)
    assert all(r["prompt"].endswith("assistant\n") and r["images"] == [] for r in records)
    manifest = json.loads((run_dir(volume) / "checkpoints/step-10/manifest.json").read_text())
    assert manifest["score"]["metric"] == "eval_cer"
    status = json.loads((run_dir(volume) / "status.json").read_text())
    assert status["eval_metrics"]["eval_cer"] == manifest["score"]["value"]


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_lora_target_modules_that_match_nothing_is_exit_2_naming_the_modules_there(volume, method):
    """A typo in lora.target_modules is bad config (exit 2, no restarts), not a crash the supervisor retries."""
    result = run_trainpod(
        *finetune_args("--set", 'lora.target_modules=["qkv_proj"]', method=method), volume=volume
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "lora.target_modules=['qkv_proj']" in output and "q_proj" in output


@pytest.mark.parametrize("method", ["lora", "qlora"])
def test_a_lora_target_module_that_matches_nothing_beside_ones_that_do_is_exit_2_naming_it(volume, method):
    """peft adapts what the list's other names match and drops a typo'd one without a word: o_prj (for o_proj)
    trained a run without the adapters the user asked for there."""
    result = run_trainpod(
        *finetune_args("--set", 'lora.target_modules=["q_proj","v_proj","o_prj"]', method=method),
        volume=volume,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "o_prj names no module" in output and "o_proj" in output
    assert not (run_dir(volume) / "checkpoints/LATEST").exists()


@pytest.mark.parametrize("packing", ["true", "false"])
def test_samples_longer_than_a_models_learned_positions_are_exit_2_before_a_step(volume, packing):
    """GPT-2's positions are a table of n_positions rows: a sample longer than that failed with an IndexError
    (exit 1, again at every restart; on a GPU a device-side assert) at the first batch that held one, hours
    into a run maybe, where the finetune had only warned that positions beyond it 'were never trained'."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    folder = volume / BASE
    tokenizer = AutoTokenizer.from_pretrained(folder)
    config = GPT2Config(
        vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=16,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    for weights in folder.glob("model*.safetensors"):
        weights.unlink()
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(folder)
    result = run_trainpod(
        *finetune_args("--set", f"data.sft.packing={packing}", method="lora"), volume=volume
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "data.sft.cutoff_len=128" in output and "16 positions" in output and "Traceback" not in output
    assert not list(run_dir(volume).glob("checkpoints/step-*"))

    shorter = ("--set", "data.sft.cutoff_len=16", "--set", "train.max_steps=2", "--set", "train.eval_every=2")
    assert "step 2" in ok(run_trainpod(*finetune_args(*shorter, method="lora"), volume=volume))


def test_a_full_finetune_of_a_model_stored_quantized_is_exit_2_before_data_or_training(volume):
    """A base saved in 4 bit (a hub '-bnb-4bit' model): method full trained only what is not quantized (the
    embeddings, norms and head; here 51,520 of 88,384 parameters) to the last paid step, then failed the
    export with NotImplementedError (exit 1, again at every restart)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    folder = volume / BASE
    quantized = AutoModelForCausalLM.from_pretrained(
        folder, quantization_config=BitsAndBytesConfig(load_in_4bit=True), device_map={"": "cpu"}
    )
    for weights in folder.glob("model*.safetensors"):
        weights.unlink()
    quantized.save_pretrained(folder)
    result = run_trainpod(*finetune_args(method="full"), volume=volume)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "method full" in output and "bitsandbytes" in output and "method qlora" in output
    assert "Traceback" not in output and not (volume / "cache" / "sft").exists()
    assert not list(run_dir(volume).glob("checkpoints/step-*"))


def test_generation_eval_on_data_trained_on_the_prompt_is_exit_2(volume):
    """With train_on_prompt every token is trained, so generation eval would prompt with one token and score
    the whole conversation as the answer: refused before training."""
    result = run_trainpod(
        *finetune_args("--set", "data.sft.train_on_prompt=true", "--set", "generation_eval.every_evals=1"),
        volume=volume,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "train_on_prompt" in output and "generation_eval.every_evals" in output


def test_a_named_dataset_is_packed_as_its_datagen_config_says(volume):
    """sft.packing in a datagen config is the finetune's default for that dataset (data.packing overrides it)."""
    datagen = {
        "kind": "sft",
        "name": "sft-packed",
        "tokenizer": BASE,
        "sft": {
            "datasets": [{"path": "data/sft.jsonl"}],
            "template": "chatml",
            "cutoff_len": 128,
            "packing": True,
        },
    }
    config = volume / "sft-packed.yaml"
    config.write_text(json.dumps(datagen))
    ok(run_trainpod("run", "datagen", "--config", str(config), volume=volume))
    args = (
        "run", "finetune", "--config", str(TINY_FINETUNE), "--set", f"base_model.path={BASE}",
        "--set", "data.sft=null", "--set", "data.dataset=sft-packed", "--set", "method=lora",
        "--set", "train.max_steps=1",
    )  # fmt: skip
    output = ok(run_trainpod(*args, volume=volume))
    assert "steps per epoch, packed" in output
    summary = json.loads((run_dir(volume) / "export/adapter/training_summary.json").read_text())
    assert summary["data"]["packing"] is True


def test_a_finetune_on_a_named_dataset_an_earlier_trainpod_tokenized_says_so_and_how_to_rebuild_it(volume):
    """datasets/<name> is the user's (a run in progress on it resumes exactly on it): its old labels, an answer's
    first newline untrained under Qwen2's and Llama 3's tokenizers, are a warning naming the rebuild."""
    datagen = {"kind": "sft", "name": "sft-old", "tokenizer": BASE, "sft": {"datasets": [{"path": SFT_FILE}]}}
    config = volume / "sft-old.yaml"
    config.write_text(json.dumps(datagen))
    ok(run_trainpod("run", "datagen", "--config", str(config), volume=volume))
    manifest_file = volume / "datasets" / "sft-old" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest.pop("encoding", None)
    manifest_file.write_text(
        json.dumps({**manifest, "key": key_before_encodings_were_recorded(manifest, volume / BASE)})
    )
    args = (
        "run", "finetune", "--config", str(TINY_FINETUNE), "--set", f"base_model.path={BASE}",
        "--set", "data.sft=null", "--set", "data.dataset=sft-old", "--set", "method=lora",
        "--set", "train.max_steps=1", "--set", "train.eval_every=0",
    )  # fmt: skip
    output = ok(run_trainpod(*args, volume=volume))
    assert "data.dataset=sft-old was tokenized by an earlier trainpod" in output, output
    assert "run its datagen config again" in output, output


def test_samples_cut_at_cutoff_len_are_reported_under_the_finetunes_own_field_names(volume):
    """The warning said "raise sft.cutoff_len ... or set sft.overflow=drop", a datagen config's names: a finetune
    refuses `--set sft.cutoff_len=...` (unknown key); its field is data.sft.cutoff_len."""
    cut = ("--set", "data.sft.cutoff_len=16", "--set", "train.max_steps=1", "--set", "train.eval_every=0")
    output = ok(run_trainpod(*finetune_args(*cut, method="lora"), volume=volume))
    warning = next(line for line in output.splitlines() if "were cut" in line)
    assert "raise data.sft.cutoff_len" in warning and "set data.sft.overflow=drop" in warning, warning


def test_a_finetunes_data_errors_name_its_data_sft_fields(volume):
    """A missing data file said "fix sft.datasets[].path" and a missing column "map it with sft.datasets[0].columns",
    a datagen config's names; a finetune's are under data.sft, and --set sft.datasets... is an unknown key there."""
    missing = json.dumps([{"path": "data/nope.jsonl", "format": "alpaca"}])
    result = run_trainpod(*finetune_args("--set", f"data.sft.datasets={missing}"), volume=volume)
    assert result.returncode == 2 and "fix data.sft.datasets[].path" in result.stdout + result.stderr, (
        result.stdout + result.stderr
    )
    (volume / "data/qa.jsonl").write_text(json.dumps({"question": "2+3?", "answer": "5"}) + "\n")
    unmapped = json.dumps([{"path": "data/qa.jsonl", "format": "alpaca"}])
    result = run_trainpod(*finetune_args("--set", f"data.sft.datasets={unmapped}"), volume=volume)
    assert (
        result.returncode == 2 and "data.sft.datasets[0].columns.prompt" in result.stdout + result.stderr
    ), result.stdout + result.stderr
