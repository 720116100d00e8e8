"""Image + text SFT data: image tokens as many as the image processor makes of the pixels, labels on
the answers only, the three input layouts alike, bad rows named by file, line and field, and batches
that resume where they were."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from PIL import Image

from trainpod.config.finetune_vlm import VisionDataConfig
from trainpod.errors import InputError
from trainpod.sft.vision import (
    VisionBatches,
    VisionProcessor,
    load_vision,
    open_image,
    prepare_vision,
    vision_batch,
)

from vlm_support import OCR_FILE, PROMPT, VLM_BASE, ocr_rows, render_text


def prepare(volume: Path, datasets: list[dict], **settings) -> Path:
    data = VisionDataConfig(datasets=datasets, **{"cutoff_len": 64, **settings})
    processor = VisionProcessor(volume / VLM_BASE)
    out = volume / "cache" / "vlm" / "test"
    shutil.rmtree(out, ignore_errors=True)
    return prepare_vision(data, processor, volume / VLM_BASE, out, volume)


@pytest.fixture
def volume(vlm_base_volume: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "volume"
    shutil.copytree(vlm_base_volume, copy)
    return copy


def test_a_transformers_that_needs_torchvision_for_the_image_processor_is_named(volume, monkeypatch):
    """transformers 5.17 (what a lent GPU machine has) raises this ImportError without torchvision; this
    environment's transformers does not, so its loader is made to raise it as 5.17 does."""
    import transformers

    def needs_torchvision(*args, **kwargs):
        raise ImportError(
            "\nAutoImageProcessor requires the Torchvision library but it was not found in your environment."
        )

    monkeypatch.setattr(transformers.AutoImageProcessor, "from_pretrained", needs_torchvision)
    with pytest.raises(InputError) as raised:
        VisionProcessor(volume / VLM_BASE)
    message = str(raised.value)
    assert str(volume / VLM_BASE) in message and "requires the Torchvision library" in message
    assert f"transformers {transformers.__version__} needs torchvision" in message
    assert f"torchvision built for torch {torch.__version__.split('+')[0]}" in message


def test_each_image_gets_as_many_tokens_as_the_image_processor_makes_of_its_pixels(volume):
    data = load_vision(prepare(volume, [{"path": OCR_FILE}]))
    processor = VisionProcessor(volume / VLM_BASE)
    for index in range(len(data.train)):
        refs = data.train.images[index]
        grid = processor.image_processor(images=[open_image(r) for r in refs], return_tensors="pt")[
            "image_grid_thw"
        ]
        made = int(grid.prod(-1).sum()) // processor.merge**2
        held = int((data.train[index].input_ids == processor.image_token_id).sum())
        assert held == made == 4, f"sample {index}: {held} image tokens in the ids, the pixels make {made}"


def test_only_the_answer_and_its_end_of_turn_are_trained(volume):
    """Against an independent rendering: the chat template's full text, and the answer tokenized alone."""
    data = load_vision(prepare(volume, [{"path": OCR_FILE}]))
    processor = VisionProcessor(volume / VLM_BASE)
    tokenizer = processor.tokenizer
    rows = [json.loads(line) for line in (volume / OCR_FILE).read_text().splitlines()]
    for example in list(data.train)[:10]:
        row = rows[example.row_index]
        answer = row["messages"][1]["content"]
        full = tokenizer.apply_chat_template(row["messages"], tokenize=False)
        assert full.endswith(answer + "<|im_end|>\n")
        expected = tokenizer(answer + "<|im_end|>\n", add_special_tokens=False)["input_ids"]
        trained = example.labels != -100
        assert example.input_ids[trained].tolist() == expected
        assert trained[-len(expected) :].all() and not trained[: -len(expected)].any()
        prompt = tokenizer.decode(example.input_ids[~trained].tolist())
        assert prompt.count("<|image_pad|>") == 4 and PROMPT in prompt


