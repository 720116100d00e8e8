"""PEFT -> MLX: mlx-lm itself loads the converted adapter and gives PEFT's logits (max abs diff <= 1e-4).

.venv/bin/pytest -q tests/test_convert_mlx.py
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlx_lm.utils import load as mlx_load

from trainpod.convert import run_convert
from trainpod.errors import ExitCode, InputError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume

from convert_support import INPUT_IDS, base_logits, convert_config, make_adapter, make_base, peft_logits
from support import tree_snapshot

TOLERANCE = 1e-4


@pytest.fixture
def vol(tmp_path: Path) -> Volume:
    return Volume(tmp_path / "volume")


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return make_base(tmp_path / "base")


def adapter_dir(vol: Volume, run: str = "ft") -> Path:
    return vol.run(run).export / "adapter"


def mlx_logits(base: Path, adapter: Path) -> np.ndarray:
    import mlx.core as mx

    model, _tokenizer = mlx_load(str(base), adapter_path=str(adapter))
    logits = model(mx.array(INPUT_IDS))[0]
    return np.array(logits.astype(mx.float32))


def convert_to_mlx(vol: Volume, **fields) -> Path:
    [out] = run_convert(convert_config({"kind": "mlx"}, **fields), vol, PreemptionWatch())
    return out


@pytest.mark.parametrize(
    "lora",
    [
        pytest.param({}, id="lora"),
        pytest.param({"use_rslora": True, "r": 8, "lora_alpha": 4}, id="rslora"),
        pytest.param(
            {
                "r": 4,
                "lora_alpha": 8,
                "rank_pattern": {"q_proj": 8, "model.layers.1.mlp.down_proj": 2},
                "alpha_pattern": {"v_proj": 32, "gate_proj": 3},
            },
            id="rank-and-alpha-pattern",
        ),
        pytest.param({"use_dora": True}, id="dora"),
        pytest.param(
            {"target_modules": ["q_proj", "v_proj"], "layers_to_transform": [0]}, id="first-layer-only"
        ),
    ],
)
def test_mlx_lm_with_converted_adapter_gives_peft_logits(vol: Volume, base: Path, lora: dict) -> None:
    make_adapter(base, adapter_dir(vol), **lora)
    out = convert_to_mlx(vol)
    expected = peft_logits(base, adapter_dir(vol)).numpy()
    assert np.abs(expected - base_logits(base).numpy()).max() > 1e-2, "the adapter must change the logits"
    got = mlx_logits(base, out)
    diff = np.abs(got - expected).max()
    assert diff <= TOLERANCE, f"mlx-lm logits differ from PEFT's by {diff} (keys, transposes or scale wrong)"
    readme = (out / "README.md").read_text()
    assert str(base) in readme and "adapter_path" in readme


def test_rank_pattern_pads_to_the_largest_rank_and_scale_is_the_default(vol: Volume, base: Path) -> None:
    import json

    make_adapter(base, adapter_dir(vol), r=4, lora_alpha=8, rank_pattern={"q_proj": 8})
    out = convert_to_mlx(vol)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["lora_parameters"]["rank"] == 8
    assert config["lora_parameters"]["scale"] == 2.0
    assert config["num_layers"] == 2 and config["fine_tune_type"] == "lora"
    assert set(config["lora_parameters"]["keys"]) == {
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
    }


def test_converting_again_rewrites_nothing(vol: Volume, base: Path) -> None:
    make_adapter(base, adapter_dir(vol))
    out = convert_to_mlx(vol)
    before = tree_snapshot(out.parent)
    assert convert_to_mlx(vol) == out
    assert tree_snapshot(out.parent) == before
    manifest = json.loads((out / "manifest.json").read_text())
    weights = adapter_dir(vol) / "adapter_model.safetensors"
    assert manifest["inputs"]["adapter/adapter_model.safetensors"] == {
        "path": str(weights),
        "bytes": weights.stat().st_size,
        "mtime_ns": weights.stat().st_mtime_ns,
    }
    assert set(manifest["files"]) == {"adapters.safetensors", "adapter_config.json", "README.md"}
    for name, entry in manifest["files"].items():  # the whole file's sha256, as sha256sum prints it
        assert entry["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest(), name


def test_a_changed_adapter_is_converted_again(vol: Volume, base: Path) -> None:
    make_adapter(base, adapter_dir(vol), seed=1)
    out = convert_to_mlx(vol)
    first = (out / "adapters.safetensors").read_bytes()
    make_adapter(base, adapter_dir(vol), seed=2)
    convert_to_mlx(vol)
    assert (out / "adapters.safetensors").read_bytes() != first
    assert not list(out.parent.glob("*.tmp-*")), "no temp folder may stay behind"


def test_an_output_folder_another_workload_wrote_is_exit_2_and_stays(vol: Volume, base: Path) -> None:
    # Run ft2 is a finetune whose own adapter is in export/adapter; converting ft1's adapter into ft2's
    # export with output: adapter replaced that folder whole, and the finetune's adapter was gone.
    make_adapter(base, adapter_dir(vol, "ft1"))
    make_adapter(base, adapter_dir(vol, "ft2"), seed=5)
    before = tree_snapshot(adapter_dir(vol, "ft2"))
    with pytest.raises(InputError) as caught:
        run_convert(
            convert_config({"kind": "mlx", "output": "adapter"}, name="ft2", adapter="run:ft1"),
            vol,
            PreemptionWatch(),
        )
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert str(adapter_dir(vol, "ft2")) in str(caught.value) and "`output`" in str(caught.value)
    assert tree_snapshot(adapter_dir(vol, "ft2")) == before
    assert sorted(p.name for p in vol.run("ft2").export.iterdir()) == ["adapter"], "no temp folder either"


@pytest.mark.parametrize(
    ("lora", "feature"),
    [
        pytest.param({"modules_to_save": ["lm_head"]}, "modules_to_save", id="modules_to_save"),
        pytest.param({"bias": "all"}, "bias='all'", id="bias"),
        pytest.param({"lora_bias": True}, "lora_bias", id="lora_bias"),
        pytest.param({"target_modules": ["q_proj", "embed_tokens"]}, "embedding", id="embedding-lora"),
        pytest.param({"init_lora_weights": "pissa"}, "init_lora_weights='pissa'", id="pissa"),
        pytest.param({"init_lora_weights": "olora"}, "init_lora_weights='olora'", id="olora"),
    ],
)
def test_unconvertible_adapters_are_refused_with_exit_2(
    vol: Volume, base: Path, lora: dict, feature: str
) -> None:
    make_adapter(base, adapter_dir(vol), **lora)
    with pytest.raises(InputError) as caught:
        convert_to_mlx(vol)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    message = str(caught.value)
    assert feature in message, message
    assert "kind: merge" in message and "mlx_lm.convert" in message, "the message must say what to do instead"
    assert not (vol.run("ft").export / "mlx").exists()


def test_a_base_model_of_another_shape_is_exit_2_naming_module_and_shapes(
    vol: Volume, tmp_path: Path
) -> None:
    trained_on = make_base(tmp_path / "trained-on")
    other = make_base(tmp_path / "other", hidden=32)
    make_adapter(trained_on, adapter_dir(vol))
    with pytest.raises(InputError) as caught:
        convert_to_mlx(vol, base_model=str(other))
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "model.layers.0.self_attn.q_proj" in message
    assert "(64, 64)" in message and "(32, 32)" in message, message


def test_a_base_model_missing_modules_is_exit_2_naming_the_module(vol: Volume, tmp_path: Path) -> None:
    trained_on = make_base(tmp_path / "trained-on")
    shallow = make_base(tmp_path / "shallow", layers=1)
    make_adapter(trained_on, adapter_dir(vol))
    with pytest.raises(InputError) as caught:
        convert_to_mlx(vol, base_model=str(shallow))
    assert "model.layers.1.self_attn.q_proj" in str(caught.value)
    assert "no model.layers.1.self_attn.q_proj.weight" in str(caught.value)


@pytest.mark.parametrize("task", ["mlx", "merge"])
def test_a_misspelt_base_folder_on_the_volume_is_exit_2_not_a_hub_id(
    vol: Volume, monkeypatch: pytest.MonkeyPatch, task: str
) -> None:
    # models/ is a folder on the volume, so models/base-typo is a path, as the finetune reads it: taken for a hub
    # id, an mlx task wrote an adapter naming that base (exit 0) and a merge asked the hub for it (offline:
    # exit 75 at every start).
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    make_adapter(make_base(vol.root / "models" / "base"), adapter_dir(vol))
    with pytest.raises(InputError) as caught:
        run_convert(convert_config([task], base_model="models/base-typo"), vol, PreemptionWatch())
    message = str(caught.value)
    assert caught.value.exit_code == ExitCode.BAD_INPUT
    assert "models/base-typo" in message and str(vol.root / "models") in message and "base_model" in message
    assert sorted(p.name for p in vol.run("ft").export.iterdir()) == ["adapter"]


def test_a_missing_adapter_names_the_folder_and_the_command(vol: Volume) -> None:
    with pytest.raises(InputError) as caught:
        convert_to_mlx(vol)
    assert str(adapter_dir(vol)) in str(caught.value)
    assert "trainpod run finetune" in str(caught.value)


def test_the_shipped_convert_config_loads_and_names_both_demo_outputs() -> None:
    from trainpod.config import load_config
    from trainpod.config.convert import ConvertConfig, MergeTask, MlxTask

    config = load_config(ConvertConfig, Path(__file__).resolve().parents[1] / "configs/convert/tiny.yaml")
    assert config.adapter_ref == "run:tiny-finetune"
    assert [type(t) for t in config.task] == [MlxTask, MergeTask]


def test_a_single_task_or_a_bare_kind_is_accepted_and_bad_tasks_are_config_errors() -> None:
    from trainpod.config.convert import ExportTask, MlxTask
    from trainpod.errors import ConfigError

    assert [type(t) for t in convert_config("mlx").task] == [MlxTask]
    assert convert_config({"kind": "export", "step": 20}).task[0] == ExportTask(kind="export", step=20)
    with pytest.raises(ConfigError) as caught:
        convert_config([{"kind": "mlx"}, {"kind": "merge", "output": "mlx"}])
    assert "output" in str(caught.value) and caught.value.exit_code == ExitCode.BAD_INPUT
    with pytest.raises(ConfigError) as caught:
        convert_config({"kind": "gguf"})
    assert "gguf" in str(caught.value) and "mlx" in str(caught.value)


def test_a_hub_base_and_an_adapter_that_may_skip_the_last_layers_is_exit_2(vol: Volume, base: Path) -> None:
    make_adapter(base, adapter_dir(vol), target_modules=r".*layers\.0\.self_attn\.(q|v)_proj")
    (adapter_dir(vol) / "training_summary.json").unlink()  # a foreign adapter naming its base by hub id
    config_path = adapter_dir(vol) / "adapter_config.json"
    config_path.write_text(
        json.dumps(json.loads(config_path.read_text()) | {"base_model_name_or_path": "org/tiny"})
    )
    with pytest.raises(InputError) as caught:
        convert_to_mlx(vol)
    assert "base_model" in str(caught.value) and "target_modules" in str(caught.value)
    assert not (vol.run("ft").export / "mlx").exists()


def test_mlx_lm_reads_the_merged_models_rope_as_the_bases(vol: Volume, base: Path) -> None:
    """The hub's config.json (transformers 4) has top-level rope_theta/rope_scaling, which mlx-lm reads."""
    config = json.loads((base / "config.json").read_text())
    config.pop("rope_parameters", None)
    config["rope_theta"] = 500000.0
    config["rope_scaling"] = {
        "rope_type": "llama3", "factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
        "original_max_position_embeddings": 8,
    }  # fmt: skip
    (base / "config.json").write_text(json.dumps(config))
    make_adapter(base, adapter_dir(vol))
    [out] = run_convert(convert_config({"kind": "merge", "dtype": "float32"}), vol, PreemptionWatch())
    import mlx.core as mx

    model, _tokenizer = mlx_load(str(out))
    got = np.array(model(mx.array(INPUT_IDS))[0].astype(mx.float32))
    diff = np.abs(got - peft_logits(base, adapter_dir(vol)).numpy()).max()
    assert diff <= TOLERANCE, f"mlx-lm's merged model differs from PEFT's by {diff} (RoPE settings lost)"


