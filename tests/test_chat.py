"""`trainpod generate` and `trainpod chat` on outputs made like the demo's: an adapter from a real
(tiny) finetune run, a plain HF export; the prompt is the chat template the run trained with."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from trainpod.chat import Conversation, find_export, training_template
from trainpod.volume import Volume

from finetune_support import BASE, FINETUNE_RUN, finetune_args
from support import child_env, run_trainpod, trainpod_cmd

PROMPT = "Add the two numbers."


@pytest.fixture(scope="module")
def finetuned(tmp_path_factory, finetune_base_volume) -> Path:
    """A volume with the tiny base model and the adapter of a 4-step chatml QLoRA run."""
    volume = tmp_path_factory.mktemp("chat") / "volume"
    shutil.copytree(finetune_base_volume, volume)
    args = finetune_args(
        "--set", "train.max_steps=4", "--set", "train.eval_every=0", "--set", "checkpoint.every_steps=4"
    )
    result = run_trainpod(*args, volume=volume)
    assert result.returncode == 0, f"the tiny finetune failed:\n{result.stdout}\n{result.stderr}"
    return volume


def greedy(model, tokenizer, text: str, stop: list[int], new_tokens: int = 8) -> str:
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=stop,
            pad_token_id=tokenizer.pad_token_id,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_the_template_a_finetune_trained_with_is_read_from_its_adapter(finetuned):
    found = find_export(Volume(finetuned), FINETUNE_RUN)
    assert found.kind == "adapter" and found.template == "chatml"
    assert training_template(finetuned / "runs" / FINETUNE_RUN) == "chatml"
    assert Path(found.model_dir) == finetuned / BASE


def test_a_converted_checkpoint_is_chatted_with_by_its_folder_name_and_a_missing_one_lists_those_there(
    tmp_path, capsys
):
    """A convert task's export of a checkpoint lands in export/hf-step-<N>: chat offered merged, hf and adapter
    alone, so trying the model at an earlier step meant moving folders by hand."""
    from trainpod.errors import InputError

    export = tmp_path / "runs/pt/export"
    (export / "hf-step-400").mkdir(parents=True)
    (export / "hf-step-400/config.json").write_text("{}")
    found = find_export(Volume(tmp_path), "pt", "hf-step-400")
    assert found.model_dir == export / "hf-step-400" and found.adapter_dir is None
    for missing in ("hf-step-500", "../pt/export/hf-step-400"):
        with pytest.raises(InputError) as caught:
            find_export(Volume(tmp_path), "pt", missing)
        assert "(found: hf-step-400); pass --export with one of those" in str(caught.value)
    with pytest.raises(InputError, match="found: hf-step-400"):
        find_export(Volume(tmp_path), "pt")  # auto: no merged, hf or adapter
    from trainpod import cli

    # Through the command line (argparse offered merged, hf and adapter alone): the folder is looked for.
    assert (
        cli.main(["generate", "pt", "--prompt", "x", "--export", "hf-step-5", "--volume", str(tmp_path)]) == 2
    )
    said = capsys.readouterr()
    assert "no export/hf-step-5 with a model" in said.out + said.err


def test_a_finetune_on_plain_text_alone_is_prompted_with_plain_text(tmp_path):
    """Continued pretraining (format text) wraps no sample in a template: its prompts must not be either."""
    run = tmp_path / "runs/docs"
    (run / "export/adapter").mkdir(parents=True)
    (run / "config.yaml").write_text(
        "data:\n  sft:\n    template: auto\n    datasets:\n      - path: docs.jsonl\n        format: text\n"
    )
    assert training_template(run) is None, "a run's config of text datasets alone has no template"
    (run / "export/adapter/training_summary.json").write_text('{"data": {"template": null}}')
    assert training_template(run) is None, "nor has its summary"


def test_generate_streams_what_peft_generates_from_the_chatml_prompt_it_trained_on(finetuned):
    from peft import PeftModel

    result = run_trainpod(
        "generate",
        FINETUNE_RUN,
        "--prompt",
        PROMPT,
        "--temperature",
        "0",
        "--max-new-tokens",
        "8",
        volume=finetuned,
    )
    assert result.returncode == 0, result.stderr
    adapter = finetuned / "runs" / FINETUNE_RUN / "export/adapter"
    tokenizer = AutoTokenizer.from_pretrained(adapter)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(finetuned / BASE), adapter).eval()
    chatml = f"<|im_start|>user\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"
    stop = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    expected = greedy(model, tokenizer, chatml, stop)
    assert expected.strip() and result.stdout.rstrip("\n") == expected
    assert "adapter" in result.stderr and "template chatml" in result.stderr


def test_a_conversation_sends_every_earlier_turn_in_the_trained_template(finetuned):
    tokenizer = AutoTokenizer.from_pretrained(finetuned / BASE)
    conversation = Conversation(tokenizer, "chatml", history=[("hello", "hi there")])
    assert tokenizer.decode(conversation.prompt_ids("second")) == (
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi there<|im_end|>\n"
        "<|im_start|>user\nsecond<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") in conversation.stop_ids()


def test_a_template_that_renders_earlier_answers_otherwise_still_chats_a_second_turn(tmp_path):
    """Like Qwen3's: only the latest answer carries an (empty) think block. The conversation is rendered
    whole, as transformers does for inference; turn-by-turn segments would refuse it."""
    from sft_support import make_tiny_tokenizer

    template = (
        "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
        "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
        "{% if m['role'] == 'assistant' and loop.index0 > ns.last %}"
        "{{ '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m['content'] + '<|im_end|>\\n' }}"
        "{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path / "tok", template))
    conversation = Conversation(tokenizer, "tokenizer", history=[("hello", "hi there")])
    assert tokenizer.decode(conversation.prompt_ids("again")) == (
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi there<|im_end|>\n"
        "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"
    )


def test_chat_answers_each_line_on_stdin_until_an_empty_line(finetuned):
    import subprocess

    result = subprocess.run(
        trainpod_cmd("chat", FINETUNE_RUN, "--max-new-tokens", "4", volume=finetuned),
        input="hello\nhow are you\n\nnever read\n",
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("> ") == 3, (
        f"two answers, then the prompt that got the empty line:\n{result.stdout}"
    )


def test_generate_continues_plain_text_with_a_pretrained_hf_export(finetune_base_volume, tmp_path):
    volume = tmp_path / "volume"
    shutil.copytree(finetune_base_volume / BASE, volume / "runs/pre/export/hf")
    result = run_trainpod(
        "generate",
        "pre",
        "--prompt",
        "Once upon",
        "--temperature",
        "0",
        "--max-new-tokens",
        "6",
        volume=volume,
    )
    assert result.returncode == 0, result.stderr
    tokenizer = AutoTokenizer.from_pretrained(volume / "runs/pre/export/hf")
    model = AutoModelForCausalLM.from_pretrained(volume / "runs/pre/export/hf").eval()
    ids = tokenizer("Once upon", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
            eos_token_id=[tokenizer.eos_token_id], pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
    assert result.stdout.rstrip("\n") == tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert "plain text" in result.stderr


def test_generate_for_a_run_without_an_export_says_what_to_do(tmp_path):
    (tmp_path / "runs/unfinished/checkpoints").mkdir(parents=True)
    result = run_trainpod("generate", "unfinished", "--prompt", "x", volume=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr + result.stdout
    assert "no export/merged or export/hf or export/adapter" in result.stdout + result.stderr


def test_a_run_trained_with_the_tokenizers_own_template_is_prompted_with_the_ids_training_made(tmp_path):
    """`auto` with a chat_template trains as template `tokenizer`: generate must prompt with those segments
    (apply_chat_template returns a BatchEncoding in transformers 5, which generation cannot take)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from trainpod.chat import stream_reply
    from trainpod.sft.formats import Sample
    from trainpod.sft.templates import TokenizerChatTemplate

    from sft_support import CUSTOM_CHAT_TEMPLATE, make_tiny_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path / "tok", CUSTOM_CHAT_TEMPLATE))
    conversation = Conversation(tokenizer, "tokenizer", system="be brief", history=[("hello", "hi there")])
    trained = TokenizerChatTemplate(tokenizer).segments(
        Sample("be brief", (("hello", "hi there"), ("again", "x")))
    )
    texts = [trained.pairs[0][0], trained.pairs[0][1], trained.pairs[1][0]]
    expected = [i for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for i in ids]
    assert conversation.prompt_ids("again") == expected

    torch.manual_seed(0)
    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **shape)).eval()
    written: list[str] = []
    reply = stream_reply(
        model, tokenizer, conversation, "again", written.append, max_new_tokens=3, temperature=0
    )
    assert reply == "".join(written) and conversation.history[-1] == ("again", reply)