def test_llamafactory_layout_and_a_saved_hf_dataset_give_the_same_samples_as_messages(volume):
    import datasets

    messages = load_vision(prepare(volume, [{"path": OCR_FILE}]))
    sharegpt_rows = ocr_rows(volume / "data/ocr", 40, seed=5, layout="sharegpt")
    sharegpt = volume / "data/ocr/sharegpt.jsonl"
    sharegpt.write_text("".join(json.dumps(r) + "\n" for r in sharegpt_rows))
    llamafactory = load_vision(prepare(volume, [{"path": "data/ocr/sharegpt.jsonl", "format": "sharegpt"}]))
    hf_rows = {
        "messages": [[{"role": "user", "content": f"<image>{PROMPT}"}, {"role": "assistant", "content": t[1]["value"]}]
                     for t in (r["conversations"] for r in sharegpt_rows)],
        "images": [[str(volume / "data/ocr" / r["images"][0])] for r in sharegpt_rows],
    }  # fmt: skip
    features = datasets.Features(
        {
            "messages": [{"role": datasets.Value("string"), "content": datasets.Value("string")}],
            "images": datasets.Sequence(datasets.Image()),
        }
    )
    datasets.Dataset.from_dict(hf_rows, features=features).save_to_disk(str(volume / "data/ocr-hf"))
    saved = load_vision(prepare(volume, [{"path": "data/ocr-hf", "format": "hf"}]))
    for other in (llamafactory, saved):
        assert len(other.train) == len(messages.train) == 40
        for a, b in zip(messages.train, other.train, strict=True):
            assert a.input_ids.tolist() == b.input_ids.tolist() and a.labels.tolist() == b.labels.tolist()
    first = open_image(saved.train.images[0][0])
    assert first.tobytes() == open_image(messages.train.images[0][0]).tobytes()


def write_rows(volume: Path, rows: list[dict]) -> str:
    path = volume / "data/ocr/bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return "data/ocr/bad.jsonl"


def image_row(*images: str, text: str = "<image>" + PROMPT) -> dict:
    turns = [{"role": "user", "content": text}, {"role": "assistant", "content": "ABC"}]
    return {"messages": turns, "images": list(images)}


@pytest.mark.parametrize(
    ("bad_row", "expected"),
    [
        (image_row("images/missing.png"), ["line 2", "'images'", "missing.png", "does not exist"]),
        (image_row("images/corrupt.png"), ["line 2", "'images'", "corrupt.png", "not a readable image"]),
        (image_row("images/00001.png", text=PROMPT), ["line 2", "'images'", "1 image(s)", "0 <image> placeholder"]),
        (image_row("images/00001.png", "images/00002.png", text="<image><image>"), ["line 2", "2 images", "max_images=1"]),
        (
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "images/nope.png"}]},
                          {"role": "assistant", "content": "A"}]},
            ["line 2", "messages[0].content[0].image", "nope.png", "does not exist"],
        ),
    ],
    ids=["missing-image", "corrupt-image", "no-placeholder", "too-many-images", "missing-image-part"],
)  # fmt: skip
def test_a_bad_row_is_named_by_file_line_and_field(volume, bad_row, expected):
    (volume / "data/ocr/images/corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\nnot really a png")
    path = write_rows(volume, [image_row("images/00000.png"), bad_row])
    with pytest.raises(InputError) as error:
        prepare(volume, [{"path": path}], max_images=1)
    message = str(error.value)
    assert str(volume / path) in message
    for part in expected:
        assert part in message, f"{part!r} missing from: {message}"


def test_images_are_found_beside_the_data_file_or_on_the_volume(volume):
    render_text("XYZ", volume / "shared-images/xyz.png")
    path = write_rows(volume, [image_row("images/00000.png"), image_row("shared-images/xyz.png")])
    data = load_vision(prepare(volume, [{"path": path}]))
    assert data.train.images[1] == [str(volume / "shared-images/xyz.png")]


