"""Merge: the merged model's weights equal peft's merge_and_unload() (max abs diff <= 1e-6 in fp32),
transformers loads and generates with it, and QLoRA adapters merge into the base they were trained on.

.venv/bin/pytest -q tests/test_convert_merge.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import safetensors.torch
import torch
from huggingface_hub import ModelCard
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

from trainpod.card import merged_model_card
from trainpod.chat import find_export
from trainpod.convert import run_convert
from trainpod.errors import ExitCode, InputError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume

from convert_support import (
    INPUT_IDS,
    convert_config,
    load_base,
    make_adapter,
    make_base,
    peft_logits,
    randomize_adapter,
    save_tokenizer,
)
from support import tree_snapshot

QLORA_SUMMARY = {
    "method": "qlora",
    "quantization": {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"},
}


@pytest.fixture
def vol(tmp_path: Path) -> Volume:
    return Volume(tmp_path / "volume")


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return make_base(tmp_path / "base")


def adapter_dir(vol: Volume) -> Path:
    return vol.run("ft").export / "adapter"


def merge(vol: Volume, **task) -> Path:
    [out] = run_convert(convert_config({"kind": "merge"} | task), vol, PreemptionWatch())
    return out


def saved_weights(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for path in sorted(folder.glob("*.safetensors")):
        tensors |= safetensors.torch.load_file(path)
    return tensors


def peft_merged(base_model: torch.nn.Module, adapter: Path) -> dict[str, torch.Tensor]:
    merged = PeftModel.from_pretrained(base_model, str(adapter)).merge_and_unload()
    return {k: v.detach() for k, v in merged.state_dict().items()}


def max_diff(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> float:
    assert set(got) == set(expected), f"tensor names differ: {set(got) ^ set(expected)}"
    return max((got[k].float() - expected[k].float()).abs().max().item() for k in expected)


@pytest.mark.parametrize(
    "lora",
    [
        pytest.param({}, id="lora"),
        pytest.param({"use_rslora": True, "rank_pattern": {"q_proj": 8}}, id="rslora-rank-pattern"),
        pytest.param({"use_dora": True}, id="dora"),
        pytest.param({"modules_to_save": ["lm_head"]}, id="modules_to_save"),
    ],
)
def test_merged_weights_equal_peft_merge_and_unload(vol: Volume, base: Path, lora: dict) -> None:
    make_adapter(base, adapter_dir(vol), **lora)
    out = merge(vol, dtype="float32")
    expected = peft_merged(load_base(base), adapter_dir(vol))
    diff = max_diff(saved_weights(out), expected)
    assert diff <= 1e-6, f"merged weights differ from peft's merge_and_unload() by {diff}"


def test_transformers_loads_and_generates_with_the_sharded_merged_model(vol: Volume, base: Path) -> None:
    make_adapter(base, adapter_dir(vol))
    out = merge(vol, dtype="float32", max_shard_size="100KB")
    assert len(list(out.glob("*.safetensors"))) > 1 and (out / "model.safetensors.index.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(INPUT_IDS)).logits[0]
        generated = model.generate(torch.tensor(INPUT_IDS), max_new_tokens=5, do_sample=False)
    assert (logits - peft_logits(base, adapter_dir(vol))).abs().max().item() <= 1e-4
    assert generated.shape == (1, len(INPUT_IDS[0]) + 5)
    assert tokenizer.decode(generated[0, -5:]).strip(), "the tokenizer must travel with the model"
    card = ModelCard.load(out / "README.md")  # the page a push to the Hub shows
    assert card.data.library_name == "transformers" and card.data.pipeline_tag == "text-generation"
    assert card.data.base_model is None, "a base on the volume is no Hub model to link to"
    assert "float32" in card.text and "AutoModelForCausalLM.from_pretrained" in card.text


@pytest.mark.parametrize(
    "lora", [pytest.param({}, id="tensor-level"), pytest.param({"use_dora": True}, id="peft")]
)
def test_every_shard_size_unit_the_config_takes_shards_the_merge(vol: Volume, base: Path, lora: dict) -> None:
    # The config took '100KiB' (and 'B'), which huggingface_hub's size parser refused: a ValueError and
    # exit 1 once the merge had run, a failed start the supervisor retried to the same end.
    make_adapter(base, adapter_dir(vol), **lora)
    out = merge(vol, dtype="float32", max_shard_size="100KiB")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert all(path.stat().st_size <= 100 * 1024 + 4096 for path in out.glob("*.safetensors"))
    AutoModelForCausalLM.from_pretrained(str(out))


def test_a_shard_size_of_nothing_is_a_config_error() -> None:
    from trainpod.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        convert_config({"kind": "merge", "max_shard_size": "0GB"})
    assert "max_shard_size" in str(caught.value) and "0GB" in str(caught.value)


def test_dtype_casts_after_merging_in_fp32(vol: Volume, base: Path) -> None:
    make_adapter(base, adapter_dir(vol))
    out = merge(vol, dtype="bfloat16")
    expected = {k: v.to(torch.bfloat16) for k, v in peft_merged(load_base(base), adapter_dir(vol)).items()}
    got = saved_weights(out)
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert max_diff(got, expected) == 0.0
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def nf4_base_as_trained(base: Path) -> torch.nn.Module:
    """What QLoRA training saw: the base loaded in 4 bits by transformers + bitsandbytes, dequantized."""
    import bitsandbytes.functional as bnb

    quantized = AutoModelForCausalLM.from_pretrained(
        str(base),
        dtype=torch.bfloat16,
        quantization_config=BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        ),
    )
    model = load_base(base)
    modules = dict(quantized.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            packed = getattr(modules.get(name), "weight", None)
            if getattr(packed, "quant_state", None) is not None:
                module.weight.copy_(bnb.dequantize_4bit(packed.data, packed.quant_state).float())
    return model


def test_qlora_dequantized_merges_into_the_4bit_base_it_was_trained_on(vol: Volume, base: Path) -> None:
    make_adapter(base, adapter_dir(vol), summary=QLORA_SUMMARY)
    out = merge(vol, dtype="float32")  # qlora_base defaults to dequantized
    expected = peft_merged(nf4_base_as_trained(base), adapter_dir(vol))
    assert max_diff(saved_weights(out), expected) <= 1e-6
    original = peft_merged(load_base(base), adapter_dir(vol))
    assert max_diff(saved_weights(out), original) > 1e-3, "the 4-bit round trip must change the base"


def test_qlora_original_merges_into_the_16bit_base(vol: Volume, base: Path) -> None:
    make_adapter(base, adapter_dir(vol), summary=QLORA_SUMMARY)
    out = merge(vol, dtype="float32", qlora_base="original")
    assert max_diff(saved_weights(out), peft_merged(load_base(base), adapter_dir(vol))) <= 1e-6


def test_merging_again_rewrites_nothing(vol: Volume, base: Path) -> None:
    make_adapter(base, adapter_dir(vol))
    out = merge(vol, dtype="float32")
    before = tree_snapshot(out.parent)
    merge(vol, dtype="float32")
    assert tree_snapshot(out.parent) == before
    manifest = json.loads((out / "manifest.json").read_text())
    assert "base/model.safetensors" in manifest["inputs"] and manifest["settings"]["dtype"] == "float32"


def test_a_tokenizer_changed_in_the_adapter_folder_is_merged_again(vol: Volume, base: Path) -> None:
    # The merged model takes its tokenizer from the adapter folder, but only the adapter's weights and
    # configs keyed the output: a chat template fixed there left the merged model with none, "up to date".
    make_adapter(base, adapter_dir(vol))
    out = merge(vol)
    assert AutoTokenizer.from_pretrained(str(out)).chat_template is None
    tokenizer = AutoTokenizer.from_pretrained(str(adapter_dir(vol)))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(adapter_dir(vol))
    merge(vol)
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == tokenizer.chat_template


def test_a_merge_made_under_another_runs_name_is_chatted_with_in_the_template_it_trained_on(
    vol: Volume, base: Path
) -> None:
    # `trainpod chat` reads the template from the run's training_summary.json or its finetune config.yaml: a
    # merge written under a convert run's own name has neither, and its finetuned model was prompted as plain text.
    make_adapter(base, adapter_dir(vol), summary={"data": {"template": "alpaca"}})
    [out] = run_convert(
        convert_config({"kind": "merge"}, name="ft-merged", adapter="run:ft"), vol, PreemptionWatch()
    )
    found = find_export(vol, "ft-merged")
    assert found.kind == "merged" and Path(found.model_dir) == out
    assert found.template == "alpaca"


def test_merge_into_a_base_of_another_shape_is_exit_2_before_anything_is_written(
    vol: Volume, base: Path, tmp_path: Path
) -> None:
    make_adapter(base, adapter_dir(vol))
    other = make_base(tmp_path / "wide", hidden=128)
    with pytest.raises(InputError) as caught:
        run_convert(convert_config(["mlx", {"kind": "merge"}], base_model=str(other)), vol, PreemptionWatch())
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "model.layers.0.mlp.up_proj" in str(caught.value)
    assert "(96, 64)" in str(caught.value) and "(96, 128)" in str(caught.value)
    assert sorted(p.name for p in vol.run("ft").export.iterdir()) == ["adapter"]


@pytest.mark.parametrize(
    ("config_change", "named"),
    [
        pytest.param({"model_type": "brand_new_arch"}, "brand_new_arch", id="unknown-model-type"),
        pytest.param(
            {"model_type": "own_code", "auto_map": {"AutoConfig": "configuration_own.OwnConfig"}},
            "custom code",
            id="own-python-code",
        ),
    ],
)
def test_a_base_transformers_cannot_build_is_exit_2_before_anything_is_written(
    vol: Volume, base: Path, config_change: dict, named: str
) -> None:
    # transformers' ValueError came out of the merge itself: a traceback, exit 1, and a retried start.
    make_adapter(base, adapter_dir(vol))
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps(config | config_change))
    with pytest.raises(InputError) as caught:
        merge(vol)
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert str(base) in message and named in message and "kind: mlx" in message, message
    assert sorted(p.name for p in vol.run("ft").export.iterdir()) == ["adapter"]


def test_an_unknown_base_model_is_exit_2_saying_what_to_set(vol: Volume, base: Path) -> None:
    make_adapter(base, adapter_dir(vol), summary={"base_model": "runs/nowhere/export/hf"})
    with pytest.raises(InputError) as caught:
        merge(vol)
    assert "runs/nowhere/export/hf" in str(caught.value) and "base_model" in str(caught.value)


@pytest.mark.parametrize(
    "targets",
    [
        pytest.param(["q_proj", "embed_tokens"], id="embedding-lora"),
        pytest.param(["q_proj", "lm_head"], id="head-lora"),
    ],
)
def test_lora_on_a_tied_embedding_or_head_changes_that_one_alone(
    vol: Volume, tmp_path: Path, targets: list
) -> None:
    tied = make_base(tmp_path / "tied", tie=True)
    make_adapter(tied, adapter_dir(vol), target_modules=targets)
    out = merge(vol, dtype="float32")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(INPUT_IDS)).logits[0]
    diff = (logits - peft_logits(tied, adapter_dir(vol))).abs().max().item()
    assert diff <= 1e-4, f"the merged model differs from the adapter it merges by {diff}"


def test_a_tied_base_stays_tied_when_the_merge_leaves_its_embedding_alone(
    vol: Volume, tmp_path: Path
) -> None:
    tied = make_base(tmp_path / "tied", tie=True)
    make_adapter(tied, adapter_dir(vol), target_modules=["q_proj", "v_proj"])
    out = merge(vol, dtype="float32")
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is True
    assert "lm_head.weight" not in saved_weights(out)


def test_an_output_named_like_its_input_adapter_is_exit_2_and_the_adapter_stays(
    vol: Volume, base: Path
) -> None:
    make_adapter(base, adapter_dir(vol))
    before = tree_snapshot(adapter_dir(vol))
    with pytest.raises(InputError) as caught:
        merge(vol, output="adapter")
    assert caught.value.exit_code == ExitCode.BAD_INPUT and "output" in str(caught.value)
    assert tree_snapshot(adapter_dir(vol)) == before


def test_a_hub_base_is_fetched_at_the_revision_the_finetune_pinned(
    vol: Volume, base: Path, monkeypatch
) -> None:
    # The hub cannot be reached here: snapshot_download is replaced by one that records what it was asked
    # and hands back the local base. Merging into the hub's current main instead of the pinned revision
    # gave a model the adapter was never trained on.
    import huggingface_hub

    asked = []

    def snapshot_download(repo_id, **kwargs):
        asked.append((repo_id, kwargs.get("revision"), Path(kwargs["cache_dir"]).name))
        return str(base)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    summary = {
        "base_model": "org/tiny-base",
        "base_model_folder": "/gone/with/the/pod",
        "base_model_revision": "abc123",
    }
    make_adapter(base, adapter_dir(vol), summary=summary)
    out = merge(vol)
    assert asked == [("org/tiny-base", "abc123", "hf")], "the finetune's revision, in the finetune's cache"
    card = ModelCard.load(out / "README.md")
    assert card.data.base_model == "org/tiny-base", "the Hub links a pushed merge to its hub base"
    assert "`org/tiny-base` at commit `abc123`" in card.text


def test_a_hub_base_the_finetune_downloaded_merges_offline_at_its_pinned_commit(
    vol: Volume, base: Path, monkeypatch
) -> None:
    # The finetune pins the hub commit it trained on; with HF_HUB_OFFLINE=1 (the volume's cache/hf as the hub)
    # huggingface_hub 1.x (the lent GPU machines' 1.33) looks a commit up online all the same and raised
    # OfflineModeIsEnabled: exit 75 'the next start tries again', at every start. The real huggingface_hub here.
    import shutil

    commit = "c" * 40
    cached = vol.cache() / "hf" / "models--org--tiny-base"
    shutil.copytree(base, cached / "snapshots" / commit)
    (cached / "refs").mkdir()
    (cached / "refs/main").write_text(commit)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)  # read once, at its import
    summary = {"base_model": "org/tiny-base", "base_model_folder": "/gone", "base_model_revision": commit}
    make_adapter(base, adapter_dir(vol), summary=summary)
    out = merge(vol)
    assert json.loads((out / "manifest.json").read_text())["files"], "merged into the cached base"


def test_a_hub_base_missing_from_the_cache_offline_is_exit_2_naming_hf_hub_offline(
    vol: Volume, base: Path, monkeypatch
) -> None:
    # It was exit 75 'the next start tries again': each start read the same cache, never the hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    summary = {"base_model": "org/tiny-base", "base_model_folder": "/gone", "base_model_revision": "c" * 40}
    make_adapter(base, adapter_dir(vol), summary=summary)
    with pytest.raises(InputError) as caught:
        merge(vol)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "org/tiny-base" in str(caught.value) and "HF_HUB_OFFLINE" in str(caught.value)


def test_an_adapter_of_conv1d_layers_merges_into_the_base_it_was_trained_on(
    vol: Volume, tmp_path: Path
) -> None:
    # GPT-2's Conv1D layers store weights as (in, out) and peft saves their adapters with fan_in_fan_out;
    # the shape check compared them as (out, in) and refused the adapter's own base as "does not fit" (exit 2).
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from convert_support import VOCAB, randomize_adapter, save_tokenizer

    torch.manual_seed(0)
    base = tmp_path / "gpt2"
    GPT2LMHeadModel(
        GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64)
    ).save_pretrained(base)
    save_tokenizer(base)
    lora = LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj", "c_fc"], fan_in_fan_out=True)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(str(base)), lora)
    randomize_adapter(model, seed=1)
    model.save_pretrained(adapter_dir(vol))
    summary = {"method": "lora", "base_model": str(base), "quantization": None}
    (adapter_dir(vol) / "training_summary.json").write_text(json.dumps(summary))
    out = merge(vol, dtype="float32")
    trained = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(str(base)), str(adapter_dir(vol))
    )
    merged = AutoModelForCausalLM.from_pretrained(str(out))
    with torch.no_grad():
        expected = trained.eval()(input_ids=torch.tensor(INPUT_IDS)).logits[0]
        got = merged.eval()(input_ids=torch.tensor(INPUT_IDS)).logits[0]
    assert (got - expected).abs().max().item() <= 1e-4


def trained_adapter(base: Path, folder: Path, **lora) -> torch.Tensor:
    """Save an adapter made by `get_peft_model` (so its init changes the base as in training) with random
    weights, and return the logits of that model in memory: what the merged model must give."""
    from peft import LoraConfig, get_peft_model

    from convert_support import randomize_adapter, save_tokenizer

    model = get_peft_model(
        load_base(base), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", **lora)
    )
    randomize_adapter(model, seed=1)
    model.save_pretrained(folder)
    save_tokenizer(folder)
    (folder / "training_summary.json").write_text(json.dumps({"method": "lora", "base_model": str(base)}))
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor(INPUT_IDS)).logits[0]


@pytest.mark.parametrize("init", ["pissa", "olora"])
def test_an_adapter_whose_init_changed_the_base_repeatably_merges_to_the_trained_model(
    vol: Volume, base: Path, init: str
) -> None:
    expected = trained_adapter(base, adapter_dir(vol), init_lora_weights=init)
    out = merge(vol, dtype="float32")
    with torch.no_grad():
        got = (
            AutoModelForCausalLM.from_pretrained(str(out)).eval()(input_ids=torch.tensor(INPUT_IDS)).logits[0]
        )
    assert (got - expected).abs().max().item() <= 1e-4


def test_an_adapter_whose_init_changed_the_base_unrepeatably_is_exit_2_before_anything_is_written(
    vol: Volume, base: Path
) -> None:
    # PiSSA's fast variant takes a randomized SVD of the base: peft's load made another one and the merged
    # model's logits differed from the trained model's by 0.1, silently, exit 0.
    trained_adapter(base, adapter_dir(vol), init_lora_weights="pissa_niter_2")
    with pytest.raises(InputError) as caught:
        merge(vol)
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert (
        "init_lora_weights='pissa_niter_2'" in message
        and "path_initial_model_for_weight_conversion" in message
    )
    assert sorted(p.name for p in vol.run("ft").export.iterdir()) == ["adapter"]


def test_a_hub_base_brings_its_chat_template_file_into_the_merged_model(
    vol: Volume, tmp_path: Path, monkeypatch
) -> None:
    # transformers writes a tokenizer's chat template to chat_template.jinja; the fetch of a hub base left
    # that file out, so a merged model whose tokenizer came from the base had no chat template, silently.
    import fnmatch
    import shutil

    import huggingface_hub

    hub_repo = make_base(tmp_path / "hub-repo")
    tokenizer = AutoTokenizer.from_pretrained(str(hub_repo))
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(hub_repo)
    assert (hub_repo / "chat_template.jinja").is_file()

    def snapshot_download(repo_id, allow_patterns, cache_dir, **kwargs):
        """The hub's: only the files the patterns allow."""
        snapshot = Path(cache_dir) / "snapshot"
        snapshot.mkdir(parents=True)
        for path in hub_repo.iterdir():
            if any(fnmatch.fnmatch(path.name, pattern) for pattern in allow_patterns):
                shutil.copy(path, snapshot / path.name)
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    make_adapter(
        hub_repo, adapter_dir(vol), summary={"base_model": "org/tiny-base", "base_model_folder": "/gone"}
    )
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):  # a tokenizer-less adapter
        (adapter_dir(vol) / name).unlink(missing_ok=True)
    out = merge(vol)
    assert AutoTokenizer.from_pretrained(str(out)).chat_template == tokenizer.chat_template