def test_a_builtin_template_prompts_with_the_ids_training_made_under_a_sentencepiece_style_tokenizer(
    tmp_path,
):
    """Training takes a sample's ids from its whole text (sft/encode.py); a prompt made of its segments
    encoded alone began each with the ▁ (a space) a Llama 2 or Mistral tokenizer puts before a text."""
    from trainpod.sft.encode import SegmentEncoder
    from trainpod.sft.formats import Sample
    from trainpod.sft.templates import build_template

    from sft_support import make_metaspace_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_metaspace_tokenizer(tmp_path / "tok"))
    sample = Sample("Be brief.", (("Add 2 and 3.", "5"), ("Reverse cloud", "duolc")))
    stored = SegmentEncoder(tokenizer, 512, "truncate", False).encode(
        [build_template("alpaca", tokenizer).segments(sample)]
    )[0]
    trained = stored.trained
    last_answer = max(i for i in range(1, len(trained)) if trained[i] and not trained[i - 1])
    conversation = Conversation(tokenizer, "alpaca", system="Be brief.", history=[("Add 2 and 3.", "5")])
    assert conversation.prompt_ids("Reverse cloud") == stored.input_ids[:last_answer].tolist()


# Qwen2.5's chat_template without its tools and default system: "\n" ends the prompt before an answer.
QWEN_LIKE_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize("template", ["chatml", "llama3", "tokenizer"])
def test_a_second_turn_after_an_answer_starting_with_a_newline_prompts_with_the_ids_training_made(
    tmp_path, template
):
    """Under Qwen2's or Llama 3's tokenizer an earlier answer starting with "\n" (code, a list) merged with
    the "\n" its prompt ends with into one "\n\n" when the conversation was tokenized as one text; training
    tokenized the two apart (sft/encode.py), so the model saw every later turn after ids it never trained on."""
    from trainpod.sft.encode import SegmentEncoder
    from trainpod.sft.formats import Sample
    from trainpod.sft.templates import build_template

    from sft_support import make_newline_merging_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_newline_merging_tokenizer(tmp_path / "tok"))
    tokenizer.chat_template = QWEN_LIKE_CHAT_TEMPLATE if template == "tokenizer" else None
    first = ("Write a list of two colours.", "\n- red\n- blue")
    sample = Sample(None, (first, ("And a third?", "\n- green")))
    trained_template = build_template("auto" if template == "tokenizer" else template, tokenizer)
    stored = SegmentEncoder(tokenizer, 512, "truncate", False).encode([trained_template.segments(sample)])[0]
    trained = stored.trained
    last_answer = max(i for i in range(1, len(trained)) if trained[i] and not trained[i - 1])
    conversation = Conversation(tokenizer, template, history=[first])
    assert conversation.prompt_ids("And a third?") == stored.input_ids[:last_answer].tolist()


