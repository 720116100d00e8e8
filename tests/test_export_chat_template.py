"""What a finetune on a built-in template (data.sft.template chatml, qwen, llama3, alpaca) exports, and what a
merge of its adapter makes, carry that template as the tokenizer's chat_template and stop at its end of
turn, as transformers loads them: a base tokenizer (Llama 2's, Mistral's, a base Qwen's) has no template."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer, GenerationConfig

from trainpod.convert import run_convert
from trainpod.preemption import PreemptionWatch
from trainpod.sft.formats import Sample
from trainpod.sft.templates import build_template
from trainpod.volume import Volume

from convert_support import convert_config
from finetune_support import FINETUNE_RUN, finetune_args
from sft_support import make_metaspace_tokenizer, make_tiny_tokenizer
from support import run_trainpod

SAMPLES = [
    Sample(None, (("Add 2 and 3.", "5"),)),
    Sample("Be brief.", (("Add 2 and 3.", "5"), ("Reverse cloud", "duolc"))),
    Sample(None, (("a", "b"), ("c", "d"), ("e", "f"))),
]
SYSTEMLESS = "Add 2 and 3."


def messages(sample: Sample) -> list[dict[str, str]]:
    out = [{"role": "system", "content": sample.system}] if sample.system else []
    for user, answer in sample.pairs:
        out += [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]
    return out


@pytest.mark.parametrize(
    "name, make_tokenizer",
    [
        ("chatml", make_tiny_tokenizer),
        ("qwen", make_tiny_tokenizer),
        ("llama3", make_tiny_tokenizer),
        ("alpaca", make_tiny_tokenizer),
        ("alpaca", make_metaspace_tokenizer),  # Llama 2's kind: bos <s> before it all, eos </s> ends answers
    ],
)
def test_a_builtin_templates_jinja_renders_what_training_rendered(tmp_path, name, make_tokenizer):
    folder = make_tokenizer(tmp_path / "tok")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = build_template(name, tokenizer)
    tokenizer.chat_template = template.jinja()
    for sample in SAMPLES:
        segments = template.segments(sample)
        texts = [segments.prefix, *(text for pair in segments.pairs for text in pair)]
        conversation = messages(sample)
        assert tokenizer.apply_chat_template(conversation, tokenize=False) == "".join(texts)
        prompt = tokenizer.apply_chat_template(conversation[:-1], tokenize=False, add_generation_prompt=True)
        assert prompt == "".join(texts[:-1])


@pytest.fixture(scope="module")
def exported(tmp_path_factory, finetune_base_volume) -> Path:
    """A volume with a 2-step chatml LoRA run's adapter and a 2-step chatml full finetune's HF export, both
    on the tiny base, whose tokenizer has no chat_template."""
    volume = tmp_path_factory.mktemp("export") / "volume"
    shutil.copytree(finetune_base_volume, volume)
    steps = ("--set", "train.max_steps=2", "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=2")
    for method, run in (("lora", FINETUNE_RUN), ("full", "full-run")):
        result = run_trainpod(*finetune_args(*steps, "--run", run, method=method), volume=volume)
        assert result.returncode == 0, f"the tiny {method} finetune failed:\n{result.stdout}\n{result.stderr}"
    return volume


def chatml_text(tokenizer) -> tuple[str, str]:
    """The whole conversation and the prompt up to its answer, as training rendered them."""
    segments = build_template("chatml", tokenizer).segments(Sample(None, ((SYSTEMLESS, "5"),)))
    prompt, answer = segments.pairs[0]
    return prompt + answer, prompt


def assert_chats_as_trained(folder: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    whole, prompt = chatml_text(tokenizer)
    conversation = [{"role": "user", "content": SYSTEMLESS}, {"role": "assistant", "content": "5"}]
    assert tokenizer.apply_chat_template(conversation, tokenize=False) == whole
    ids = tokenizer.apply_chat_template(conversation[:1], add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]


def im_end(folder: Path) -> int:
    return AutoTokenizer.from_pretrained(folder).convert_tokens_to_ids("<|im_end|>")


def stop_ids(folder: Path) -> list[int]:
    eos = GenerationConfig.from_pretrained(folder).eos_token_id
    return eos if isinstance(eos, list) else [eos]


def test_the_base_tokenizer_has_no_chat_template(exported):
    from finetune_support import BASE

    assert not AutoTokenizer.from_pretrained(exported / BASE).chat_template


def test_a_full_finetunes_export_chats_and_stops_as_trained(exported):
    folder = exported / "runs" / "full-run" / "export" / "hf"
    assert im_end(folder) in stop_ids(folder), "generate() must stop at the <|im_end|> the answers end with"
    assert_chats_as_trained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.eos_token_id in stop_ids(folder)


def test_an_adapters_tokenizer_chats_as_trained(exported):
    assert_chats_as_trained(exported / "runs" / FINETUNE_RUN / "export" / "adapter")


def test_an_adapters_generation_config_stops_at_its_end_of_turn(exported):
    """The full export's generation_config.json stops at <|im_end|>; the adapter folder had none, so
    GenerationConfig.from_pretrained(adapter) (what generate() and vLLM's --generation-config take, since peft and
    transformers load an adapter's base with the base's own, eos alone) failed, and generate() ran past the end
    of turn the answers were trained with."""
    adapter = exported / "runs" / FINETUNE_RUN / "export" / "adapter"
    assert im_end(adapter) in stop_ids(adapter), "generate() must stop at the <|im_end|> the answers end with"
    assert AutoTokenizer.from_pretrained(adapter).eos_token_id in stop_ids(adapter)


def test_a_merged_adapter_chats_and_stops_as_trained_though_its_folder_had_no_template(exported, tmp_path):
    """An adapter exported before its tokenizer carried the template: the merge gives it one from
    training_summary.json, and the end of turn as eos."""
    volume = tmp_path / "volume"
    shutil.copytree(exported, volume, ignore=shutil.ignore_patterns("full-run"))
    adapter = volume / "runs" / FINETUNE_RUN / "export" / "adapter"
    (adapter / "chat_template.jinja").unlink(missing_ok=True)
    config = json.loads((adapter / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (adapter / "tokenizer_config.json").write_text(json.dumps(config))
    assert not AutoTokenizer.from_pretrained(adapter).chat_template
    [merged] = run_convert(
        convert_config({"kind": "merge"}, name=FINETUNE_RUN),
        Volume(volume),
        PreemptionWatch(),
    )
    assert_chats_as_trained(merged)
    assert im_end(merged) in stop_ids(merged)


# A base Qwen2.5's: the tokenizer's own chatml template, eos <|endoftext|>, and generation_config.json's
# eos_token_id that alone; answers trained with the template end with <|im_end|>.
CHATML_JINJA = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_full_finetune_on_the_tokenizers_own_template_stops_at_its_end_of_turn(
    finetune_base_volume, tmp_path
):
    from finetune_support import BASE

    volume = tmp_path / "volume"
    shutil.copytree(finetune_base_volume, volume)
    tokenizer = AutoTokenizer.from_pretrained(volume / BASE)
    tokenizer.chat_template = CHATML_JINJA
    tokenizer.save_pretrained(volume / BASE)
    assert im_end(volume / BASE) not in stop_ids(volume / BASE)
    steps = ("--set", "train.max_steps=2", "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=2")
    args = finetune_args(*steps, "--set", "data.sft.template=auto", method="full")
    result = run_trainpod(*args, volume=volume)
    assert result.returncode == 0, result.stdout + result.stderr
    folder = volume / "runs" / FINETUNE_RUN / "export" / "hf"
    assert im_end(folder) in stop_ids(folder), "generate() must stop at the <|im_end|> the answers end with"
    assert AutoTokenizer.from_pretrained(folder).chat_template == CHATML_JINJA