def test_the_mlx_adapter_names_its_base_by_hub_id_not_by_the_volumes_download(
    vol: Volume, tmp_path: Path
) -> None:
    download = make_base(tmp_path / "cache/models--org--tiny/snapshots/abc")
    make_adapter(
        download, adapter_dir(vol), summary={"base_model": "org/tiny", "base_model_folder": str(download)}
    )
    out = convert_to_mlx(vol)
    assert json.loads((out / "adapter_config.json").read_text())["model"] == "org/tiny"
    readme = (out / "README.md").read_text()
    assert "--model org/tiny" in readme and str(download) not in readme


def test_the_mlx_adapter_names_the_revision_of_its_hub_base_the_finetune_trained_on(
    vol: Volume, tmp_path: Path
) -> None:
    # A merge fetches the commit the finetune pinned; the MLX adapter's README loaded the hub's current main,
    # which a push since then (new weights) made a base the adapter was never trained on.
    download = make_base(tmp_path / "cache/models--org--tiny/snapshots/abc123")
    summary = {"base_model": "org/tiny", "base_model_folder": str(download), "base_model_revision": "abc123"}
    make_adapter(download, adapter_dir(vol), summary=summary)
    out = convert_to_mlx(vol)
    assert json.loads((out / "adapter_config.json").read_text())["revision"] == "abc123"
    readme = (out / "README.md").read_text()
    assert 'load("org/tiny", adapter_path=".", revision="abc123")' in readme, readme
    assert "--revision abc123" in readme, readme