def test_an_adapter_whose_base_model_is_not_here_is_bad_input_naming_it(tmp_path):
    """An adapter pulled to a laptop: its base folder was on the pod's volume; one message, exit 2, no traceback."""
    from trainpod.chat import Export, load
    from trainpod.errors import InputError

    from sft_support import make_tiny_tokenizer

    adapter, base = make_tiny_tokenizer(tmp_path / "adapter"), tmp_path / "pod-volume/models/base"
    with pytest.raises(InputError, match=rf"model {base} cannot be loaded: .*pass --volume") as raised:
        load(Export("adapter", base, adapter, "chatml"))
    assert raised.value.exit_code == 2


def test_generation_stops_at_the_turn_end_of_the_tokenizers_own_template(tmp_path):
    """Gemma's template ends a turn with <end_of_turn>, not eos: the model learnt to stop there, and so
    must generation (before, it ran on to max_new_tokens, past the end of the answer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from sft_support import SENTENCES

    gemma = (
        "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' "
        "else m['role']) + '\\n' + m['content'] + '<end_of_turn>\\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}"
    )
    special = ["<bos>", "<eos>", "<pad>", "<start_of_turn>", "<end_of_turn>"]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer, bpe.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=special, initial_alphabet=alphabet, show_progress=False
    )
    bpe.train_from_iterator(SENTENCES, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        additional_special_tokens=special[3:], chat_template=gemma,
    )  # fmt: skip
    end_of_turn = tokenizer.convert_tokens_to_ids("<end_of_turn>")
    conversation = Conversation(tokenizer, "tokenizer")
    assert end_of_turn in conversation.stop_ids()

    # A model that answers <end_of_turn> whatever it reads: one token, then it has finished.
    shape = {"hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1, "num_attention_heads": 2}
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), **shape)).eval()
    model.lm_head = torch.nn.Linear(16, len(tokenizer), bias=True)
    with torch.no_grad():
        model.lm_head.weight.zero_()
        model.lm_head.bias.copy_(
            torch.nn.functional.one_hot(torch.tensor(end_of_turn), len(tokenizer)) * 10.0
        )
    ids = torch.tensor([conversation.prompt_ids("hi")])
    out = model.generate(
        input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=6, do_sample=False,
        eos_token_id=conversation.stop_ids(), pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    assert out[0, ids.shape[1] :].tolist() == [end_of_turn]


def test_generate_answers_with_a_vision_language_runs_export(vlm_base_volume, tmp_path, capsys):
    """A finetune-vlm run's model is no AutoModelForCausalLM: it loads as an image-text-to-text model and
    answers the text conversation in the template it trained with (before: a ValueError traceback)."""
    import json

    from trainpod import cli

    from vlm_support import VLM_BASE

    export = tmp_path / "volume/runs/ocr/export/hf"
    shutil.copytree(vlm_base_volume / VLM_BASE, export)
    (export / "training_summary.json").write_text(json.dumps({"data": {"template": "tokenizer"}}))
    args = ["generate", "ocr", "--prompt", "read it", "--temperature", "0", "--max-new-tokens", "3"]
    assert cli.main([*args, "--volume", str(tmp_path / "volume")]) == 0
    assert "Traceback" not in capsys.readouterr().out


@pytest.mark.parametrize("tokens", ["0", "-1", "many"])
def test_a_max_new_tokens_below_1_is_refused_before_the_model_loads(tokens, capsys):
    from trainpod import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "any-run", "--prompt", "x", "--max-new-tokens", tokens])
    assert exited.value.code == 2 and "argument --max-new-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("temperature", ["-0.5", "nan", "warm"])
def test_a_temperature_below_0_is_refused_not_taken_for_greedy(temperature, capsys):
    from trainpod import cli

    with pytest.raises(SystemExit) as exited:
        cli.main(["generate", "any-run", "--prompt", "x", "--temperature", temperature])
    assert exited.value.code == 2 and "argument --temperature" in capsys.readouterr().err


def test_a_long_chat_drops_its_oldest_turns_to_fit_the_models_positions_and_says_so_once(tmp_path, caplog):
    """The conversation so far is sent each turn: past the model's positions (a GPT-2's n_positions, learned
    position embeddings) generation failed with an IndexError, a RoPE model's went on beyond what it trained
    on. The oldest whole turns go, the system prompt stays, and the user is told once."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainpod.chat import chat_loop

    from sft_support import make_tiny_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(make_tiny_tokenizer(tmp_path / "tok"))
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(tokenizer), n_positions=64, n_embd=16, n_layer=1, n_head=2)
    model = GPT2LMHeadModel(config).eval()
    conversation = Conversation(tokenizer, "chatml", system="be brief")
    lines = [f"Add the two numbers {n} plus {n + 1}.\n" for n in range(6)]
    prompts: list[int] = []
    generate = model.generate

    def recorded_generate(*args, **kwargs):
        prompts.append(kwargs["input_ids"].shape[1])
        return generate(*args, **kwargs)

    model.generate = recorded_generate
    with caplog.at_level("WARNING", logger="trainpod.chat"):
        turns = chat_loop(
            model, tokenizer, conversation, lines, lambda text: None, max_new_tokens=8, temperature=0
        )
    assert len(prompts) == 6 and max(prompts) + 8 <= 64, f"prompt lengths {prompts} + 8 new tokens past 64"
    assert 0 < turns < 6 and conversation.history[-1][0] == lines[-1].strip()
    sent = tokenizer.decode(conversation.prompt_ids("next"))
    assert sent.startswith("<|im_start|>system\nbe brief<|im_end|>\n"), sent
    dropped = [r for r in caplog.records if "dropped" in r.getMessage()]
    assert len(dropped) == 1, [r.getMessage() for r in caplog.records]
    assert "64" in dropped[0].getMessage(), dropped[0].getMessage()

    # A message that does not fit even alone is said, and the chat goes on with the next.
    caplog.clear()
    long_then_short = ["plus " * 60 + "\n", "Add 2 and 3.\n"]
    chat_loop(
        model, tokenizer, conversation, long_then_short, lambda text: None, max_new_tokens=8, temperature=0
    )
    assert conversation.history[-1][0] == "Add 2 and 3.", conversation.history
    assert any("shorten the message" in r.getMessage() for r in caplog.records), caplog.text


