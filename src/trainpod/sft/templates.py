"""Chat templates: a sample -> text segments (prompt, answer) per turn -> token ids with a trained mask.

A sample's whole text is tokenized at once, as transformers' apply_chat_template and inference servers
tokenize a conversation, and each token goes to the segment its first character is in (sft/encode.py); it is
cut in two where a token would span an answer's start ("\n" + "\n" merged), as a prompt is tokenized alone.
The end-of-turn token (<|im_end|>, <|eot_id|>, eos) belongs to the answer and is trained, so the model
learns to stop. The separator after an answer ("\n" in chatml) belongs to the next prompt.

`auto` uses the tokenizer's own `chat_template`: the segments are the differences between renders
of growing prefixes of the conversation (with and without the generation prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol

from trainpod.errors import InputError
from trainpod.sft.formats import Sample

CONTENT = "{content}"
QWEN_DEFAULT_SYSTEM = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
ALPACA_DEFAULT_SYSTEM = "Below is an instruction that describes a task. Write a response that appropriately completes the request."


@dataclass(frozen=True)
class Segments:
    """A sample as text: a prefix (e.g. bos) and (prompt, answer) pairs; only answers are trained."""

    prefix: str
    pairs: tuple[tuple[str, str], ...]


class Template(Protocol):
    name: str

    def segments(self, sample: Sample) -> Segments: ...


@dataclass(frozen=True)
class StringTemplate:
    """A template written as format strings, like LLaMA-Factory's `register_template`."""

    name: str
    system: str
    user: str
    assistant: str
    separator: str  # between an answer and the next prompt; untrained
    prefix: str = ""
    default_system: str | None = None
    special_tokens: tuple[str, ...] = ()
    generation_prompt: str = ""  # the end of `user` that opens the answer (apply_chat_template's)

    def segments(self, sample: Sample) -> Segments:
        system = sample.system or self.default_system
        pairs = []
        for number, (user, answer) in enumerate(sample.pairs):
            prompt = self.separator if number else ""
            if number == 0 and system:
                prompt += self.system.replace(CONTENT, system)
            pairs.append((prompt + self.user.replace(CONTENT, user), self.assistant.replace(CONTENT, answer)))
        return Segments(self.prefix, tuple(pairs))

    @property
    def turn_end(self) -> str:
        """The token an answer ends with (<|im_end|>, <|eot_id|>, eos): where generation must stop."""
        return self.assistant.replace(CONTENT, "").strip()

    def jinja(self) -> str:
        """This template as a tokenizer's chat_template: apply_chat_template (and vLLM, mlx-lm) render a
        conversation to the text `segments` joins, and with add_generation_prompt its prompt up to the answer."""
        user_turn = self.user.removesuffix(self.generation_prompt)

        def text(value: str) -> str:  # a Jinja string literal (JSON's escapes are Jinja's)
            return "{{ " + json.dumps(value) + " }}"

        def around(fmt: str, content: str) -> str:
            before, after = fmt.split(CONTENT)
            return text(before) + "{{ " + content + " }}" + text(after)

        default_system = json.dumps(self.default_system or "")
        answer_opens = "{% if not loop.last or add_generation_prompt %}" + text(self.generation_prompt)
        return "".join(
            [
                text(self.prefix),
                "{% set ns = namespace(system=" + default_system + ") %}{% set turns = messages %}",
                "{% if messages and messages[0]['role'] == 'system' %}",
                "{% set ns.system = messages[0]['content'] or ns.system %}{% set turns = messages[1:] %}",
                "{% endif %}",
                "{% for message in turns %}{% if message['role'] == 'user' %}",
                "{% if not loop.first %}" + text(self.separator) + "{% endif %}",
                "{% if loop.first and ns.system %}" + around(self.system, "ns.system") + "{% endif %}",
                around(user_turn, "message['content']"),
                answer_opens + "{% endif %}",
                "{% else %}" + around(self.assistant, "message['content']") + "{% endif %}",
                "{% endfor %}",
            ]
        )


def _chatml(name: str, default_system: str | None) -> StringTemplate:
    return StringTemplate(
        name=name,
        system="<|im_start|>system\n{content}<|im_end|>\n",
        user="<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n",
        assistant="{content}<|im_end|>",
        separator="\n",
        default_system=default_system,
        special_tokens=("<|im_start|>", "<|im_end|>"),
        generation_prompt="<|im_start|>assistant\n",
    )