def test_the_mlx_adapter_of_a_qlora_finetune_says_it_was_trained_on_the_4bit_base(
    vol: Volume, base: Path
) -> None:
    # Its README said to load it on 'exactly that model (the same weights)': the 16-bit base, which a QLoRA
    # adapter never saw (the merge's default is the 4-bit round-tripped base for that reason).
    quantization = {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"}
    make_adapter(base, adapter_dir(vol), summary={"method": "qlora", "quantization": quantization})
    readme = (convert_to_mlx(vol) / "README.md").read_text()
    assert "QLoRA" in readme and "nf4" in readme and "qlora_base: dequantized" in readme, readme
    assert "mlx_lm.convert" in readme, readme


def save_chatml_tokenizer(folder: Path) -> None:
    """convert_support's word-level tokenizer with its last two words made ChatML's special tokens (the base's
    vocabulary, 128, unchanged) and no chat template, as a base model's tokenizer has none."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from convert_support import WORDS

    words = [*WORDS[:-2], "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", eos_token="<eos>")
    fast.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    fast.save_pretrained(folder)


def test_the_mlx_adapter_carries_the_chat_template_it_was_trained_on_and_where_answers_end(
    vol: Volume, base: Path
) -> None:
    """mlx-lm takes the base's tokenizer: on a base with no chat template (Llama 2, Mistral) or another one, an
    adapter trained on ChatML was prompted as it never was, and generation ran past the <|im_end|> its answers
    were trained to end with (the base's eos alone stops it), which the merge's tokenizer and generation
    config carry."""
    save_chatml_tokenizer(base)
    make_adapter(base, adapter_dir(vol), summary={"data": {"template": "chatml"}})
    save_chatml_tokenizer(adapter_dir(vol))
    out = convert_to_mlx(vol)
    readme = (out / "README.md").read_text()
    assert 'tokenizer_config={"chat_template": open("chat_template.jinja").read()}' in readme, readme
    assert 'tokenizer.add_eos_token("<|im_end|>")' in readme and '--extra-eos-token "<|im_end|>"' in readme
    template = (out / "chat_template.jinja").read_text()
    _model, tokenizer = mlx_load(
        str(base), adapter_path=str(out), tokenizer_config={"chat_template": template}
    )
    tokenizer.add_eos_token("<|im_end|>")
    conversation = [{"role": "user", "content": "w5"}]
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    assert prompt == "<|im_start|>user\nw5<|im_end|>\n<|im_start|>assistant\n"
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in tokenizer.eos_token_ids


def test_the_mlx_adapter_trained_on_the_bases_own_template_names_the_end_of_turn_to_stop_at(
    vol: Volume, base: Path
) -> None:
    """A base whose own template ends turns with <|im_end|> and whose eos is another token (a base Qwen2.5):
    mlx-lm loads the template with the base but stops at the eos alone."""
    from transformers import AutoTokenizer

    save_chatml_tokenizer(base)
    tokenizer = AutoTokenizer.from_pretrained(str(base))
    tokenizer.chat_template = (
        "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tokenizer.save_pretrained(base)
    make_adapter(base, adapter_dir(vol), summary={"data": {"template": "tokenizer"}})
    tokenizer.save_pretrained(adapter_dir(vol))
    out = convert_to_mlx(vol)
    readme = (out / "README.md").read_text()
    assert '--extra-eos-token "<|im_end|>"' in readme and "the base's chat template" in readme, readme
    assert not (out / "chat_template.jinja").exists(), "mlx-lm loads the base's own template with the base"


@pytest.mark.parametrize(
    "architecture",
    [
        pytest.param({"model_type": "llama", "rope_theta": 500000.0}, id="llama-rope-500k"),
        pytest.param({"model_type": "qwen2"}, id="qwen2-default-rope"),  # mlx-lm's qwen2 defaults to 1e6
    ],
)
def test_mlx_lm_builds_an_exported_model_with_the_rope_it_was_trained_with(
    tmp_path: Path, architecture: dict
):
    """export_hf is what pretrain, full finetunes and `kind: export` write; transformers 5 saves RoPE only as
    rope_parameters, which mlx-lm does not read."""
    import mlx.core as mx
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from trainpod.train.export import export_hf

    tokenizer_dir = make_base(tmp_path / "tokenizer")
    settings = dict(architecture)
    config = AutoConfig.for_model(
        settings.pop("model_type"), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, vocab_size=256, **settings,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    out = export_hf(model, tokenizer_dir, tmp_path / "export/hf", torch.float32)
    with torch.no_grad():
        expected = model(input_ids=torch.tensor(INPUT_IDS)).logits[0].numpy()
    mlx_model, _tokenizer = mlx_load(str(out))
    got = np.array(mlx_model(mx.array(INPUT_IDS))[0].astype(mx.float32))
    assert np.abs(got - expected).max() <= TOLERANCE, "mlx-lm built the exported model with another RoPE"


def test_a_gpt_neox_adapter_loads_in_mlx_lm_under_its_renamed_layers_and_gives_peft_logits(
    vol: Volume, tmp_path: Path
) -> None:
    # mlx-lm renames GPT-NeoX's (Pythia's) gpt_neox.layers.<i> to model.h.<i> and its embed_out to
    # model.embed_out: the adapter kept the hub's names, which mlx-lm refused at load ("not an adapter parameter").
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    from convert_support import VOCAB, save_tokenizer

    torch.manual_seed(0)
    config = GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=256,
        max_position_embeddings=64, rotary_pct=0.25, tie_word_embeddings=False,
    )  # fmt: skip
    base = tmp_path / "neox"
    GPTNeoXForCausalLM(config).save_pretrained(base)
    save_tokenizer(base)
    saved = json.loads((base / "config.json").read_text())  # as a hub Pythia's config.json has them
    (base / "config.json").write_text(json.dumps(saved | {"rotary_pct": 0.25, "rotary_emb_base": 10000}))
    model = get_peft_model(
        GPTNeoXForCausalLM.from_pretrained(base),
        LoraConfig(r=4, lora_alpha=8, target_modules=["query_key_value", "dense_4h_to_h", "embed_out"]),
    )
    convert_and_compare_logits(vol, model, GPTNeoXForCausalLM, base)


def test_a_gpt_j_adapter_loads_in_mlx_lm_under_its_renamed_model_and_gives_peft_logits(
    vol: Volume, tmp_path: Path
) -> None:
    # mlx-lm's GPT-J keeps transformer.* as model.* (GPTBigCode, also transformer.h, keeps transformer.*): the
    # adapter kept the hub's names, which mlx-lm refused at load, and its keys named no layer's modules.
    from transformers import GPTJForCausalLM

    model, base = gptj_peft_model(tmp_path, target_modules=["q_proj", "v_proj", "fc_out"])
    out = convert_and_compare_logits(vol, model, GPTJForCausalLM, base)
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["lora_parameters"]["keys"] == ["attn.q_proj", "attn.v_proj", "mlp.fc_out"]


def test_a_gpt_j_adapter_on_a_hub_base_not_fetched_loads_in_mlx_lm_and_gives_peft_logits(
    vol: Volume, tmp_path: Path
) -> None:
    # A base named by hub id has no config.json here to give its model_type, and the adapter kept transformers'
    # transformer.h.<i>, which mlx-lm refused at load; GPT-J's module names tell it apart.
    from transformers import GPTJForCausalLM

    model, base = gptj_peft_model(tmp_path)
    out = convert_and_compare_logits(vol, model, GPTJForCausalLM, base, named_base="org/tiny-gptj")
    saved = json.loads((out / "adapter_config.json").read_text())
    assert saved["lora_parameters"]["keys"] == ["attn.out_proj", "attn.q_proj", "mlp.fc_in"]


def test_a_gpt_j_adapter_of_its_first_layer_takes_the_bases_depth_and_gives_peft_logits_in_mlx_lm(
    vol: Volume, tmp_path: Path
) -> None:
    # GPT-J's depth is n_layer, not num_hidden_layers: num_layers was not read from the base, and an adapter
    # skipping the last layer was refused with "set base_model to the base model's folder", which it was.
    from transformers import GPTJForCausalLM

    model, base = gptj_peft_model(tmp_path, layers_to_transform=[0])
    out = convert_and_compare_logits(vol, model, GPTJForCausalLM, base)
    assert json.loads((out / "adapter_config.json").read_text())["num_layers"] == 2


def gptj_peft_model(tmp_path: Path, **lora: Any) -> tuple[Any, Path]:
    """A tiny two-layer GPT-J saved as a base folder, and a PEFT LoRA model on it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import GPTJConfig, GPTJForCausalLM

    from convert_support import VOCAB, save_tokenizer

    torch.manual_seed(0)
    config = GPTJConfig(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, rotary_dim=8)
    base = tmp_path / "gptj"
    GPTJForCausalLM(config).save_pretrained(base)
    save_tokenizer(base)
    model = get_peft_model(
        GPTJForCausalLM.from_pretrained(base),
        LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "out_proj", "fc_in"], **lora}),
    )
    return model, base


