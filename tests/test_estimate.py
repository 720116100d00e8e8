"""`trainpod estimate` and the checks `trainpod deploy` makes before renting: tokens, FLOPs, hours,
memory fit, prices from RunPod's v2 catalog (the fake API, the mock of RunPod, validates each query
against RunPod's v2 description), the budget refusal, live stock, dry-run checks, --supervise."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from trainpod import cli
from trainpod.config import load_config
from trainpod.config.finetune import FinetuneConfig
from trainpod.estimate import estimate, load_target, size_finetune
from trainpod.volume import Volume

from fake_runpod import FakeRunPodServer, api_env, client_for
from finetune_support import BASE, TINY_FINETUNE
from support import CONFIGS, child_env
from vlm_support import TINY_VLM_CONFIG

PRETRAIN_125M = CONFIGS / "pretrain/125m.yaml"


@pytest.fixture
def no_runpod(monkeypatch, tmp_path):
    """No RunPod key anywhere (not even the user's ~/.runpod), no price or budget in the environment."""
    monkeypatch.setenv("HOME", str(tmp_path))
    for name in (
        "RUNPOD_API_KEY",
        "TRAINPOD_GPU_HOURLY_USD",
        "TRAINPOD_BUDGET_USD",
        "TRAINPOD_RUNPOD_API_URL",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def fake(monkeypatch, tmp_path, no_runpod):
    with FakeRunPodServer() as fake:
        for name, value in api_env(fake).items():
            monkeypatch.setenv(name, value)
        yield fake
    assert not fake.violations, f"requests RunPod would refuse: {fake.violations}"


def number_after(label: str, text: str) -> str:
    match = re.search(rf"{label}\s+\$?([\d,.]+)", text)
    assert match, f"no {label!r} figure in:\n{text}"
    return match.group(1).replace(",", "")


def test_estimate_of_a_pretrain_preset_gives_tokens_flops_hours_and_its_mfu_assumption(no_runpod, capsys):
    assert cli.main(["estimate", str(PRETRAIN_125M)]) == 0
    out = capsys.readouterr().out
    t = yaml.safe_load(PRETRAIN_125M.read_text())["train"]
    assert int(number_after("tokens", out)) == t["max_steps"] * t["seq_len"] * t["micro_batch_size"] * t.get(
        "grad_accum_steps", 1
    )
    assert "FLOPs" in out and "40% MFU, assumed for pretrain" in out
    assert "fits" in out and "commits in" in out and "200-400 MB/s" in out
    assert "cost       unknown" in out, "no key and no TRAINPOD_GPU_HOURLY_USD: no made-up price"


def test_a_deploy_configs_env_set_is_part_of_the_run_it_estimates(no_runpod, tmp_path, capsys):
    """The pod runs the workload config with env.set (TRAINPOD_SET) applied; the estimate, and deploy's budget
    check on it, read the YAML without it: a run 10x longer was priced at the YAML's length."""
    path = deploy_config(tmp_path, **{"env.set": "train.max_steps=200000", "budget.hourly_usd": 2.0})
    assert cli.main(["estimate", str(path), "--set", "train.seq_len=512"]) == 0
    t = yaml.safe_load(PRETRAIN_125M.read_text())["train"]
    tokens = 200000 * 512 * t["micro_batch_size"] * t.get("grad_accum_steps", 1)
    assert int(number_after("tokens", capsys.readouterr().out)) == tokens, "env.set first, then --set"


def test_estimate_prices_from_runpods_catalog_when_a_key_is_set(fake, capsys):
    assert cli.main(["estimate", str(PRETRAIN_125M), "--gpu", "NVIDIA L40S"]) == 0
    out = capsys.readouterr().out
    hours_line = next(line for line in out.splitlines() if line.startswith("time"))
    assert "NVIDIA L40S" in hours_line and "$0.86/h" in out and "RunPod catalog" in out
    assert "of 48 GB per GPU" in out, "the GPU's memory comes from the catalog"
    assert fake.calls("GET", "/v2/catalog/gpus"), "the v2 catalog was asked"


def test_estimate_without_a_key_prices_from_trainpod_gpu_hourly_usd(no_runpod, monkeypatch, capsys):
    monkeypatch.setenv("TRAINPOD_GPU_HOURLY_USD", "3")
    assert cli.main(["estimate", str(PRETRAIN_125M), "--mfu", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "at $3.00/h" in out and "50% MFU, given with --mfu" in out


def test_estimate_uses_the_mfu_a_previous_run_of_the_config_measured(no_runpod, tmp_path, capsys):
    status = tmp_path / "vol/runs/pretrain-125m/status.json"
    status.parent.mkdir(parents=True)
    status.write_text(json.dumps({"mfu": 0.31}))
    assert cli.main(["estimate", str(PRETRAIN_125M), "--volume", str(tmp_path / "vol")]) == 0
    assert "31% MFU, measured by run pretrain-125m" in capsys.readouterr().out


def test_the_estimate_prices_with_the_whole_runs_mfu_not_its_last_log_window(no_runpod, tmp_path, capsys):
    """status.json's `mfu` is the last log window's (low after an eval or a commit in it); `run_mfu` counts the
    whole run over the time it was billed for, as the estimate's price does."""
    status = tmp_path / "vol/runs/pretrain-125m/status.json"
    status.parent.mkdir(parents=True)
    status.write_text(json.dumps({"mfu": 0.12, "run_mfu": 0.37}))
    assert cli.main(["estimate", str(PRETRAIN_125M), "--volume", str(tmp_path / "vol")]) == 0
    assert "37% MFU, measured by run pretrain-125m over the whole run" in capsys.readouterr().out


def test_a_measured_mfu_prices_the_model_flops_it_measured_not_the_recomputed_forward(no_runpod, tmp_path):
    """A run's MFU counts the model's FLOPs (train/reporting.py), without gradient checkpointing's second
    forward: applied to the FLOPs executed, the 4b preset's time and cost read 4/3 of what its run measured."""
    from trainpod.train.reporting import peak_flops_of
    from trainpod.train.shape import flops_per_token, model_shape, padded_vocab

    config, _ = load_target(str(CONFIGS / "pretrain/4b.yaml"))
    assert config.train.gradient_checkpointing
    status = tmp_path / "vol/runs" / config.name / "status.json"
    status.parent.mkdir(parents=True)
    status.write_text(json.dumps({"mfu": 0.3}))
    est = estimate(config, volume=Volume(tmp_path / "vol"))
    assert est.mfu_source.startswith("measured")
    t = config.train
    shape = model_shape(config, padded_vocab(config.model.vocab_size or 32768))
    # What the run's status.json MFU was measured against: its log's tokens/s x these FLOPs per token.
    model_flops = flops_per_token(shape, t.seq_len) * est.sizing.tokens
    assert est.hours == pytest.approx(model_flops / (peak_flops_of(est.gpu) * 0.3) / 3600, rel=1e-9)


@pytest.mark.parametrize("mfu", ["0", "-0.5", "1.5"])
def test_an_mfu_outside_0_to_1_is_bad_input_not_a_crash_or_a_negative_cost(
    no_runpod, monkeypatch, mfu, capsys
):
    monkeypatch.setenv("TRAINPOD_GPU_HOURLY_USD", "2")
    assert cli.main(["estimate", str(PRETRAIN_125M), "--mfu", mfu]) == 2
    assert f"--mfu {float(mfu):g}: a share of the GPU's peak" in capsys.readouterr().out


@pytest.mark.parametrize("variable", ["TRAINPOD_BUDGET_USD", "TRAINPOD_GPU_HOURLY_USD"])
def test_a_nan_amount_is_malformed_not_a_budget_nothing_ever_exceeds(
    no_runpod, monkeypatch, variable, capsys
):
    monkeypatch.setenv(variable, "nan")
    assert cli.main(["estimate", str(PRETRAIN_125M)]) == 2
    assert f"{variable}='nan' is not an amount in USD" in capsys.readouterr().out


@pytest.mark.parametrize("path", ["convert/tiny.yaml", "datagen/tiny.yaml"])
def test_a_config_that_trains_nothing_is_named_as_such_not_reported_as_a_broken_finetune(
    no_runpod, capsys, path
):
    """A convert config has a `base_model` too: estimate read it as a finetune and listed five "problems"
    (adapter: unknown key, train: missing, ...) in a config that is fine."""
    assert cli.main(["estimate", str(CONFIGS / path)]) == 2
    out = capsys.readouterr().out
    assert "neither a pretrain, a finetune nor a deploy config" in out and "config problem" not in out, out


def test_a_1b_preset_does_not_fit_a_24_gb_gpu(no_runpod, capsys):
    assert cli.main(["estimate", str(CONFIGS / "pretrain/1b.yaml"), "--gpu", "NVIDIA GeForce RTX 4090"]) == 0
    assert "of 24 GB per GPU: DOES NOT FIT" in capsys.readouterr().out


@pytest.mark.parametrize(
    "gpu, memory_gb",
    [
        ("NVIDIA A100-SXM4-80GB", 80),
        ("NVIDIA A100 80GB PCIe", 80),
        ("NVIDIA RTX A4000", 16),
        ("NVIDIA A40", 48),
    ],
)
def test_without_the_catalog_a_gpus_memory_is_read_from_its_whole_type_id(no_runpod, gpu, memory_gb):
    """RunPod's ids: the SXM A100 is 80 GB though no "A100 80GB" is in its id; "A4000" contains "A40"."""
    config, _ = load_target(str(PRETRAIN_125M))
    assert estimate(config, gpu=gpu).gpu_memory_gb == memory_gb


def test_finetune_estimate_counts_exactly_the_lora_parameters_peft_trains(finetune_base_volume, no_runpod):
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from trainpod.train.lora import peft_lora_config

    config = load_config(FinetuneConfig, TINY_FINETUNE, [f"base_model.path={BASE}"])
    sizing = size_finetune(config, 1, Volume(finetune_base_volume))
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(finetune_base_volume / BASE), peft_lora_config(config.lora)
    )
    trainable, total = model.get_nb_trainable_parameters()
    assert sizing.trainable == trainable and sizing.parameters == total - trainable
    t = config.train
    assert sizing.tokens == t.max_steps * t.micro_batch_size * t.grad_accum_steps * config.data.sft.cutoff_len
    est = estimate(config, volume=Volume(finetune_base_volume))
    assert est.mfu_source.startswith("assumed for qlora") and est.hours > 0


def test_qlora_weights_count_4_bits_only_for_what_4_bit_loading_quantizes(finetune_base_volume, no_runpod):
    """The embeddings and the output head stay out of bitsandbytes' 4 bits (transformers keeps lm_head out), and
    peft's prepare_model_for_kbit_training, which the trainer runs, upcasts them to fp32: counted at 16 bits,
    Qwen2.5-7B's were 2.2 GB short."""
    import torch
    from peft import prepare_model_for_kbit_training

    from trainpod.train.base_model import load_4bit

    config = load_config(FinetuneConfig, TINY_FINETUNE, [f"base_model.path={BASE}", "method=qlora"])
    # As the trainer loads it on a GPU: bf16 compute dtype, then peft's preparation.
    model = load_4bit(
        finetune_base_volume / BASE, config.base_model, config.quantization, torch.bfloat16, "sdpa", "cpu"
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    kept = [p for p in model.parameters() if type(p).__name__ != "Params4bit"]
    quantized = sum(p.numel() for p in model.parameters()) - sum(p.numel() for p in kept)
    kept_bytes = sum(p.numel() * p.element_size() for p in kept)
    assert sum(p.numel() for p in kept) > 0.1 * quantized, "the tiny base's embeddings are a large share"
    sizing = size_finetune(config, 1, Volume(finetune_base_volume))
    # Params4bit holds two 4-bit values a byte: its numel is half the weights it quantizes.
    assert sizing.memory["weights"] == pytest.approx(0.52 * 2 * quantized + kept_bytes)


def test_a_finetune_through_the_chunked_loss_counts_one_chunks_logits_not_a_micro_batchs(no_runpod, tmp_path):
    """The trainer runs a Qwen2 (Llama, Mistral, Qwen3) through the chunked loss, step and eval: the estimate
    counted three fp32 copies of a micro-batch's whole logits, 15 GB for 4 x 2048 tokens of Qwen2.5's 152k
    vocabulary, and read 'DOES NOT FIT' for runs that fit."""
    from transformers import Qwen2Config

    from trainpod.train.loss_chunks import rows_per_chunk

    vocab, width = 152064, 64
    Qwen2Config(
        vocab_size=vocab, hidden_size=width, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path / "qwen2")  # fmt: skip
    settings = [
        f"base_model.path={tmp_path / 'qwen2'}",
        "train.micro_batch_size=4",
        "data.sft.cutoff_len=2048",
    ]
    sizing = size_finetune(load_config(FinetuneConfig, TINY_FINETUNE, settings), 1, None)
    tokens = 4 * 2048
    assert sizing.memory["logits"] == 3 * 4 * rows_per_chunk(vocab, tokens) * vocab + 4 * tokens * width
    assert sizing.memory["logits"] < 3 * 4 * tokens * vocab / 8


def test_a_finetunes_checkpoint_is_sized_by_its_optimizer_as_the_trainer_sizes_it(no_runpod, tmp_path):
    """The estimate took 12 bytes a trainable parameter (fp32 and AdamW's two moments) whatever train.optimizer: with
    paged_adamw_8bit, which the 24 GB QLoRA config uses, the checkpoint and its commit time read about twice what
    they are (the trainer's own size, train/memory.py checkpoint_bytes, counts the 8-bit state)."""
    from transformers import Qwen2Config

    Qwen2Config(
        vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2,
    ).save_pretrained(tmp_path / "qwen2")  # fmt: skip

    def checkpoint(optimizer: str) -> tuple[int, int]:
        settings = [f"base_model.path={tmp_path / 'qwen2'}", f"train.optimizer={optimizer}"]
        sizing = size_finetune(load_config(FinetuneConfig, TINY_FINETUNE, settings), 1, None)
        return sizing.checkpoint_bytes, sizing.trainable

    adamw, trainable = checkpoint("adamw")
    assert adamw == pytest.approx(12 * trainable, rel=0.01), "fp32 weights and two fp32 moments"
    eight_bit, _ = checkpoint("paged_adamw_8bit")
    assert eight_bit == pytest.approx(6 * trainable, rel=0.05), "fp32 weights and two 8-bit moments"


def test_a_full_finetune_under_fsdp_counts_its_state_sharded_across_the_gpus(finetune_base_volume, no_runpod):
    """FSDP keeps 1/N of the weights, gradients and AdamW states per GPU: counted whole, an 8B full finetune on
    8 GPUs read as not fitting them. DDP (and LoRA, which every GPU holds whole) keeps them whole."""
    base = [f"base_model.path={BASE}", "method=full"]
    volume = Volume(finetune_base_volume)
    one = size_finetune(load_config(FinetuneConfig, TINY_FINETUNE, base), 1, volume).memory
    sharded = size_finetune(
        load_config(FinetuneConfig, TINY_FINETUNE, [*base, "train.parallel=fsdp"]), 4, volume
    )
    for part in ("weights", "gradients", "optimizer"):
        assert sharded.memory[part] == pytest.approx(one[part] / 4), part
    assert sharded.memory["fsdp gathered"] > 0 and any("FSDP" in note for note in sharded.notes)
    replicated = size_finetune(
        load_config(FinetuneConfig, TINY_FINETUNE, [*base, "train.parallel=ddp"]), 4, volume
    )
    assert replicated.memory["weights"] == one["weights"] and "fsdp gathered" not in replicated.memory


def test_finetune_of_a_datagen_dataset_sizes_rows_by_the_cutoff_len_it_was_cut_at(
    finetune_base_volume, no_runpod, tmp_path
):
    """The trainer's rows are the dataset's cutoff_len (its manifest), not a guessed 2048: 16x the tokens."""
    import shutil

    from trainpod.sft import prepare_sft

    volume = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, volume)
    inline = load_config(FinetuneConfig, TINY_FINETUNE, [f"base_model.path={BASE}"])
    prepare_sft(inline.data.sft, volume / BASE, volume / "datasets/instr", volume)
    named = load_config(
        FinetuneConfig, TINY_FINETUNE, [f"base_model.path={BASE}", "data.sft=null", "data.dataset=instr"]
    )
    sizing = size_finetune(named, 1, Volume(volume))
    assert sizing.tokens == size_finetune(inline, 1, Volume(volume)).tokens
    assert "of 128" in " ".join(sizing.notes)


def test_finetune_by_epochs_counts_the_samples_of_its_data(finetune_base_volume, no_runpod):
    config = load_config(
        FinetuneConfig,
        TINY_FINETUNE,
        [f"base_model.path={BASE}", "train.max_steps=null", "train.epochs=2", "data.sft.val_ratio=0.25"],
    )
    sizing = size_finetune(config, 1, Volume(finetune_base_volume))
    rows_per_step = config.train.micro_batch_size * config.train.grad_accum_steps
    assert sizing.steps == -(-2 * 300 // rows_per_step), "400 embedded samples, 75% of them train, twice"


def test_finetune_by_epochs_without_its_data_names_the_file_and_the_way_out(no_runpod, tmp_path, capsys):
    code = cli.main(
        ["estimate", str(CONFIGS / "finetune/qwen2.5-7b-qlora-24gb.yaml"), "--volume", str(tmp_path)]
    )
    out = capsys.readouterr().out
    assert code == 2 and "data/train.jsonl" in out and "--set train.max_steps=N" in out
    assert "Traceback" not in out


def test_finetune_by_epochs_without_a_volume_says_to_pass_one(no_runpod, tmp_path, monkeypatch, capsys):
    """The README's first estimate line names no --volume: the error called the current directory "the
    volume root" and offered only --set, never the --volume that finds the data."""
    monkeypatch.chdir(tmp_path)
    code = cli.main(["estimate", str(CONFIGS / "finetune/qwen2.5-7b-qlora-24gb.yaml")])
    out = capsys.readouterr().out
    assert code == 2 and "data/train.jsonl" in out, out
    assert f"no volume given, so the current directory {tmp_path} stood for the volume" in out
    assert "`trainpod estimate CONFIG --volume DIR` counts the data where it lives" in out
    assert "--set train.max_steps=N" in out


def test_deploys_estimate_of_a_finetune_by_epochs_names_env_set_not_a_set_flag(
    no_runpod, tmp_path, monkeypatch, capsys
):
    """Deploy's "estimate not made" line repeated `trainpod estimate`'s "pass --set train.epochs=null --set
    train.max_steps=N"; deploy has no --set (argparse: unrecognized arguments): the deploy YAML's env.set is the way."""
    monkeypatch.chdir(tmp_path)
    qlora = str(CONFIGS / "finetune/qwen2.5-7b-qlora-24gb.yaml")
    path = deploy_config(tmp_path, workload="finetune", config=qlora)
    assert cli.main(["deploy", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "estimate   not made: train.epochs needs the data's size" in out
    assert (
        "add train.epochs=null train.max_steps=N to the deploy YAML's env.set (the pod's TRAINPOD_SET)" in out
    )
    assert "--set" not in out, "deploy has no --set flag: the fix must name env.set"


def test_deploys_estimate_of_a_finetune_by_epochs_names_estimates_volume_flag_not_its_own(
    no_runpod, tmp_path, monkeypatch, capsys
):
    """Deploy's "estimate not made" line said "pass --volume where the data lives"; deploy has no --volume (argparse:
    unrecognized arguments): `trainpod estimate` has, and counts the data where it lives."""
    monkeypatch.chdir(tmp_path)
    qlora = str(CONFIGS / "finetune/qwen2.5-7b-qlora-24gb.yaml")
    assert (
        cli.main(["deploy", str(deploy_config(tmp_path, workload="finetune", config=qlora)), "--dry-run"])
        == 0
    )
    out = capsys.readouterr().out
    assert "`trainpod estimate CONFIG --volume DIR` counts the data where it lives" in out
    assert "pass --volume" not in out and "no --volume given" not in out


def test_a_finetune_vlm_config_is_estimated_by_its_own_data_not_refused_as_a_text_finetune(
    vlm_base_volume, no_runpod, capsys
):
    """Its data section is the datasets and cutoff_len; 40 OCR rows, 90% train, twice, 4 rows a step."""
    args = ["estimate", str(TINY_VLM_CONFIG), "--volume", str(vlm_base_volume)]
    assert cli.main([*args, "--set", "train.max_steps=null", "--set", "train.epochs=2"]) == 0
    out = capsys.readouterr().out
    assert "in 18 steps" in out and "full rows of 64" in out and "40 samples counted" in out


def test_a_dpo_config_is_estimated_by_its_pairs_each_two_rows(finetune_base_volume, no_runpod, capsys):
    """builtin:dpo-tiny's 400 rows are pairs, 380 train (val_ratio 0.05): 48 steps of 4 x 2 pairs, each pair two
    rows of 128 tokens; the note said '400 samples counted, 380 train one row each'."""
    args = ["estimate", str(CONFIGS / "finetune/tiny-dpo.yaml"), "--volume", str(finetune_base_volume)]
    overrides = ["base_model.path=models/base", "train.max_steps=null", "train.epochs=1"]
    assert cli.main([*args, *(x for o in overrides for x in ("--set", o))]) == 0
    out = capsys.readouterr().out
    assert f"{48 * 8 * 2 * 128:,} in 48 steps" in out, out
    assert "400 preference pairs counted, 380 train, each two rows" in out and "one row each" not in out, out


@pytest.mark.parametrize("overrides", [[], ["lora.train_projector=true"], ["method=full"]])
def test_finetune_vlm_estimate_counts_exactly_the_parameters_its_trainer_trains(
    vlm_base_volume, no_runpod, tmp_path, overrides
):
    """The language model's linear layers (and the projector's when asked), never the vision tower."""
    from trainpod.config.finetune_vlm import VlmFinetuneConfig

    from vlm_support import build_vlm_finetuner, fresh

    volume = fresh(vlm_base_volume, tmp_path / "volume")
    sizing = size_finetune(load_config(VlmFinetuneConfig, TINY_VLM_CONFIG, overrides), 1, Volume(volume))
    model = build_vlm_finetuner(volume, overrides).model
    assert sizing.trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)


def test_deploying_a_finetune_vlm_run_prints_its_estimate_instead_of_crashing(
    vlm_base_volume, tmp_path, capsys
):
    deploy = deploy_config(tmp_path, run="vlm", workload="finetune-vlm", config=str(TINY_VLM_CONFIG))
    assert cli.main(["estimate", str(deploy), "--volume", str(vlm_base_volume)]) == 0
    assert "full rows of 64" in capsys.readouterr().out
    assert cli.main(["deploy", str(deploy), "--dry-run"]) == 0
    assert "estimate   not made" in capsys.readouterr().out, "the model is on the volume, not here"


# `python -m trainpod ARGS` as a user runs it, then the heavy libraries it imported on the way.
IMPORTS_PROBE = """
import atexit, runpy, sys
atexit.register(lambda: print('imported', sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules)))
sys.argv = ['trainpod', *sys.argv[1:]]
runpy.run_module('trainpod', run_name='__main__', alter_sys=True)
"""


def test_the_estimate_and_deploys_dry_run_import_neither_torch_transformers_nor_peft(tmp_path):
    """A laptop command, run before a GPU is paid for: it built the model on the meta device for its shape, and
    imported torch and transformers for it (9 s on two cores, before any line was printed). The sizes are
    arithmetic now (train/shape.py); a finetune's base model whose config.json is not at hand is sized by its
    name, and the samples of its data are counted, without them either."""
    volume = tmp_path / "volume"
    (volume / "data").mkdir(parents=True)
    rows = [
        {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "a"}]}
        for i in range(50)
    ]
    (volume / "data/train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    env = child_env({"HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"})  # no hub: sized by the name
    env.pop("RUNPOD_API_KEY", None)
    commands = {
        "memory     ": ["estimate", str(CONFIGS / "pretrain/1b.yaml")],
        "7B parameters read from the name": [
            "estimate", str(CONFIGS / "finetune/qwen2.5-7b-qlora-24gb.yaml"), "--volume", str(volume),
        ],
        "would create pod p125-pretrain": ["deploy", str(deploy_config(tmp_path)), "--dry-run"],
    }  # fmt: skip
    for expected, args in commands.items():
        result = subprocess.run(
            [sys.executable, "-c", IMPORTS_PROBE, *args], env=env, capture_output=True, text=True, timeout=120
        )
        shown = f"trainpod {' '.join(args)}:\n{result.stdout}{result.stderr}"
        assert result.returncode == 0 and expected in result.stdout, shown
        assert result.stdout.strip().endswith("imported []"), (
            f"keep torch out of the estimate's path; {shown}"
        )


def test_a_finetune_estimate_reads_a_known_base_models_config_json_without_importing_transformers(
    finetune_base_volume, tmp_path
):
    """A Llama base on the volume was built on the meta device with transformers for its sizes: the tiny finetune's
    estimate took 5.5 s on two cores. They are arithmetic from its config.json now (train/decoder_shape.py): 0.4 s."""
    env = child_env({"HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"})
    env.pop("RUNPOD_API_KEY", None)
    args = [
        "estimate",
        str(TINY_FINETUNE),
        "--volume",
        str(finetune_base_volume),
        "--set",
        f"base_model.path={BASE}",
    ]
    result = subprocess.run(
        [sys.executable, "-c", IMPORTS_PROBE, *args], env=env, capture_output=True, text=True, timeout=120
    )
    shown = f"trainpod {' '.join(args)}:\n{result.stdout}{result.stderr}"
    assert result.returncode == 0 and "(0.02M trainable)" in result.stdout, shown
    assert "read from the name" not in result.stdout, "sized by its config.json, not its name"
    assert result.stdout.strip().endswith("imported []"), (
        f"keep transformers out of the estimate's path; {shown}"
    )


# ----------------------------------------------------------------------------------- deploy
def deploy_config(tmp_path: Path, **changes) -> Path:
    tree = {
        "run": "p125",
        "workload": "pretrain",
        "config": str(PRETRAIN_125M),
        "image": {"name": "ghcr.io/org/trainpod:0.1.0", "cuda_version": "12.8"},
        "pod": {"gpu_types": ["NVIDIA H100 80GB HBM3", "NVIDIA L40S"], "spot": False},
        "volume": {"name": "vol", "size_gb": 50, "data_center": "EU-RO-1"},
        "secrets": ["HF_TOKEN"],
    }
    for key, value in changes.items():
        node = tree
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_deploy_prints_the_estimate_and_the_live_stock_of_its_gpus(fake, tmp_path, capsys):
    assert cli.main(["deploy", str(deploy_config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "$2.69/h" in out, "the first GPU type's secure on-demand list price"
    assert (
        "stock      NVIDIA H100 80GB HBM3: HIGH overall, HIGH in EU-RO-1; CUDA 13.0, 12.9, 12.8 free" in out
    )
    assert fake.calls("GET", "/v2/catalog/gpus") and len(fake.pods) == 1


def test_deploy_refuses_a_gpu_type_the_catalog_does_not_list_before_anything_is_made(fake, tmp_path, capsys):
    """A typo in pod.gpu_types was a printed line only: the template and the volume were made, then RunPod
    refused the pod (400). The catalog lists every GPU type whatever its stock, so one it lacks is refused."""
    path = deploy_config(tmp_path, **{"pod.gpu_types": ["NVIDIA H100 80GB HBM", "NVIDIA L40S"]})
    assert cli.main(["deploy", str(path)]) == 2
    out = capsys.readouterr().out
    assert "pod.gpu_types has 'NVIDIA H100 80GB HBM', which RunPod's GPU catalog does not list" in out
    assert "did you mean 'NVIDIA H100 80GB HBM3'" in out
    assert not fake.calls("POST"), "nothing was made"


def test_deploy_warns_when_no_chosen_gpu_has_a_free_machine_on_its_cuda_versions(fake, tmp_path, capsys):
    fake.gpu_stock = {("NVIDIA H100 80GB HBM3", "12.4")}  # free only on a CUDA the image cannot use
    assert cli.main(["deploy", str(deploy_config(tmp_path))]) == 0
    out = capsys.readouterr().out
    assert "CUDA 13.0, 12.9, 12.8: none free" in out and "no machine is free now" in out


def test_deploy_refuses_an_estimate_over_the_budget_unless_forced(fake, tmp_path, capsys):
    path = str(deploy_config(tmp_path, **{"budget.budget_usd": 1.0, "budget.hourly_usd": 2.69}))
    assert cli.main(["deploy", path]) == 2
    out = capsys.readouterr().out
    assert "exceeds the budget ($1.00" in out and "--force" in out
    assert not fake.calls("POST"), "nothing was rented"
    assert cli.main(["deploy", path, "--force"]) == 0 and len(fake.pods) == 1


def test_trainpod_budget_usd_caps_the_deploy_too(fake, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINPOD_BUDGET_USD", "0.5")
    assert cli.main(["deploy", str(deploy_config(tmp_path))]) == 2
    assert "exceeds the budget ($0.50" in capsys.readouterr().out and not fake.pods


def test_the_deploy_configs_budget_caps_the_deploy_even_when_the_shell_has_a_larger_one(
    fake, tmp_path, monkeypatch, capsys
):
    """README: deploy refuses an estimate over TRAINPOD_BUDGET_USD or budget.budget_usd. A shell's larger
    TRAINPOD_BUDGET_USD (left from a local run) let through a run over the budget its pod stops at, exit 3,
    unfinished."""
    monkeypatch.setenv("TRAINPOD_BUDGET_USD", "100000")
    path = str(deploy_config(tmp_path, **{"budget.budget_usd": 1.0, "budget.hourly_usd": 2.69}))
    assert cli.main(["deploy", path]) == 2
    assert "exceeds the budget ($1.00" in capsys.readouterr().out and not fake.pods


@pytest.mark.parametrize("spot", [True, False])
def test_a_deploy_is_priced_at_the_budget_hourly_usd_its_pod_counts_with_not_the_shells_price(
    fake, tmp_path, monkeypatch, capsys, spot
):
    """The pod counts its cost with the deploy config's budget.hourly_usd (deploy sends it; the shell's
    TRAINPOD_GPU_HOURLY_USD never reaches it). A cheap price left in the shell let a spot run through the
    budget refusal, and a catalog price lower than the config's let an on-demand one through; either pod
    then stopped at its budget unfinished, exit 3."""
    monkeypatch.setenv("TRAINPOD_GPU_HOURLY_USD", "0.01")
    changes = {"budget.budget_usd": 1.0, "budget.hourly_usd": 50.0, "pod.spot": spot}
    path = str(deploy_config(tmp_path, **changes))
    assert cli.main(["estimate", path]) == 0
    assert "at $50.00/h (the deploy config's budget.hourly_usd" in capsys.readouterr().out
    assert cli.main(["deploy", path]) == 2
    assert "exceeds the budget ($1.00" in capsys.readouterr().out and not fake.pods


def test_a_single_pod_deploy_with_a_budget_and_no_price_is_not_refused(fake, tmp_path, capsys):
    """The pod reads its own price from RunPod at boot (a cluster's nodes cannot: test_cluster_deploy)."""
    path = str(deploy_config(tmp_path, **{"budget.budget_usd": 1000.0}))
    assert cli.main(["deploy", path, "--force", "--dry-run"]) == 0, capsys.readouterr().out


def test_a_datagen_deploy_with_a_budget_and_no_price_is_not_refused(fake, tmp_path, capsys):
    """Datagen counts no cost against a budget in its pod (the supervisor keeps it from RunPod's): nothing to refuse."""
    changes = {"budget.budget_usd": 1000.0, "workload": "datagen", "config": "configs/datagen/tiny.yaml"}
    path = str(deploy_config(tmp_path, **changes, **{"image.flavour": "cpu", "image.cuda_version": None}))
    assert cli.main(["deploy", path, "--dry-run"]) == 0, capsys.readouterr().out


def test_dry_run_says_what_it_would_create_and_sends_nothing(fake, tmp_path, capsys):
    assert cli.main(["deploy", str(deploy_config(tmp_path)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "would create template trainpod-cuda-ghcr.io-org-trainpod-0.1.0" in out
    assert "would create networkvolume vol" in out and "would create pod p125-pretrain" in out
    assert "secrets    HF_TOKEN as RunPod secret references" in out
    assert fake.requests == [], "a dry run sends nothing, not even reads"


def test_dry_run_refuses_the_placeholder_image_a_secret_value_and_a_broken_workload_config(
    fake, tmp_path, capsys
):
    broken = tmp_path / "pretrain.yaml"
    tree = yaml.safe_load(PRETRAIN_125M.read_text())
    tree["train"]["max_stepz"] = 5
    broken.write_text(yaml.safe_dump(tree))
    path = deploy_config(
        tmp_path,
        **{
            "image.name": "ghcr.io/YOUR_ORG/trainpod:0.1.0",
            "env.extra": {"S3_SECRET": "s3cr3t-value-xyz"},
            "config": str(broken),
        },
    )
    assert cli.main(["deploy", str(path), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert "3 config problem(s)" in out
    assert "image.name='ghcr.io/YOUR_ORG/trainpod:0.1.0' is the shipped placeholder" in out
    assert "env.extra.S3_SECRET holds a value" in out and "s3cr3t-value-xyz" not in out
    assert "train.max_stepz" in out
    assert "would create" not in out and fake.requests == []


def test_dry_run_refuses_the_shipped_placeholder_git_repo(fake, tmp_path, capsys):
    """configs/deploy/nanogpt-command.yaml ships env.git_repo https://github.com/YOUR_ORG/...: with only the
    image set, deploy rented a GPU pod that pulled the image and then failed its git sync."""
    shipped = yaml.safe_load((CONFIGS / "deploy/nanogpt-command.yaml").read_text())
    assert "YOUR_ORG" in shipped["env"]["git_repo"], "the test follows the shipped config"
    path = deploy_config(tmp_path, **{"env.git_repo": shipped["env"]["git_repo"]})
    assert cli.main(["deploy", str(path), "--dry-run"]) == 2
    out = capsys.readouterr().out
    assert f"env.git_repo={shipped['env']['git_repo']!r} is the shipped placeholder" in out
    assert "would create" not in out and fake.requests == []


@pytest.mark.parametrize("userinfo", ["me:{token}", "x-access-token:{token}", "{token}"])
def test_a_token_written_into_env_git_repo_is_refused_masked_naming_the_git_token_secret(
    fake, tmp_path, capsys, userinfo
):
    """A token in env.git_repo's URL (https://user:ghp_...@github.com/...) went into the pod's env as plain text,
    shown in RunPod's console and API to everyone on the account, where a RunPod secret stays hidden."""
    token = "ghp_notarealtoken0123456789"
    path = deploy_config(
        tmp_path, **{"env.git_repo": f"https://{userinfo.format(token=token)}@github.com/org/trainer.git"}
    )
    for args in (["--dry-run"], []):
        assert cli.main(["deploy", str(path), *args]) == 2
        captured = capsys.readouterr()
        assert "env.git_repo=https://***@github.com/org/trainer.git holds credentials" in captured.out
        assert "secrets" in captured.out and "TRAINPOD_GIT_TOKEN" in captured.out
        assert token not in captured.out + captured.err
    assert [method for method, *_ in fake.requests if method != "GET"] == [], "nothing is made or started"


@pytest.mark.parametrize(
    "token",
    [
        "deadbeef" * 5,  # a classic GitHub token (40 hex digits, no prefix): still accepted as a URL's user
        "gldt-" + "notarealdeploytoken",  # a GitLab deploy token, one of its prefixes besides glpat-
        "a1b2c3d4e5" * 5 + "zz",  # an Azure DevOps personal access token (52 characters)
    ],
)
def test_a_token_of_no_listed_prefix_as_env_git_repos_user_is_refused_masked(fake, tmp_path, capsys, token):
    """A token as the URL's user alone was recognised by a few prefixes (ghp_, github_pat_, glpat-, hf_), so a
    classic GitHub token, an Azure DevOps one or a GitLab deploy token went to the pod's env as plain text."""
    path = deploy_config(tmp_path, **{"env.git_repo": f"https://{token}@github.com/org/trainer.git"})
    assert cli.main(["deploy", str(path), "--dry-run"]) == 2
    captured = capsys.readouterr()
    assert "env.git_repo=https://***@github.com/org/trainer.git holds credentials" in captured.out
    assert token not in captured.out + captured.err


def test_a_user_alone_in_env_git_repo_is_no_secret_and_deploys(fake, tmp_path, capsys):
    for user in ("alice", "glenn-smith", "a-long-but-ordinary-user-name-of-39-chr", "alice%40example.com"):
        path = deploy_config(tmp_path, **{"env.git_repo": f"https://{user}@github.com/org/trainer.git"})
        assert cli.main(["deploy", str(path), "--dry-run"]) == 0, capsys.readouterr().out


def test_deploy_with_supervise_supervises_the_run_until_done(fake, tmp_path, monkeypatch, capsys):
    volume = tmp_path / "vol"
    (volume / "runs/p125").mkdir(parents=True)
    (volume / "runs/p125/DONE").write_text("{}")
    monkeypatch.setenv("TRAINPOD_VOLUME", str(volume))
    assert cli.main(["deploy", str(deploy_config(tmp_path)), "--supervise"]) == 0
    (pod,) = fake.pods.values()
    assert pod["desiredStatus"] == "EXITED", "the supervisor saw DONE and stopped the pod"
    assert "run is DONE" in capsys.readouterr().out


def test_the_fake_refuses_a_catalog_query_runpods_v2_description_does_not_allow():
    with FakeRunPodServer() as fake:
        client = client_for(fake, max_attempts=1)
        for query in (
            {"include": "AVAILABILITY"},
            {"include": "AVAILABILITY", "product": "POD", "cudaVersions": "13"},
        ):
            with pytest.raises(Exception, match="400"):
                client.request("GET", "/catalog/gpus", query=query, api="v2")
        assert len(fake.violations) == 2


def test_a_volume_that_is_not_there_is_refused_not_read_as_an_empty_one(no_runpod, tmp_path, capsys):
    """A mistyped --volume estimated the tiny pretrain with a 32768-token vocabulary assumed (its dataset's is
    1024), an assumed MFU, and exit 0."""
    code = cli.main(["estimate", str(CONFIGS / "pretrain/tiny.yaml"), "--volume", str(tmp_path / "typo")])
    out = capsys.readouterr().out
    assert code == 2 and f"--volume {tmp_path / 'typo'} does not exist here" in out, out
    assert "--s3-volume" not in out, "estimate has no such flag"


def test_the_hf_token_reaches_the_hub_alone_never_a_host_it_redirects_to(monkeypatch):
    """The estimate reads a hub model's config.json with HF_TOKEN as a Bearer header. urllib hands a redirect
    every header of the request, so a redirect to another host (a CDN, a mirror's storage) received the token."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from trainpod.estimate import _hub_config

    seen: dict[str, str | None] = {}
    config = json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}).encode()

    class Storage(BaseHTTPRequestHandler):  # the other host
        def do_GET(self):  # noqa: N802 - http.server's name
            seen["storage"] = self.headers.get("Authorization")
            self.send_response(200)
            self.send_header("Content-Length", str(len(config)))
            self.end_headers()
            self.wfile.write(config)

        def log_message(self, *_):
            pass

    storage = ThreadingHTTPServer(("127.0.0.1", 0), Storage)

    class Hub(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen["hub"] = self.headers.get("Authorization")
            self.send_response(302)
            self.send_header("Location", f"http://127.0.0.1:{storage.server_port}/blob/config.json")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *_):
            pass

    hub = ThreadingHTTPServer(("127.0.0.1", 0), Hub)
    for server in (storage, hub):
        threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{hub.server_port}")
        monkeypatch.setenv("HF_TOKEN", "hf_secret_token_123456")
        read = _hub_config("org/model", "main")
    finally:
        for server in (storage, hub):
            server.shutdown()
            server.server_close()
    assert read is not None and read["hidden_size"] == 64, "the config is read through the redirect"
    assert seen == {"hub": "Bearer hf_secret_token_123456", "storage": None}


def test_a_dpo_finetune_counts_each_pair_as_two_sequences_and_the_reference_forward(
    finetune_base_volume, no_runpod
):
    """objective dpo runs a micro batch of P pairs as 2P rows through the policy and again, without gradients,
    through the reference (train/preference.py): the estimate counted one sequence per row and no reference."""
    base = [f"base_model.path={BASE}", "method=lora"]
    dpo_config = load_config(FinetuneConfig, CONFIGS / "finetune/tiny-dpo.yaml", base)
    sft_settings = [
        *base,
        "objective=sft",
        'data.sft.datasets=[{"path": "builtin:sft-tiny"}]',
        "data.sft.preference=false",
    ]
    sft_config = load_config(FinetuneConfig, CONFIGS / "finetune/tiny-dpo.yaml", sft_settings)
    volume = Volume(finetune_base_volume)
    dpo, sft = size_finetune(dpo_config, 1, volume), size_finetune(sft_config, 1, volume)
    assert dpo.tokens == 2 * sft.tokens
    assert dpo.flops_per_token == sft.flops_per_token + 2 * sft.parameters
    assert dpo.memory["activations"] == 2 * sft.memory["activations"]


def test_a_full_orpo_finetune_on_several_gpus_is_estimated_replicated_as_it_trains(
    finetune_base_volume, no_runpod, monkeypatch
):
    """train.parallel auto picks FSDP for a full finetune of 1B parameters or more on several GPUs, but a preference
    objective replicates the model (workloads/preference.py): the estimate must not count its state sharded."""
    size = size_finetune
    monkeypatch.setattr("trainpod.train.parallel.FSDP_AUTO_PARAMS", 0)  # the tiny model stands for a 7B one
    base = [f"base_model.path={BASE}", "method=full", "train.optimizer=adamw"]
    orpo = load_config(FinetuneConfig, CONFIGS / "finetune/tiny-dpo.yaml", [*base, "objective=orpo"])
    volume = Volume(finetune_base_volume)
    one, eight = size(orpo, 1, volume).memory, size(orpo, 8, volume).memory
    assert eight["weights"] == one["weights"] and "fsdp gathered" not in eight
    sft = load_config(FinetuneConfig, TINY_FINETUNE, [*base, "data.sft.packing=false"])
    assert "fsdp gathered" in size(sft, 8, volume).memory, "the same full finetune under SFT is sharded"


def test_estimate_reads_the_volume_of_trainpod_volume_as_the_other_commands_do(
    no_runpod, tmp_path, monkeypatch, capsys
):
    """Every command reads the volume mounted here from --volume, else $TRAINPOD_VOLUME; estimate read --volume alone,
    so on a pod (TRAINPOD_VOLUME set) it assumed an MFU a run there had measured."""
    status = tmp_path / "vol/runs/pretrain-125m/status.json"
    status.parent.mkdir(parents=True)
    status.write_text(json.dumps({"mfu": 0.31}))
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "vol"))
    assert cli.main(["estimate", str(PRETRAIN_125M)]) == 0
    assert "31% MFU, measured by run pretrain-125m" in capsys.readouterr().out
    monkeypatch.setenv("TRAINPOD_VOLUME", str(tmp_path / "nowhere"))
    assert cli.main(["estimate", str(PRETRAIN_125M)]) == 2
    assert f"TRAINPOD_VOLUME {tmp_path / 'nowhere'} does not exist here" in capsys.readouterr().out