def _llama3() -> StringTemplate:
    return StringTemplate(
        name="llama3",
        prefix="<|begin_of_text|>",
        system="<|start_header_id|>system<|end_header_id|>\n\n{content}<|eot_id|>",
        user="<|start_header_id|>user<|end_header_id|>\n\n{content}<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
        assistant="{content}<|eot_id|>",
        separator="",
        special_tokens=("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
        generation_prompt="<|start_header_id|>assistant<|end_header_id|>\n\n",
    )


def _alpaca(tokenizer) -> StringTemplate:
    eos = tokenizer.eos_token
    if not eos:
        raise InputError(
            "template 'alpaca' ends every answer with the tokenizer's eos_token, but the tokenizer has none; "
            "set eos_token in its tokenizer_config.json or pick another sft.template"
        )
    bos = tokenizer.bos_token if tokenizer.bos_token and tokenizer.bos_token != eos else ""
    return StringTemplate(
        name="alpaca",
        prefix=bos,
        system="{content}\n\n",
        user="### Instruction:\n{content}\n\n### Response:\n",
        assistant="{content}" + eos,
        separator="\n\n",
        default_system=ALPACA_DEFAULT_SYSTEM,
        special_tokens=(eos,),
        generation_prompt="### Response:\n",
    )


class TokenizerChatTemplate:
    """The tokenizer's own Jinja chat_template, split into turns by rendering growing prefixes."""

    name = "tokenizer"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _render(self, messages: list[dict[str, str]], generation_prompt: bool) -> str:
        try:
            return self.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=generation_prompt
            )
        except Exception as exc:  # Jinja raises its own errors (e.g. raise_exception in the template)
            raise InputError(
                f"the tokenizer's chat_template failed to render a conversation ({type(exc).__name__}: {exc}); "
                "set sft.template to chatml, qwen, llama3 or alpaca"
            ) from None

    def segments(self, sample: Sample) -> Segments:
        messages = sample.messages()
        first_user = 1 if sample.system else 0
        done, pairs = "", []
        for number in range(len(sample.pairs)):
            end = first_user + 2 * number
            prompt = self._render(messages[: end + 1], generation_prompt=True)
            full = self._render(messages[: end + 2], generation_prompt=False)
            if not prompt.startswith(done) or not full.startswith(prompt):
                raise InputError(
                    "the tokenizer's chat_template renders earlier turns differently once later turns follow "
                    "(e.g. it drops reasoning from old answers), so answers cannot be located; set sft.template "
                    "to chatml, qwen, llama3 or alpaca"
                )
            pairs.append((prompt[len(done) :], full[len(prompt) :]))
            done = full
        return Segments("", tuple(pairs))


def own_template_turn_end(tokenizer) -> int | None:
    """The last special token of an answer as the tokenizer's own template renders it (<|im_end|>, Gemma's
    <end_of_turn>, Phi-3's <|end|>; `auto`'s chatml where it has none): training on that template taught
    the model to end its turns with it."""
    answer = build_template("auto", tokenizer).segments(Sample(None, (("?", "ok"),))).pairs[0][1]
    special = {i for i, token in tokenizer.added_tokens_decoder.items() if token.special}
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"]
    return next((i for i in reversed(answer_ids) if i in special), None)


def build_template(name: str, tokenizer) -> Template:
    """The template `name` (sft.template) checked against the tokenizer's special tokens."""
    if name == "auto":
        if getattr(tokenizer, "chat_template", None):
            return TokenizerChatTemplate(tokenizer)
        name = "chatml"
    template = {
        "chatml": lambda: _chatml("chatml", None),
        "qwen": lambda: _chatml("qwen", QWEN_DEFAULT_SYSTEM),
        "llama3": _llama3,
        "alpaca": lambda: _alpaca(tokenizer),
    }[name]()
    vocab = tokenizer.get_vocab()
    missing = [token for token in template.special_tokens if token not in vocab]
    if missing:
        raise InputError(
            f"template {template.name!r} needs the special tokens {', '.join(missing)}, which tokenizer "
            f"{getattr(tokenizer, 'name_or_path', '')} lacks; pick the template the model was trained with "
            "(sft.template; 'alpaca' needs only an eos_token), or add the tokens to the tokenizer and resize "
            "the model's embeddings"
        )
    return template


@dataclass(frozen=True)
class TextFormat:
    """The text format: the document and eos, all of it 'answer' (trained), after the bos the tokenizer
    puts before every text (Llama, Mistral, Gemma): they were pretrained on documents starting with it,
    and trainpod chat prompts a model trained on text with it."""

    bos: str
    eos: str

    def segments(self, text: str) -> Segments:
        return Segments(self.bos, (("", text + self.eos),))


def text_format(tokenizer) -> TextFormat:
    return TextFormat(_bos_the_tokenizer_adds(tokenizer), tokenizer.eos_token or "")


def _bos_the_tokenizer_adds(tokenizer) -> str:
    """The bos token where encoding with special tokens puts it first (segments are encoded without)."""
    bos_id = tokenizer.bos_token_id
    if bos_id is None:
        return ""
    with_special = tokenizer("a")["input_ids"]
    without = tokenizer("a", add_special_tokens=False)["input_ids"]
    return tokenizer.bos_token if with_special[:1] == [bos_id] and without[:1] != [bos_id] else ""