def convert_and_compare_logits(
    vol: Volume, model: Any, model_class: Any, base: Path, named_base: str | None = None
) -> Path:
    """Save the peft `model`'s randomized adapter as a finetune's, convert it, and check mlx-lm's logits of the
    converted adapter on `base` against peft's; returns the mlx output folder. `named_base`: the hub id the
    finetune names its base by, not fetched for the convert (the base folder otherwise)."""
    import torch
    from peft import PeftModel

    from convert_support import randomize_adapter, save_tokenizer

    randomize_adapter(model, 1)
    model.save_pretrained(adapter_dir(vol))
    save_tokenizer(adapter_dir(vol))
    (adapter_dir(vol) / "training_summary.json").write_text(
        json.dumps({"method": "lora", "base_model": named_base or str(base)})
    )
    out = convert_to_mlx(vol)
    peft_model = PeftModel.from_pretrained(model_class.from_pretrained(base), str(adapter_dir(vol))).eval()
    with torch.no_grad():
        expected = peft_model(input_ids=torch.tensor(INPUT_IDS)).logits[0].numpy()
        with peft_model.disable_adapter():
            unadapted = peft_model(input_ids=torch.tensor(INPUT_IDS)).logits[0].numpy()
    assert np.abs(expected - unadapted).max() > 1e-2, "the adapter must change the logits"
    diff = np.abs(mlx_logits(base, out) - expected).max()
    assert diff <= TOLERANCE, f"mlx-lm logits differ from PEFT's by {diff}"
    return out
