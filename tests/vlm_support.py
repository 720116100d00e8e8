"""A tiny Qwen2-VL and a synthetic OCR dataset on a temp volume, for the VLM tests (no hub: built here).

The model is Qwen2VLForConditionalGeneration with a 1-block vision tower and a 2-layer language
model (hidden 64); the processor is Qwen2VLProcessor with Qwen2-VL's own chat template and a
byte-level BPE tokenizer trained here with the model's special tokens. Images are 56x56 PNGs of a
short random string drawn with Pillow's default font: 4 image tokens each (a 4x4 patch grid, merged 2x2).
"""

from __future__ import annotations

import json
import random
import shutil
import string
from pathlib import Path

import torch
from PIL import Image, ImageDraw
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessorPil,
)

from support import CONFIGS

TINY_VLM_CONFIG = CONFIGS / "finetune/tiny-vlm.yaml"
VLM_RUN = "tiny-vlm"
VLM_BASE = "models/vlm"
OCR_FILE = "data/ocr/train.jsonl"
IMAGE_SIZE = 56  # 4x4 patches of 14 px, merged 2x2: 4 image tokens per image
SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
# Qwen2-VL's chat template as shipped with Qwen/Qwen2-VL-2B-Instruct (its chat_template.json).
QWEN2_VL_CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
STEPS = 8  # the tests' runs: an eval (loss and generation) at 4 and 8, a checkpoint every 2 steps
ALPHABET = string.ascii_uppercase + string.digits
PROMPT = "Read the text in the image."


def make_processor(folder: Path) -> tuple[PreTrainedTokenizerFast, Qwen2VLImageProcessorPil]:
    """The tokenizer (with Qwen2-VL's chat template) and the image processor, saved into `folder` as a
    hub model folder holds them (tokenizer files + preprocessor_config.json). Not a Qwen2VLProcessor:
    that needs torchvision (its video processor), which this environment does not install."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [PROMPT, "system user assistant You are a helpful assistant.", ALPHABET, " ".join(ALPHABET)]
    tokenizer.train_from_iterator(corpus * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>",
            "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>",
            "vision_end_token": "<|vision_end|>",
        },
    )
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=IMAGE_SIZE * IMAGE_SIZE, max_pixels=IMAGE_SIZE * IMAGE_SIZE * 4
    )
    fast.chat_template = QWEN2_VL_CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    image_processor.save_pretrained(str(folder))
    return fast, image_processor


def make_tiny_vlm(folder: Path, text: dict | None = None, vision: dict | None = None) -> Path:
    """A random tiny Qwen2-VL with its processor at `folder`; returns `folder`. `text` and `vision` override
    sizes of the language model and the vision tower (the benchmarks' bigger one); the merger's output
    (vision hidden_size) follows the language model's width."""
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer, _ = make_processor(folder)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL}
    text_sizes = {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **(text or {}),
    }
    head_dim = text_sizes["hidden_size"] // text_sizes["num_attention_heads"]
    config = Qwen2VLConfig(
        text_config={
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 512,
            **text_sizes,
            # M-RoPE's temporal, height and width sections cover half the head dimension (16 -> 2+3+3)
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": mrope_sections(head_dim),
            },
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
            "bos_token_id": None,
        },
        vision_config={
            "depth": 1,
            "embed_dim": 32,
            "num_heads": 2,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            **(vision or {}),
            "hidden_size": text_sizes["hidden_size"],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=None,
    )
    torch.manual_seed(0)
    Qwen2VLForConditionalGeneration(config).save_pretrained(str(folder))
    return folder


def mrope_sections(head_dim: int) -> list[int]:
    """Qwen2-VL's split of head_dim / 2 rotary pairs into temporal, height and width sections (1:1.5:1.5)."""
    half = head_dim // 2
    temporal = half // 4
    height = (half - temporal) // 2
    return [temporal, height, half - temporal - height]


def render_text(text: str, path: Path, size: int = IMAGE_SIZE) -> Path:
    """`text` in black on white, Pillow's default bitmap font, as a PNG at `path`."""
    image = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(image).text((2, size // 3), text, fill="black")
    path.parent.mkdir(parents=True, exist_ok=True)
    image.save(path)
    return path


def ocr_rows(
    folder: Path, n: int, seed: int, layout: str = "messages", image_size: int = IMAGE_SIZE
) -> list[dict]:
    """`n` rows, each an image of 3-5 random characters under folder/images and its text as the answer;
    image paths are relative to `folder` (the dataset file's folder)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(3, 5)))
        relative = f"images/{i:05d}.png"
        render_text(text, folder / relative, image_size)
        if layout == "messages":
            user = [{"type": "image", "image": relative}, {"type": "text", "text": PROMPT}]
            rows.append(
                {"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": text}]}
            )
        else:  # LLaMA-Factory's sharegpt layout with an images column
            turns = [{"from": "human", "value": f"<image>{PROMPT}"}, {"from": "gpt", "value": text}]
            rows.append({"conversations": turns, "images": [relative]})
    return rows


def write_ocr_jsonl(
    path: Path, n: int, seed: int, layout: str = "messages", image_size: int = IMAGE_SIZE
) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rows = ocr_rows(path.parent, n, seed, layout, image_size)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def vlm_args(*extra: str) -> tuple[str, ...]:
    """`trainpod run finetune-vlm` on the tiny config for STEPS steps; `extra` (--set ...) last."""
    return (
        "run",
        "finetune-vlm",
        "--config",
        str(TINY_VLM_CONFIG),
        "--set",
        f"train.max_steps={STEPS}",
        "--set",
        "train.eval_every=4",
        "--set",
        "checkpoint.every_steps=2",
        "--set",
        "train.log_every=1",
        *extra,
    )


def fresh(vlm_base_volume: Path, path: Path) -> Path:
    """A copy of the session's VLM volume (model and OCR rows) at `path`, to write into."""
    shutil.copytree(vlm_base_volume, path, dirs_exist_ok=True)
    return path


def adapter_bytes(volume: Path) -> bytes:
    return (volume / "runs" / VLM_RUN / "export/adapter/adapter_model.safetensors").read_bytes()


def build_vlm_finetuner(volume: Path, overrides: list[str]):
    """The finetune-vlm trainer of the tiny config on `volume`, built in this process (model loaded, no step
    taken), for tests that look inside the model."""
    from trainpod.config import load_config
    from trainpod.config.finetune_vlm import VlmFinetuneConfig
    from trainpod.context import RunContext
    from trainpod.preemption import PreemptionWatch
    from trainpod.train.distributed import init_distributed
    from trainpod.volume import Volume
    from trainpod.workloads.finetune_vlm import VlmFinetuner

    config = load_config(VlmFinetuneConfig, TINY_VLM_CONFIG, overrides)
    run = Volume(volume).run(VLM_RUN)
    run.create()
    return VlmFinetuner(RunContext(Volume(volume), run, PreemptionWatch()), config, init_distributed())