@pytest.mark.parametrize("damaged", ["adapter", "base"])
def test_a_truncated_weights_file_is_exit_2_naming_it_before_anything_is_written(
    vol: Volume, base: Path, damaged: str
) -> None:
    # A copy cut short: safetensors' SafetensorError came out as a traceback, exit 1, and retried starts.
    make_adapter(base, adapter_dir(vol))
    path = (
        adapter_dir(vol) / "adapter_model.safetensors" if damaged == "adapter" else base / "model.safetensors"
    )
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(InputError) as caught:
        run_convert(convert_config(["mlx", {"kind": "merge"}]), vol, PreemptionWatch())
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert str(path) in str(caught.value) and "truncated" in str(caught.value)
    assert sorted(p.name for p in vol.run("ft").export.iterdir()) == ["adapter"]


def test_a_lora_bias_on_layers_without_a_bias_is_exit_2_before_anything_is_written(
    vol: Volume, base: Path
) -> None:
    # peft raised RuntimeError ("the base layer has no bias") once the whole model was built: exit 1.
    make_adapter(base, adapter_dir(vol), lora_bias=True)
    with pytest.raises(InputError) as caught:
        merge(vol)
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "lora_bias=True" in message and "model.layers.0." in message and "PEFT" in message, message
    assert sorted(p.name for p in vol.run("ft").export.iterdir()) == ["adapter"]