def test_an_adapters_hub_base_is_loaded_at_the_commit_the_finetune_trained_on(tmp_path, monkeypatch):
    """The finetune pinned its hub base's commit (training_summary.json's base_model_revision), as convert's
    merge fetches it; chat loaded the hub's main, which may have moved on since: another model under the adapter."""
    import json

    import trainpod.chat as chat
    from trainpod.errors import InputError

    from sft_support import make_tiny_tokenizer

    adapter = make_tiny_tokenizer(tmp_path / "volume/runs/ft/export/adapter")
    (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": "org/base"}))
    summary = {"base_model": "org/base", "base_model_folder": "/workspace/cache/hf/org-base", "data": {}}
    summary |= {"base_model_revision": "0123abc"}
    (adapter / "training_summary.json").write_text(json.dumps(summary))
    export = find_export(Volume(tmp_path / "volume"), "ft")
    assert export.model_dir == "org/base"
    asked = {}

    class Hub:
        @staticmethod
        def from_pretrained(name, **kwargs):
            asked.update(kwargs, name=name)
            raise OSError("offline")

    monkeypatch.setattr(chat, "_model_class", lambda *args, **kwargs: Hub)
    with pytest.raises(InputError):
        chat.load(export)
    assert asked["name"] == "org/base" and asked.get("revision") == "0123abc"


def test_a_qlora_adapters_4bit_base_computes_in_the_dtype_its_run_trained_with():
    """A run on a GPU without bf16 trains with fp16 compute; chat's 4-bit base computes in that dtype too."""
    from trainpod.chat import Export, load_kwargs
    from trainpod.errors import InputError

    def export(quantization: dict) -> Export:
        return Export("adapter", "base", Path("adapter"), None, quantization)

    fp16 = load_kwargs(
        export({"quant_type": "nf4", "double_quant": True, "compute_dtype": "float16"}), cuda=True
    )
    assert fp16["dtype"] == torch.float16
    assert fp16["quantization_config"].bnb_4bit_compute_dtype == torch.float16
    # A summary from before the dtype was recorded trained in bf16.
    older = load_kwargs(export({"quant_type": "nf4", "double_quant": True}), cuda=True)
    assert older["quantization_config"].bnb_4bit_compute_dtype == torch.bfloat16
    assert load_kwargs(export({"compute_dtype": "float16"}), cuda=False) == {"dtype": torch.float32}
    with pytest.raises(InputError, match=r"compute_dtype 'int8'.*bfloat16, float16, float32"):
        load_kwargs(export({"compute_dtype": "int8"}), cuda=True)


def test_a_rope_scaled_models_chat_is_trimmed_to_the_context_its_scaling_stretches_to():
    """Under YaRN the usable context is original_max_position_embeddings times the factor; trimming the history
    at max_position_embeddings (the pretrained length) dropped turns the model reads fine."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from trainpod.chat import model_positions

    def positions(**config) -> int | None:
        return model_positions(SimpleNamespace(config=LlamaConfig(**config)), tokenizer=None)

    assert positions(max_position_embeddings=64) == 64
    assert positions(max_position_embeddings=64, rope_scaling={"rope_type": "yarn", "factor": 4.0}) == 256
    assert positions(max_position_embeddings=64, rope_scaling={"rope_type": "dynamic", "factor": 2.0}) == 128
    # Llama 3.1's config already names the stretched length.
    llama31 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16}
    llama31 |= {"low_freq_factor": 1.0, "high_freq_factor": 4.0}
    assert positions(max_position_embeddings=128, rope_scaling=llama31) == 128
    # Linear scaling's configs write either length as max_position_embeddings: it is kept.
    assert positions(max_position_embeddings=64, rope_scaling={"rope_type": "linear", "factor": 4.0}) == 64
