"""`trainpod chat RUN` and `trainpod generate RUN --prompt ...`: talk to what a run trained.

    trainpod generate tiny-finetune --prompt "Add the two numbers. 12 + 30" --volume demo-volume --max-new-tokens 16
    trainpod chat tiny-finetune --volume demo-volume --max-new-tokens 16  # on stdin; empty line or EOF ends

The run's export is loaded with transformers (and peft for an adapter): export/merged, export/hf,
or the base model + export/adapter, in that order unless --export says which. A finetuned run's
prompts are built with the chat template it trained with (sft/templates.py; recorded in the
adapter's training_summary.json, else in the run's config.yaml), every turn of the conversation
tokenized as training tokenized a sample (sft/encode.py's segment_ids), and generation stops at the
template's end-of-turn token. A pretrained model gets the prompt as plain text to continue. Tokens
are printed as they come (transformers' TextStreamer). The oldest whole turns are dropped where the
conversation and the answer's max_new_tokens would outgrow the model's positions.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from trainpod.errors import InputError
from trainpod.volume import Volume

log = logging.getLogger(__name__)

EXPORT_ORDER = ("merged", "hf", "adapter")
SUMMARY = "training_summary.json"


@dataclass(frozen=True)
class Export:
    """One loadable export of a run: a model folder, with an adapter on top for `adapter`."""

    kind: str  # merged, hf or adapter
    model_dir: Path | str  # a folder, or a hub id for an adapter's base
    adapter_dir: Path | None
    template: str | None  # the SFT template (alpaca, chatml, qwen, llama3, tokenizer); None: plain text
    quantization: dict | None = None  # QLoRA's 4-bit settings, from training_summary.json
    revision: str | None = None  # the hub commit of a hub-id model_dir the finetune trained on


def find_export(volume: Volume, run: str, which: str = "auto") -> Export:
    """The run's export to load: `which` (merged, hf, adapter, or any folder under export/: a convert task's
    hf-step-<N>), or the first of merged, hf and adapter that exists."""
    run_dir = volume.run(run).root
    export = run_dir / "export"
    kinds = EXPORT_ORDER if which == "auto" else (which,)
    for kind in kinds:
        folder = export / kind
        if "/" in kind or kind in ("", ".", ".."):  # a folder of export/ by its name, nothing outside it
            break
        if (folder / "adapter_config.json").is_file() and (kind == "adapter" or kind not in EXPORT_ORDER):
            summary = _summary(folder)
            base = _adapter_base(folder, summary, volume)
            # A hub id at the commit the finetune pinned (as convert's merge fetches it): the hub's main may
            # have moved on since, and the adapter belongs to the weights it trained on.
            revision = summary.get("base_model_revision") if isinstance(base, str) else None
            template = training_template(run_dir)
            return Export(kind, base, folder, template, summary.get("quantization"), revision)
        if kind != "adapter" and (folder / "config.json").is_file():
            return Export(kind, folder, None, training_template(run_dir))
    found = ", ".join(sorted(p.name for p in export.iterdir() if p.is_dir())) if export.is_dir() else ""
    raise InputError(
        f"run {run}: no {' or '.join(f'export/{k}' for k in kinds)} with a model under {run_dir} "
        f"(found: {found or 'nothing'}); pass --export with one of those, finish the run (trainpod run ...) or "
        "convert it (trainpod run convert: a checkpoint's hf-step-<N>), or pass --volume where it lives"
    )


def training_template(run_dir: Path) -> str | None:
    """The SFT template the run trained with: training_summary.json, else the run's config.yaml. None for
    a run trained on plain text alone (format text: no template wrapped it), like a pretrained model."""
    for folder in ("adapter", "hf", "merged"):
        data = _summary(run_dir / "export" / folder).get("data") or {}
        if "template" in data:  # a finetune's: None when it trained on plain text alone
            return data["template"]
    try:
        config = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return None
    sft = (config.get("data") or {}).get("sft") or {}
    datasets = sft.get("datasets") or []
    if datasets and all(isinstance(d, dict) and d.get("format") == "text" for d in datasets):
        return None
    return sft.get("template")


def _summary(folder: Path) -> dict:
    try:
        return json.loads((folder / SUMMARY).read_text())
    except (OSError, ValueError):
        return {}


def _adapter_base(adapter: Path, summary: dict, volume: Volume) -> Path | str:
    """The adapter's base model: the folder it trained on, the same path on this volume, or a hub id."""
    recorded = summary.get("base_model_folder")
    if recorded and (Path(recorded) / "config.json").is_file():
        return Path(recorded)
    named = summary.get("base_model")
    if not named:
        named = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not named:
        raise InputError(f"{adapter}: neither {SUMMARY} nor adapter_config.json names the base model")
    on_volume = volume.root / named
    return on_volume if (on_volume / "config.json").is_file() else named