@pytest.mark.parametrize(
    "lora",
    [
        pytest.param({"modules_to_save": ["embed_tokens", "lm_head"]}, id="modules_to_save"),
        pytest.param({"target_modules": ["q_proj", "embed_tokens"]}, id="embedding-lora"),
    ],
)
def test_an_adapter_trained_with_tokens_added_is_exit_2_naming_the_vocabularies_before_anything_is_written(
    vol: Volume, base: Path, lora: dict
) -> None:
    # Trained on the base with its embeddings resized for added tokens (a chat format's), the adapter carries
    # 136-row embeddings: peft's load_state_dict raised 'size mismatch' in the merge, a traceback and exit 1.
    resized = load_base(base)
    resized.resize_token_embeddings(136, mean_resizing=False)
    model = get_peft_model(
        resized, LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]} | lora)
    )
    randomize_adapter(model, 1)
    model.save_pretrained(adapter_dir(vol))
    save_tokenizer(adapter_dir(vol))
    (adapter_dir(vol) / "training_summary.json").write_text(
        json.dumps({"method": "lora", "base_model": str(base)})
    )
    with pytest.raises(InputError) as caught:
        merge(vol)
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "model.embed_tokens" in message and "136" in message and "(128, 64)" in message, message
    assert "resize_token_embeddings(136)" in message and "from 128 to 136 tokens" in message, message
    assert sorted(p.name for p in vol.run("ft").export.iterdir()) == ["adapter"]