def test_batches_resume_at_the_same_images_in_the_same_order(volume):
    data = load_vision(prepare(volume, [{"path": OCR_FILE}]))
    processor = VisionProcessor(volume / VLM_BASE)

    def batches() -> VisionBatches:
        return VisionBatches(
            data.train,
            processor,
            micro_batch_size=2,
            max_len=64,
            seed=3,
            rank=0,
            world_size=1,
            pad_id=data.pad_id,
        )

    first = batches()
    for _ in range(23):  # into the second epoch (20 steps each)
        first.next_batch()
    state = first.state_dict()
    expected = first.next_batch()
    second = batches()
    second.load_state_dict(state)
    got = second.next_batch()
    assert expected.keys() == got.keys() >= {"pixel_values", "image_grid_thw", "mm_token_type_ids", "labels"}
    for key in expected:
        assert torch.equal(expected[key], got[key]), key


def test_pixels_are_decoded_as_rgb_whatever_the_file_mode(volume):
    Image.new("L", (56, 56), 128).save(volume / "gray.png")
    assert open_image(str(volume / "gray.png")).mode == "RGB"


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparent_pixels_are_white_as_the_image_processor_makes_them(volume, mode):
    """Black text on a transparent background: a plain convert('RGB') makes the page black too."""
    from PIL import ImageDraw

    page = Image.new("RGBA", (56, 56), (0, 0, 0, 0))
    ImageDraw.Draw(page).text((2, 20), "ABC", fill=(0, 0, 0, 255))
    path = volume / f"transparent-{mode}.png"
    page.convert(mode).save(path)
    processor = VisionProcessor(volume / VLM_BASE)
    ours = processor.pixels([open_image(str(path))])["pixel_values"]
    own = processor.image_processor(images=[Image.open(path)], return_tensors="pt")["pixel_values"]
    assert torch.equal(ours, own)
    assert open_image(str(path)).getpixel((0, 0)) == (255, 255, 255)


def test_a_photo_with_an_exif_orientation_is_trained_upright_with_its_upright_token_count(volume):
    """A phone photo stored sideways with orientation 6 (turn 90 degrees): every viewer and transformers'
    load_image show it 56 wide and 112 tall, so its pixels and its image tokens must be of that."""
    from transformers.image_utils import load_image

    stored = Image.new("RGB", (112, 56), "white")
    stored.paste((0, 0, 0), (0, 0, 20, 56))  # a black band on the left of the stored pixels
    exif = Image.Exif()
    exif[0x0112] = 6
    stored.save(volume / "data/ocr/photo.jpg", exif=exif, quality=95)
    path = write_rows(volume, [image_row("photo.jpg")])
    data = load_vision(prepare(volume, [{"path": path}], max_pixels=56 * 112))
    processor = VisionProcessor(volume / VLM_BASE, max_pixels=56 * 112)
    batch = vision_batch(data.train, [0], 64, data.pad_id, processor)
    assert batch["image_grid_thw"].tolist() == [[1, 8, 4]]  # 112 tall, 56 wide: 8 x 4 patches
    assert int((batch["input_ids"] == processor.image_token_id).sum()) == 8
    upright = load_image(str(volume / "data/ocr/photo.jpg"))
    assert open_image(data.train.images[0][0]).tobytes() == upright.convert("RGB").tobytes()


def test_an_image_the_processor_refuses_for_its_aspect_ratio_is_named_with_its_row(volume):
    """Qwen-VL's resize raises ValueError over 200:1; preparing crashed with it (exit 1, no row named)."""
    Image.new("RGB", (4100, 20), "white").save(volume / "data/ocr/images/line.png")
    path = write_rows(volume, [image_row("images/00000.png"), image_row("images/line.png")])
    with pytest.raises(InputError) as error:
        prepare(volume, [{"path": path}])
    message = str(error.value)
    for part in (str(volume / path), "line 2", "line.png", "4100x20", "aspect ratio"):
        assert part in message, f"{part!r} missing from: {message}"