# ------------------------------------------------------------------------------ loading
def load(export: Export) -> tuple[Any, Any]:
    """(model, tokenizer) on the GPU when there is one (bf16), else on the CPU (fp32), in eval mode."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()
    cuda = torch.cuda.is_available()
    kwargs = load_kwargs(export, cuda)
    tokenizer = AutoTokenizer.from_pretrained(str(export.adapter_dir or export.model_dir))
    try:
        model = _model_class(export.model_dir, export.revision).from_pretrained(
            str(export.model_dir), revision=export.revision, **kwargs
        )
    except OSError as exc:  # no folder here, and the hub did not give it (offline, gated, a volume path)
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(".")
        raise InputError(
            f"model {export.model_dir} cannot be loaded: {first_line}. It is no folder here and the hub did not "
            "give it: pass --volume where the run's base model lives (an adapter needs its base), or set HF_TOKEN "
            "for a gated model"
        ) from None
    if export.adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(export.adapter_dir))
    if cuda and not export.quantization:
        model = model.to("cuda")
    return model.eval(), tokenizer


def load_kwargs(export: Export, cuda: bool) -> dict[str, Any]:
    """from_pretrained's dtype (and 4-bit settings): bf16 on a GPU, fp32 on the CPU; a QLoRA adapter's base on
    a GPU in 4 bits as it trained, computing in the dtype its run recorded (fp16 where the GPU had no bf16)."""
    import torch

    if not (export.quantization and cuda):  # on CPU 4-bit matmuls are slow, the 16/32-bit base is used
        return {"dtype": torch.bfloat16 if cuda else torch.float32}
    from transformers import BitsAndBytesConfig

    from trainpod.train.export import DTYPES  # the names the finetune records, as the merge reads them

    q = export.quantization
    name = q.get("compute_dtype") or "bfloat16"  # summaries from before it was recorded trained in bf16
    if name not in DTYPES:
        raise InputError(
            f"{SUMMARY}: quantization compute_dtype {name!r} is not one of {', '.join(sorted(DTYPES))}; "
            "fix the summary to the dtype the run trained in"
        )
    compute_dtype = DTYPES[name]
    quantization_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=q.get("quant_type", "nf4"),
        bnb_4bit_use_double_quant=q.get("double_quant", True),
        bnb_4bit_compute_dtype=compute_dtype,
    )
    return {"dtype": compute_dtype, "quantization_config": quantization_config}


def _model_class(model_dir: Path | str, revision: str | None = None) -> Any:
    """AutoModelForCausalLM, or AutoModelForImageTextToText for a vision-language model (a finetune-vlm
    run's), which AutoModelForCausalLM refuses; it answers a text-only conversation too."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(str(model_dir), revision=revision)
    vision = getattr(config, "vision_config", None) is not None
    return AutoModelForImageTextToText if vision else AutoModelForCausalLM


# ----------------------------------------------------------------------------- prompting
class MessageTooLong(InputError):
    """A message that leaves no room for the answer in the model's positions, with no earlier turn to drop."""


@dataclass
class Conversation:
    """Turns so far and the template that renders them exactly as training did."""

    tokenizer: Any
    template_name: str | None
    system: str | None = None
    history: list[tuple[str, str]] = field(default_factory=list)
    dropped_turns: int = 0  # the oldest turns left out to fit the model's positions (said once)

    def fitting_prompt_ids(self, user: str, positions: int | None, new_tokens: int) -> list[int]:
        """`prompt_ids(user)` leaving `new_tokens` of the model's `positions` (None: no limit known) to the
        answer: the oldest whole turns of the history are dropped for good, the system prompt kept, and the user
        told the first time. A message too long on its own is an InputError naming the lengths."""
        ids = self.prompt_ids(user)
        room = None if positions is None else positions - new_tokens
        while room is not None and len(ids) > room and self.history:
            self.history.pop(0)
            self.dropped_turns += 1
            if self.dropped_turns == 1:
                log.warning(
                    "the conversation with the answer's %d tokens no longer fits the model's %d positions: its "
                    "oldest turns are dropped from now on (the system prompt is kept)",
                    new_tokens,
                    positions,
                )
            ids = self.prompt_ids(user)
        if room is not None and len(ids) > room:
            raise MessageTooLong(
                f"the message is {len(ids)} tokens with the template and system prompt, and the model reads "
                f"{positions} positions, {new_tokens} of them kept for the answer (--max-new-tokens); shorten "
                "the message or lower --max-new-tokens"
            )
        return ids

    def prompt_ids(self, user: str) -> list[int]:
        """Token ids of the conversation so far plus `user`, ending where the answer begins."""
        if self.template_name is None:  # a pretrained model continues text
            return self.tokenizer("".join(u + a for u, a in self.history) + user)["input_ids"]
        from trainpod.sft.encode import segment_ids
        from trainpod.sft.formats import Sample
        from trainpod.sft.templates import TokenizerChatTemplate, build_template

        sample = Sample(self.system, (*self.history, (user, "")))
        # `tokenizer` is what `auto` became when the tokenizer has its own chat_template.
        template = build_template(
            "auto" if self.template_name == "tokenizer" else self.template_name, self.tokenizer
        )
        try:
            segments = template.segments(sample)
        except InputError:
            if not isinstance(template, TokenizerChatTemplate):
                raise
            # A tokenizer's own template that renders earlier answers otherwise once later turns follow (Qwen3
            # drops their reasoning): rendered whole, as transformers renders a conversation to answer, and
            # tokenized without adding tokens, as training did: the template has its own.
            messages = sample.messages()[:-1]
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        # Every turn up to where the answer begins (its last segment, the empty answer's turn end, left out),
        # tokenized as training tokenized a sample (sft/encode.py): the whole text, but apart where a token
        # would span an earlier answer's start (Qwen2's "\n\n" of a prompt's "\n" and an answer's).
        *before_answer, _ = segment_ids(self.tokenizer, [segments])[0]
        return [i for ids in before_answer for i in ids]

    def stop_ids(self) -> list[int]:
        """eos and the template's end-of-turn token (<|im_end|>, <|eot_id|>, <end_of_turn>), where the answer ends."""
        ids = {self.tokenizer.eos_token_id} - {None}
        if self.template_name in ("tokenizer", "auto"):
            ids |= self._own_template_turn_end()
        elif self.template_name is not None:
            from trainpod.sft.templates import build_template

            template = build_template(self.template_name, self.tokenizer)
            end = template.turn_end
            if end:
                ids |= set(self.tokenizer.convert_tokens_to_ids([end])) - {self.tokenizer.unk_token_id}
        vocab = self.tokenizer.get_vocab()
        ids |= {vocab[t] for t in ("<|im_end|>", "<|eot_id|>") if t in vocab and self.template_name}
        return sorted(ids)

    def _own_template_turn_end(self) -> set[int]:
        from trainpod.sft.templates import own_template_turn_end

        return {own_template_turn_end(self.tokenizer)} - {None}


def model_positions(model: Any, tokenizer: Any) -> int | None:
    """Tokens the model reads at most: its config's max_position_embeddings or the length its RoPE scaling
    stretches to (n_positions for GPT-2's learned ones; a vision-language model's text model's), else the
    tokenizer's model_max_length; None where neither says (transformers' "no limit" is 1e30)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return max(value, _rope_scaled_positions(config, value))
    limit = getattr(tokenizer, "model_max_length", None)
    return limit if isinstance(limit, int) and 0 < limit < 10**9 else None


def _rope_scaled_positions(config: Any, max_positions: int) -> int:
    """The context a RoPE scaling stretches to, 0 where none does. Transformers scales YaRN and dynamic NTK
    from original_max_position_embeddings (max_position_embeddings where it is absent) by the factor; a
    config whose max_position_embeddings is already the stretched length (Llama 3.1's llama3, Phi-3's
    longrope) keeps it, as the caller takes the larger. Linear scaling without an original length leaves
    max_position_embeddings as it is: such configs write either length there."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return 0
    per_layer_type = [r for r in rope.values() if isinstance(r, dict)]  # Gemma 3: full and sliding attention
    longest = 0
    for params in per_layer_type or [rope]:
        factor = params.get("factor")
        kind = params.get("rope_type") or params.get("type")
        original = params.get("original_max_position_embeddings")
        if not isinstance(factor, (int, float)) or factor <= 1:
            continue
        if not isinstance(original, int) or original <= 0:
            if kind not in ("yarn", "dynamic"):
                continue
            original = max_positions
        longest = max(longest, int(original * factor))
    return longest


def stream_reply(
    model: Any,
    tokenizer: Any,
    conversation: Conversation,
    user: str,
    write: Callable[[str], None],
    max_new_tokens: int = 200,
    temperature: float = 0.7,
    seed: int = 0,
) -> str:
    """Generate the answer to `user`, writing text as it comes; returns it (also kept in the history)."""
    import torch
    from transformers import TextStreamer

    class Streamer(TextStreamer):
        def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
            parts.append(text)
            write(text)

    parts: list[str] = []
    prompt = conversation.fitting_prompt_ids(user, model_positions(model, tokenizer), max_new_tokens)
    ids = torch.tensor([prompt], device=model.device)
    sampling = (
        {"do_sample": True, "temperature": temperature, "top_k": 50}
        if temperature > 0
        else {"do_sample": False}
    )
    torch.manual_seed(seed)
    with torch.no_grad():
        model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            eos_token_id=conversation.stop_ids(),
            pad_token_id=tokenizer.pad_token_id
            if tokenizer.pad_token_id is not None
            else tokenizer.eos_token_id,
            streamer=Streamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
            **sampling,
        )
    reply = "".join(parts)
    conversation.history.append((user, reply))
    return reply


def chat_loop(
    model: Any,
    tokenizer: Any,
    conversation: Conversation,
    lines: Iterable[str],
    write: Callable[[str], None],
    **generation: Any,
) -> int:
    """One reply per input line until an empty line or the end of input; returns the turns taken."""
    write("> ")
    for line in lines:
        user = line.rstrip("\n")
        if not user.strip():
            break
        try:
            stream_reply(model, tokenizer, conversation, user, write, **generation)
        except MessageTooLong as exc:  # the conversation goes on; a shorter message may follow
            log.warning("%s", exc)
        write("\n> ")
    write("\n")
    return len(conversation.history)


def describe(export: Export) -> str:
    what = (
        f"{export.model_dir} + adapter {export.adapter_dir}" if export.adapter_dir else str(export.model_dir)
    )
    template = f"template {export.template}" if export.template else "plain text (no chat template)"
    return f"{export.kind}: {what}; {template}"