@pytest.mark.parametrize("task", ["merge", "mlx"])
def test_a_base_stored_in_4_bits_is_exit_2_asking_for_the_16bit_base_before_anything_is_written(
    vol: Volume, base: Path, tmp_path: Path, task: str
) -> None:
    # A hub base saved quantized (an org/<model>-bnb-4bit, a common QLoRA base) holds packed uint8 weights of
    # shape (n, 1): the refusal listed every module's 'expects weight shape (64, 64), the base model's is
    # (2048, 1)' and told the user to point base_model at the model the adapter was trained on, which it was.
    quantized = AutoModelForCausalLM.from_pretrained(
        str(base),
        dtype=torch.bfloat16,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4"),
    )
    quantized.save_pretrained(tmp_path / "base-bnb-4bit")
    make_adapter(
        base, adapter_dir(vol), summary=QLORA_SUMMARY | {"base_model": str(tmp_path / "base-bnb-4bit")}
    )
    with pytest.raises(InputError) as caught:
        run_convert(convert_config([task]), vol, PreemptionWatch())
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert str(tmp_path / "base-bnb-4bit") in message and "bitsandbytes" in message, message
    assert "16-bit" in message and "base_model" in message and "(2048, 1)" not in message, message
    assert sorted(p.name for p in vol.run("ft").export.iterdir()) == ["adapter"]