def test_an_image_over_pillows_size_limit_is_named_with_its_row(volume, monkeypatch):
    """Pillow raises DecompressionBombError (not an OSError) over twice MAX_IMAGE_PIXELS (179 M pixels by
    default: a large scan); the limit is lowered here so that a small file is over it."""
    Image.new("RGB", (200, 100), "white").save(volume / "data/ocr/images/scan.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5000)
    path = write_rows(volume, [image_row("images/00000.png"), image_row("images/scan.png")])
    with pytest.raises(InputError) as error:
        prepare(volume, [{"path": path}])
    message = str(error.value)
    for part in (str(volume / path), "line 2", "'images'", "scan.png", "too large"):
        assert part in message, f"{part!r} missing from: {message}"


def test_the_exported_image_processor_resizes_images_as_training_did(vlm_base_volume, tmp_path):
    """With data.max_pixels set, the processor saved beside the adapter (and over the base model's copy in a
    full export) must make as many image tokens of an image as training gave it: it held the base's sizes."""
    from transformers import AutoImageProcessor

    from vlm_support import build_vlm_finetuner, fresh

    volume = fresh(vlm_base_volume, tmp_path / "volume")
    trainer = build_vlm_finetuner(volume, ["method=lora", "data.max_pixels=3136", "data.min_pixels=3136"])
    trained = trainer.processor.image_tokens(112, 112)
    assert trained == 4  # 112 x 112 down to 56 x 56: 2 x 2 merged patches
    assert int((trainer.data.train[0].input_ids == trainer.processor.image_token_id).sum()) == 4

    def exported_tokens(folder: Path) -> int:
        exported = AutoImageProcessor.from_pretrained(str(folder))
        grid = exported(images=[Image.new("RGB", (112, 112), "white")], return_tensors="pt")["image_grid_thw"]
        return int(grid.prod(-1).sum()) // trainer.processor.merge**2

    trainer.save_processor(tmp_path / "adapter")
    assert exported_tokens(tmp_path / "adapter") == trained
    full = tmp_path / "full"  # export_hf writes these files over the base model's copies
    full.mkdir()
    for name, content in trainer.processor_json().items():
        (full / name).write_text(json.dumps(content))
    assert exported_tokens(full) == trained


def test_an_inline_image_before_an_images_column_one_keeps_its_place(volume):
    """A row whose first turn holds an inline image part and whose second turn an <image> placeholder of the
    images column: the first turn's image tokens and pixels must be the inline image's."""
    Image.new("RGB", (112, 56), "white").save(volume / "data/ocr/images/wide.png")  # 8 tokens
    turns = [
        {
            "role": "user",
            "content": [{"type": "image", "image": "images/wide.png"}, {"type": "text", "text": "A?"}],
        },
        {"role": "assistant", "content": "A"},
        {"role": "user", "content": "<image>B?"},
        {"role": "assistant", "content": "B"},
    ]
    path = write_rows(volume, [{"messages": turns, "images": ["images/00000.png"]}])  # 56 x 56: 4 tokens
    data = load_vision(prepare(volume, [{"path": path}], max_images=2, cutoff_len=256))
    folder = volume / "data/ocr/images"
    assert data.train.images[0] == [str(folder / "wide.png"), str(folder / "00000.png")]
    processor = VisionProcessor(volume / VLM_BASE)
    text = processor.tokenizer.decode(data.train[0].input_ids.tolist())
    runs = [len(run) // len("<|image_pad|>") for run in re.findall(r"(?:<\|image_pad\|>)+", text)]
    assert runs == [8, 4]
    assert text.index("A?") < text.index("B?")


def test_the_same_volume_mounted_elsewhere_does_not_reuse_image_paths_of_the_old_mount(volume, tmp_path):
    """A pod mounts the network volume at another path (volume.mount_path, TRAINPOD_VOLUME): the stored
    samples name their images by absolute path, so the old mount's cache crashed the first batch."""
    from trainpod.sft.vision import vision_key

    data = VisionDataConfig(datasets=[{"path": OCR_FILE}], cutoff_len=64)

    def first_batch(root: Path) -> dict:
        processor = VisionProcessor(root / VLM_BASE)
        key = vision_key(data, processor, root / VLM_BASE, root)
        prepared = load_vision(
            prepare_vision(data, processor, root / VLM_BASE, root / "cache/vlm" / key, root)
        )
        return vision_batch(prepared.train, [0, 1], 64, prepared.pad_id, processor)

    first = first_batch(volume)
    moved = volume.rename(tmp_path / "mounted-elsewhere")
    again = first_batch(moved)
    assert torch.equal(first["pixel_values"], again["pixel_values"])


def test_a_jpeg_cut_short_is_named_while_preparing_not_crashed_on_in_its_batch(volume):
    """Pillow's verify checks PNG CRCs but nothing of a JPEG: a truncated JPEG passed preparation and its
    batch crashed training with OSError (exit 1, at the same step at every restart)."""
    import numpy as np

    noise = np.random.default_rng(0).integers(0, 255, (56, 56, 3), dtype=np.uint8)
    Image.fromarray(noise).save(volume / "data/ocr/images/whole.jpg", quality=95)
    whole = (volume / "data/ocr/images/whole.jpg").read_bytes()
    (volume / "data/ocr/images/cut.jpg").write_bytes(whole[: len(whole) // 2])
    path = write_rows(volume, [image_row("images/00000.png"), image_row("images/cut.jpg")])
    with pytest.raises(InputError) as error:
        prepare(volume, [{"path": path}])
    message = str(error.value)
    for part in (str(volume / path), "line 2", "'images'", "cut.jpg", "truncated"):
        assert part in message, f"{part!r} missing from: {message}"


def test_an_image_damaged_after_preparing_stops_its_batch_with_an_input_error(volume):
    path = write_rows(volume, [image_row("images/00000.png"), image_row("images/00001.png")])
    data = load_vision(prepare(volume, [{"path": path}]))
    (volume / "data/ocr/images/00001.png").unlink()
    with pytest.raises(InputError, match=r"00001\.png of samples \[0, 1\] cannot be read"):
        vision_batch(data.train, [0, 1], 64, data.pad_id, VisionProcessor(volume / VLM_BASE))


def test_the_eval_decodes_a_batch_of_images_at_a_time_and_a_stop_ends_it_before_the_rest(
    vlm_base_volume, tmp_path, monkeypatch
):
    """A validation split of pages is gigabytes of pixels (a 2 MP page at Qwen2-VL's defaults: ~50 MB in
    fp32); the eval made every batch, every image decoded, before its first forward and first stop check."""
    import trainpod.sft.vision as vision
    from trainpod.train.trainer import EvalInterrupted

    from vlm_support import build_vlm_finetuner, fresh

    volume = fresh(vlm_base_volume, tmp_path / "volume")
    trainer = build_vlm_finetuner(volume, ["method=lora", "data.val_ratio=0.3", "train.micro_batch_size=1"])
    assert len(trainer.data.val) >= 3
    decoded = []
    monkeypatch.setattr(
        vision, "open_image", lambda ref, real=vision.open_image: decoded.append(ref) or real(ref)
    )
    trainer.ctx.watch.request("test")
    with pytest.raises(EvalInterrupted):
        trainer.evaluate(trainer.model, step=1)
    assert len(decoded) <= 1, f"{len(decoded)} of {len(trainer.data.val)} validation images decoded"


@pytest.mark.parametrize("where", ["prompt", "answer"])
def test_a_row_whose_text_holds_the_image_token_itself_is_named(volume, where):
    """Text holding `<|image_pad|>` (a row about the model's own tokens): in a prompt it crashed preparing
    (RuntimeError: generator raised StopIteration, exit 1), in an answer its batch said an image changed."""
    row = image_row("images/00000.png")
    if where == "prompt":
        row["messages"][0]["content"] += " What is <|image_pad|>?"
    else:
        row["messages"][1]["content"] = "It is <|image_pad|>"
    path = write_rows(volume, [image_row("images/00001.png"), row])
    with pytest.raises(InputError) as error:
        prepare(volume, [{"path": path}])
    message = str(error.value)
    for part in (str(volume / path), "line 2", "2 image token(s) <|image_pad|> for 1 image(s)"):
        assert part in message, f"{part!r} missing from: {message}"