@pytest.mark.parametrize(
    ("objective", "settings", "line"),
    [
        ("simpo", {"beta": 2.0, "gamma": 1.0}, "lora, rank 8, alpha 16, SimPO with beta 2, gamma 1)"),
        ("orpo", {"beta": 0.1}, "lora, rank 8, alpha 16, ORPO with beta 0.1)"),
        (
            "dpo",
            {"beta": 0.1, "loss": "sigmoid", "label_smoothing": 0.0},
            "lora, rank 8, alpha 16, DPO with beta 0.1)",
        ),
        (
            "dpo",
            {"beta": 0.5, "loss": "ipo", "label_smoothing": 0.0},
            "lora, rank 8, alpha 16, DPO with beta 0.5, ipo loss)",
        ),
        (
            "dpo",
            {"beta": 0.1, "loss": "sigmoid", "label_smoothing": 0.2},
            "lora, rank 8, alpha 16, DPO with beta 0.1, label smoothing 0.2)",
        ),
    ],
)
def test_a_preference_merges_card_names_its_objective_and_each_setting_that_shaped_it(
    objective, settings, line
):
    """The card said 'SIMPO with beta 2': not the objective's name, and without the target margin gamma (nor
    DPO's ipo loss or label smoothing) that a person needs to train it again."""
    summary = {"method": "lora", "lora": {"r": 8, "alpha": 16}, "objective": objective, objective: settings}
    card = ModelCard(merged_model_card(summary, "base", None, "float32", dequantized=False, vision=False))
    assert f"finetuned with trainpod ({line}" in card.text, card.text
    assert objective in card.data.tags
