"""Image + text SFT data: conversations with images -> ids with expanded image tokens, answer-only labels,
and image references; pixels are made per batch, on the fly, by the model's image processor.

    TRAINPOD_CONFIG=configs/finetune/tiny-vlm.yaml TRAINPOD_VOLUME=./demo-volume trainpod run finetune-vlm

Preparation reads every row once: it checks each image opens (a PNG by Pillow's verify, which checks
its CRCs without decoding; a JPEG by its end-of-image marker, decoded only without one; other formats,
which verify does not check, by decoding them), asks
the image processor how many tokens the image becomes at its size (Qwen2-VL: one per 28x28 patch
after resizing into [min_pixels, max_pixels]), renders the conversation with the model's own chat
template (one `<|vision_start|><|image_pad|><|vision_end|>` per image) and repeats each image's
pad token that many times, as the model's processor does. What is stored (cache/vlm/<key>/) is the
text side only: ids, the trained mask (reusing sft/'s layout and loader) and each sample's image
paths. Pixels are not cached: an OCR page at Qwen2-VL's defaults is ~1,500 patches x 1,176 floats,
7 MB per image in fp32, so 20,000 images would be 140 GB; decoding one micro batch's images costs
milliseconds next to the forward pass. Batches come in SftBatches' deterministic order, so resume
stays exact: the data position is still (epoch, step).
"""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import logging
import re
import shutil
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError
from safetensors.numpy import save

from trainpod.atomic import json_bytes, publish_dir, read_json, temp_name, write_bytes
from trainpod.config.finetune_vlm import VisionDataConfig, VisionSourceConfig
from trainpod.errors import InputError, Preempted
from trainpod.preemption import PreemptionWatch
from trainpod.sft.batches import SftBatches, unpacked_batch
from trainpod.sft.dataset import MANIFEST_FILE, SftExamples, split_arrays
from trainpod.sft.encode import cut_sample
from trainpod.sft.prepare import is_validation, tokenizer_files_hash
from trainpod.sft.sources import describe_files, resolve_files, rows_of_file
from trainpod.sft.templates import TokenizerChatTemplate

log = logging.getLogger(__name__)

VISION_FORMAT = "trainpod-vlm/2"  # 2: images turned upright by their EXIF orientation (token counts too)
PLACEHOLDER = "<image>"  # LLaMA-Factory's image placeholder in string contents
IMAGE_PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json")
HF_IMAGE_REF = re.compile(
    r"^hf:(?P<folder>.+)#(?P<row>\d+)#(?P<image>\d+)$"
)  # an image inside a saved HF dataset


# ------------------------------------------------------------------------------ processor
class VisionProcessor:
    """The model folder's tokenizer and image processor; what its AutoProcessor does for images.

    Not AutoProcessor itself: Qwen2-VL's processor also builds a video processor, which needs
    torchvision even for image-only data; the image processor and the expansion rule are all of it
    that images use (transformers' Qwen2VLProcessor.__call__: one pad token per merged patch).
    """

    def __init__(self, model_dir: Path, min_pixels: int | None = None, max_pixels: int | None = None):
        from transformers import AutoImageProcessor, AutoTokenizer

        model_dir = Path(model_dir)
        if not any((model_dir / name).is_file() for name in IMAGE_PROCESSOR_FILES):
            raise InputError(
                f"base model folder {model_dir} has no image processor ({' or '.join(IMAGE_PROCESSOR_FILES)}); "
                "a vision-language model (e.g. Qwen/Qwen2-VL-2B-Instruct) ships one: point base_model.path at it"
            )
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        # data.min_pixels/max_pixels set on the image processor itself (its `size`), not passed per call: so
        # the processor saved into the export resizes images as training did.
        self.image_kwargs = {
            k: v for k, v in (("min_pixels", min_pixels), ("max_pixels", max_pixels)) if v is not None
        }
        try:
            self.image_processor = AutoImageProcessor.from_pretrained(
                str(model_dir), local_files_only=True, **self.image_kwargs
            )
        except ImportError as exc:  # transformers before 5.23 load no image processor without torchvision
            import transformers

            missing = " ".join(str(exc).split()).split(". ")[0].rstrip(".") + "."  # its first sentence
            raise InputError(
                f"the image processor of {model_dir} cannot load: {missing} transformers "
                f"{transformers.__version__} needs torchvision for it: install the torchvision built for torch "
                f"{torch.__version__.split('+')[0]}, or transformers 5.23 or newer (its PIL processor needs "
                "none); the trainpod image has what it needs"
            ) from exc
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"
        self.image_token_id = self.tokenizer.convert_tokens_to_ids(self.image_token)
        self.merge = int(getattr(self.image_processor, "merge_size", 1))
        if not getattr(self.tokenizer, "chat_template", None):
            raise InputError(
                f"the tokenizer in {model_dir} has no chat_template; a vision-language model's template places its "
                "image tokens, so use the model's own folder (with chat_template.jinja or tokenizer_config.json)"
            )

    def image_tokens(self, width: int, height: int) -> int:
        """How many pad tokens an image of this size becomes (the processor's resize rule, no pixels read)."""
        patches = self.image_processor.get_number_of_image_patches(height, width, {})
        return int(patches) // (self.merge * self.merge)

    def pixels(self, images: list[Image.Image]) -> dict[str, torch.Tensor]:
        """pixel_values and image_grid_thw of the images, in order."""
        out = self.image_processor(images=images, return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}

    def files_hash(self, model_dir: Path) -> str:
        digest = hashlib.sha256(tokenizer_files_hash(model_dir).encode())
        for name in IMAGE_PROCESSOR_FILES:
            if (Path(model_dir) / name).is_file():
                digest.update((Path(model_dir) / name).read_bytes())
        return digest.hexdigest()


# ---------------------------------------------------------------------------------- images
def open_image(ref: str) -> Image.Image:
    """An image by its stored reference (a file path, or hf:<folder>#<row>#<k>), as RGB."""
    match = HF_IMAGE_REF.match(ref)
    if match:
        data = _hf_dataset(match["folder"])[int(match["row"])]
        source = data[_hf_images_column(match["folder"])][int(match["image"])]
        image = Image.open(io.BytesIO(source["bytes"])) if source.get("bytes") else Image.open(source["path"])
    else:
        image = Image.open(ref)
    # A phone photo: upright, as every viewer (and transformers' load_image) shows it.
    if exif_orientation(image) != 1:
        image = ImageOps.exif_transpose(image)
    return as_rgb(image)


QUARTER_TURNS = (5, 6, 7, 8)  # EXIF orientations that swap width and height


def exif_orientation(image: Image.Image) -> int:
    """The EXIF orientation tag (1: stored upright), read from the header without decoding the pixels (a
    PNG's EXIF after its pixels counts as upright: reading it would decode them)."""
    if image.format == "PNG" and "exif" not in image.info:
        return 1
    return int(image.getexif().get(ExifTags.Base.Orientation, 1))


def as_rgb(image: Image.Image) -> Image.Image:
    """RGB with any transparency composited onto white, as the image processor's own convert_to_rgb does:
    a plain convert keeps a transparent pixel's colour, often black, so black text on a transparent
    background became a black square."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, image.convert("RGBA")).convert("RGB")
    return image.convert("RGB")


_HF_DATASETS: dict[str, tuple[Any, str]] = {}


def _hf_dataset(folder: str, images_column: str = "images"):
    """A saved HF dataset, memory-mapped once per process, its image column left undecoded (bytes)."""
    if folder not in _HF_DATASETS:
        import datasets

        data = datasets.load_from_disk(folder)
        data = data.cast_column(images_column, datasets.Sequence(datasets.Image(decode=False)))
        _HF_DATASETS[folder] = (data, images_column)
    return _HF_DATASETS[folder][0]


def _hf_images_column(folder: str) -> str:
    return _HF_DATASETS[folder][1]


def check_image(ref: str, where: str, field: str) -> tuple[int, int]:
    """The image's (width, height), checked to open; InputError naming the row and field otherwise."""
    try:
        if HF_IMAGE_REF.match(ref):
            image = open_image(ref)
            return image.size
        with Image.open(ref) as image:
            size = image.size
            if exif_orientation(image) in QUARTER_TURNS:  # open_image's upright pixels are size[::-1]
                size = size[::-1]
            kind = image.format
            image.verify()  # reads the whole file and checks its structure (PNG CRCs) without decoding
        if kind != "PNG":  # verify checks nothing else: a JPEG cut short passed it, then crashed its batch
            _check_decodes(ref, kind)
        return size
    except FileNotFoundError:
        raise InputError(
            f"{where}: field {field!r}: image {ref} does not exist; fix the path or add the file"
        ) from None
    except Image.DecompressionBombError as exc:  # not an OSError: Pillow refuses over 2 x MAX_IMAGE_PIXELS
        raise InputError(
            f"{where}: field {field!r}: image {ref} is too large to decode ({exc}); downscale it (the image "
            "processor resizes it to data.max_pixels anyway) or drop the row"
        ) from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise InputError(
            f"{where}: field {field!r}: image {ref} is not a readable image ({type(exc).__name__}: {exc}); "
            "replace the file or drop the row"
        ) from None


def _check_decodes(ref: str, kind: str | None) -> None:
    """Decode the image (OSError when it is cut short or broken); a JPEG that ends with its end-of-image
    marker is taken as whole undecoded, since decoding a page costs ~70 ms (20,000 of them: 25 minutes)."""
    if kind in ("JPEG", "MPO"):  # MPO: a phone's JPEG with more pictures after the first
        with open(ref, "rb") as f:
            f.seek(-2, io.SEEK_END)
            if f.read(2) == b"\xff\xd9":
                return
    with Image.open(ref) as image:
        image.load()


# ------------------------------------------------------------------------------------ rows
@dataclass(frozen=True)
class VisionSample:
    """A conversation whose user turns may hold images; duck-types sft.formats.Sample for the template."""

    system: str | None
    pairs: tuple[tuple[tuple[str | int, ...], str], ...]  # (user parts: text or an image number, answer)
    images: tuple[str, ...]  # references, in the order the parts number them
    sizes: tuple[tuple[int, int], ...]  # each image's (width, height), checked to open
    where: str

    def messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"role": "system", "content": self.system}] if self.system else []
        for parts, answer in self.pairs:
            content = [
                {"type": "image"} if isinstance(part, int) else {"type": "text", "text": part}
                for part in parts
            ]
            out += [{"role": "user", "content": content}, {"role": "assistant", "content": answer}]
        return out


ROLES = {
    "messages": ("role", "content", "user", "assistant", "system"),
    "sharegpt": ("from", "value", "human", "gpt", "system"),
}


class VisionRowReader:
    """Rows of one dataset (entry `index` of data.datasets) -> VisionSamples with checked images."""

    def __init__(self, source: VisionSourceConfig, index: int, max_images: int, volume_root: Path):
        self.source = source
        self.field_prefix = f"data.datasets[{index}]"
        self.max_images = max_images
        self.volume_root = Path(volume_root)

    def sample(self, record: dict, where: str, base: Path, hf_row: int | None = None) -> VisionSample:
        turns = record.get(self.source.turns)
        if not isinstance(turns, list) or not turns:
            raise self._bad(where, self.source.turns, turns, "a non-empty list of turns")
        listed = self._listed_images(record, where, base, hf_row)
        role_key, content_key, user, assistant, system_role = self._tags(turns)
        column = self.source.images_column
        system, parsed, images = None, [], [(ref, column) for ref in listed]
        used = 0
        for number, turn in enumerate(turns):
            field = f"{self.source.turns}[{number}]"
            if not isinstance(turn, dict) or role_key not in turn or content_key not in turn:
                raise self._bad(where, field, turn, f"an object with {role_key!r} and {content_key!r}")
            role, content = turn[role_key], turn[content_key]
            if role == system_role and number == 0 and isinstance(content, str):
                system = content
                continue
            if role not in (user, assistant):
                raise self._bad(where, f"{field}.{role_key}", role, f"{user!r} or {assistant!r}")
            if role == assistant:
                if not isinstance(content, str):
                    raise self._bad(where, f"{field}.{content_key}", content, "a string (the answer)")
                parsed.append(("assistant", content))
                continue
            parts, used = self._user_parts(
                content, where, f"{field}.{content_key}", base, images, used, listed
            )
            parsed.append(("user", parts))
        # The images column's images are numbered first and inline parts' after, but the template places
        # image tokens (and the model takes pixels) in the order the turns show them: number them so.
        shown = [part for role, parts in parsed if role == "user" for part in parts if isinstance(part, int)]
        if shown != sorted(shown):
            number = {old: new for new, old in enumerate(shown)}
            parsed = [
                (
                    role,
                    tuple(number[p] if isinstance(p, int) else p for p in parts) if role == "user" else parts,
                )
                for role, parts in parsed
            ]
            images = [images[old] for old in shown]
        sizes = self._check_images(where, used, listed, images)
        refs = tuple(ref for ref, _ in images)
        return VisionSample(system, self._pairs(where, parsed), refs, sizes, where)

    def _tags(self, turns: list) -> tuple[str, str, str, str, str]:
        first = turns[0] if isinstance(turns[0], dict) else {}
        return ROLES["sharegpt"] if "from" in first and "role" not in first else ROLES["messages"]

    def _listed_images(self, record: dict, where: str, base: Path, hf_row: int | None) -> list[str]:
        column = self.source.images_column
        value = record.get(column, [])
        if value is None:
            return []
        if hf_row is not None:
            return [f"hf:{base}#{hf_row}#{k}" for k in range(len(value))]
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise self._bad(where, column, value, "a list of image paths")
        return [self._path(v, where, column, base) for v in value]

    def _user_parts(
        self,
        content,
        where: str,
        field: str,
        base: Path,
        images: list[tuple[str, str]],
        used: int,
        listed: list[str],
    ) -> tuple[tuple[str | int, ...], int]:
        """The parts of a user turn; an image part is its number in `images` ((reference, field) pairs)."""
        if isinstance(content, str):
            pieces = content.split(PLACEHOLDER)
            parts: list[str | int] = []
            for k, piece in enumerate(pieces):
                if k:
                    parts.append(used)
                    used += 1
                if piece:
                    parts.append(piece)
            return tuple(parts), used
        if not isinstance(content, list):
            raise self._bad(where, field, content, "a string or a list of {type: text|image} parts")
        parts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text" and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif kind in ("image", "image_url"):
                ref = (
                    part.get("image") or (part.get("image_url") or {}).get("url")
                    if kind == "image_url"
                    else part.get("image")
                )
                if ref is None and used < len(listed):  # {type: image} with the path in the images column
                    parts.append(used)
                    used += 1
                    continue
                if not isinstance(ref, str):
                    raise self._bad(where, f"{field}[{k}].image", ref, "an image path")
                images.append((self._path(ref, where, f"{field}[{k}].image", base), f"{field}[{k}].image"))
                parts.append(len(images) - 1)
            else:
                raise self._bad(
                    where, f"{field}[{k}]", part, "{type: text, text: ...} or {type: image, image: path}"
                )
        return tuple(parts), used

    def _check_images(
        self, where: str, used: int, listed: list[str], images: list[tuple[str, str]]
    ) -> tuple[tuple[int, int], ...]:
        """Placeholders match the listed images, at most max_images, each opens: their sizes."""
        column = self.source.images_column
        if used != len(listed):
            raise InputError(
                f"{where}: field {column!r} lists {len(listed)} image(s) but the turns hold {used} "
                f"{PLACEHOLDER} placeholder(s); put one {PLACEHOLDER} in the text where each image goes"
            )
        if len(images) > self.max_images:
            raise InputError(
                f"{where}: {len(images)} images, more than data.max_images={self.max_images}; raise "
                "data.max_images (each image costs its tokens of cutoff_len) or split the row"
            )
        return tuple(check_image(ref, where, field) for ref, field in images)

    def _path(self, raw: str, where: str, field: str, base: Path) -> str:
        if raw.startswith(("http://", "https://")):
            raise self._bad(
                where, field, raw, "a local image path (download the images onto the volume first)"
            )
        path = Path(raw).expanduser()
        if path.is_absolute():
            return str(path)
        for root in (base, self.volume_root):
            if (root / path).exists():
                return str(root / path)
        return str(base / path)  # does not exist: check_image names it

    def _pairs(self, where: str, turns: list[tuple[str, Any]]) -> tuple:
        roles = [role for role, _ in turns]
        if not turns or roles != ["user", "assistant"] * (len(turns) // 2) or len(turns) % 2:
            raise InputError(
                f"{where}: field {self.source.turns!r}: the turns go {', '.join(roles) or '(none)'}; they must "
                "alternate user, assistant, ... and end with an assistant answer (an optional system turn first)"
            )
        return tuple((turns[i][1], turns[i + 1][1]) for i in range(0, len(turns), 2))

    def _bad(self, where: str, field: str, value: object, expected: str) -> InputError:
        shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
        return InputError(
            f"{where}: field {field!r} = {shown} is not {expected}; fix the row (or {self.field_prefix}'s columns)"
        )


def iter_samples(
    source: VisionSourceConfig, reader: VisionRowReader, volume_root: Path
) -> Iterator[VisionSample]:
    """The dataset's samples in a fixed order: files sorted, rows front to back; at most max_samples."""
    for record, where, base, hf_row in itertools.islice(_records(source, volume_root), source.max_samples):
        yield reader.sample(record, where, base, hf_row)


def count_rows(source: VisionSourceConfig, volume_root: Path) -> int:
    """The rows a dataset gives (at most max_samples), its images unopened: what `trainpod estimate` counts."""
    return sum(1 for _ in itertools.islice(_records(source, volume_root), source.max_samples))


def _records(source: VisionSourceConfig, volume_root: Path) -> Iterator[tuple[dict, str, Path, int | None]]:
    if source.format == "hf":
        folder = _hf_folder(source, volume_root)
        data = _hf_dataset(str(folder), source.images_column)
        for index in range(len(data)):
            yield data[index], f"{folder}, row {index}", folder, index
        return
    for path in resolve_files(source, volume_root, "data"):  # type: ignore[arg-type]
        for row in rows_of_file(path):
            yield row.record, row.where, path.parent, None


def _hf_folder(source: VisionSourceConfig, volume_root: Path) -> Path:
    folder = Path(source.path) if Path(source.path).is_absolute() else Path(volume_root) / source.path
    if not (folder / "dataset_info.json").is_file():
        raise InputError(
            f"data.datasets path {source.path!r} ({folder}) is not a dataset saved with datasets' save_to_disk "
            "(no dataset_info.json); save it with Dataset.save_to_disk, or use format messages/sharegpt"
        )
    return folder


# ----------------------------------------------------------------------------- encoding
@dataclass(frozen=True)
class EncodedVision:
    input_ids: np.ndarray
    trained: np.ndarray
    images: tuple[str, ...]


def encode_sample(
    sample: VisionSample, template: TokenizerChatTemplate, processor: VisionProcessor, cutoff_len: int
) -> EncodedVision | None:
    """Ids with each image's pad token repeated to its token count; None when over cutoff_len."""
    segments = template.segments(sample)  # type: ignore[arg-type]
    counts = iter([_image_tokens(processor, sample, k) for k in range(len(sample.images))])
    pad = processor.image_token
    rendered = [segments.prefix, *(text for pair in segments.pairs for text in pair)]
    placed = sum(text.count(pad) for text in rendered)
    if placed != len(sample.images):  # one per image part, unless the row's own text holds the token
        raise InputError(
            f"{sample.where}: the chat template rendered {placed} image token(s) {pad} for {len(sample.images)} "
            f"image(s); the row's text must not hold {pad} itself: remove it from the text, or drop the row"
        )
    texts = [segments.prefix]
    for prompt, answer in segments.pairs:
        pieces = prompt.split(pad)
        texts += [pieces[0] + "".join(pad * next(counts) + piece for piece in pieces[1:]), answer]
    ids = processor.tokenizer(texts, add_special_tokens=False)["input_ids"]
    pairs = [(ids[i], ids[i + 1]) for i in range(1, len(ids), 2)]
    encoded = cut_sample(ids[0], pairs, cutoff_len, "drop", train_on_prompt=False)
    if encoded is None:
        return None
    return EncodedVision(encoded.input_ids, encoded.trained, sample.images)


def _image_tokens(processor: VisionProcessor, sample: VisionSample, k: int) -> int:
    """The token count of the sample's k-th image; InputError naming it where the processor refuses its size
    (Qwen-VL's resize refuses an aspect ratio over 200:1, e.g. a 4,100 x 20 text line)."""
    width, height = sample.sizes[k]
    try:
        return processor.image_tokens(width, height)
    except ValueError as exc:
        raise InputError(
            f"{sample.where}: image {sample.images[k]} ({width}x{height} pixels) is refused by the model's image "
            f"processor ({exc}); crop or pad the image, or drop the row"
        ) from None


# ------------------------------------------------------------------------------ the cache
def vision_key(data: VisionDataConfig, processor: VisionProcessor, model_dir: Path, volume_root: Path) -> str:
    """Settings, the tokenizer and image processor files, the data files' contents, and where the volume is
    mounted (images are referenced by absolute path: replacing an image file without touching the data
    file is not detected, and the same volume mounted elsewhere needs its own copy of the paths)."""
    files = [
        [f["sha256"] for f in describe_files(s, volume_root, "data")]
        if s.format != "hf"
        else _hf_fingerprint(s, volume_root)  # type: ignore[arg-type]
        for s in data.datasets
    ]
    return _key(_settings_record(data, processor, model_dir, volume_root) | {"files": files})


def vision_settings_key(
    data: VisionDataConfig, processor: VisionProcessor, model_dir: Path, volume_root: Path
) -> str:
    """vision_key without the data files' contents: what a run's pin (VLM_DATA_PIN) is kept for. A resume whose
    settings, processor and volume are the ones its first start prepared with takes that start's folder, though
    the data files were edited or removed since."""
    return _key(_settings_record(data, processor, model_dir, volume_root))


def _settings_record(
    data: VisionDataConfig, processor: VisionProcessor, model_dir: Path, volume_root: Path
) -> dict[str, Any]:
    return {
        "format": VISION_FORMAT,
        "settings": data.model_dump(mode="json"),
        "processor": processor.files_hash(model_dir),
        "volume_root": str(volume_root),
    }


def _key(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:16]


def is_complete(folder: Path) -> bool:
    """Whether prepare_vision finished `folder` (its manifest is written last)."""
    return (Path(folder) / MANIFEST_FILE).is_file()


def _hf_fingerprint(source: VisionSourceConfig, volume_root: Path) -> list[str]:
    folder = _hf_folder(source, volume_root)
    return (
        [hashlib.sha256((folder / "state.json").read_bytes()).hexdigest()]
        if (folder / "state.json").is_file()
        else []
    )


def prepare_vision(
    data: VisionDataConfig,
    processor: VisionProcessor,
    model_dir: Path,
    out_dir: Path,
    volume_root: Path,
    watch: PreemptionWatch | None = None,
) -> Path:
    """Build the text side of the dataset into `out_dir` (reused when complete), written whole."""
    out_dir = Path(out_dir)
    if is_complete(out_dir):
        log.info("VLM dataset %s is complete: reusing it", out_dir)
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    for leftover in out_dir.parent.glob(f"{out_dir.name}.tmp-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    tmp = temp_name(out_dir)
    tmp.mkdir()
    try:
        manifest = _build(data, processor, volume_root, tmp, watch or PreemptionWatch())
        manifest["tokenizer"] = {
            "path": str(model_dir),
            "vocab_size": len(processor.tokenizer),
            "eos_id": processor.tokenizer.eos_token_id,
            "pad_id": processor.tokenizer.pad_token_id if processor.tokenizer.pad_token_id is not None else 0,
        }
        write_bytes(tmp / MANIFEST_FILE, json_bytes(manifest))
        publish_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    counts = manifest["counts"]
    log.info(
        "VLM dataset %s: %d train / %d val samples, %d images, %d dropped over cutoff_len",
        out_dir,
        counts["train_samples"],
        counts["val_samples"],
        counts["images"],
        counts["dropped"],
    )
    return out_dir


def _build(data: VisionDataConfig, processor: VisionProcessor, volume_root: Path, tmp: Path, watch) -> dict:
    template = TokenizerChatTemplate(processor.tokenizer)
    splits: dict[str, list] = {"train": [], "val": []}
    images: dict[str, list[list[str]]] = {"train": [], "val": []}
    rows = dropped = image_count = 0
    for index, source in enumerate(data.datasets):
        reader = VisionRowReader(source, index, data.max_images, volume_root)
        for sample in iter_samples(source, reader, volume_root):
            if watch.requested:
                raise Preempted(f"VLM data preparation stopped by {watch.signal_name} after {rows} rows")
            encoded = encode_sample(sample, template, processor, data.cutoff_len)
            split = "val" if data.val_ratio and is_validation(rows, data.val_ratio, data.seed) else "train"
            if encoded is None:
                dropped += 1
            else:
                splits[split].append((rows, encoded.input_ids, encoded.trained))
                images[split].append(list(encoded.images))
                image_count += len(encoded.images)
            rows += 1
    if not splits["train"]:
        raise InputError(
            f"no training samples: {rows} rows read, {dropped} over data.cutoff_len={data.cutoff_len} (image "
            "tokens included); raise cutoff_len, or lower data.max_pixels so images take fewer tokens"
        )
    files, counts = {}, {"rows": rows, "dropped": dropped, "images": image_count}
    for split, examples in splits.items():
        blob = save(split_arrays(examples))
        write_bytes(tmp / f"{split}.safetensors", blob)
        write_bytes(tmp / f"{split}.images.json", json_bytes(images[split]))
        files[split] = {"file": f"{split}.safetensors", "bytes": len(blob), "samples": len(examples)}
        counts[f"{split}_samples"] = len(examples)
        counts[f"{split}_max_len"] = max((len(ids) for _, ids, _ in examples), default=0)
    return {
        "format": VISION_FORMAT,
        "complete": True,
        "template": "tokenizer",
        "settings": data.model_dump(mode="json"),
        "splits": files,
        "counts": counts,
    }


# ------------------------------------------------------------------------------- reading
class VisionExamples(SftExamples):
    """One split's samples (ids, labels) and each sample's image references."""

    def __init__(self, arrays: dict[str, np.ndarray], images: list[list[str]]):
        super().__init__(arrays)
        self.images = images


@dataclass
class VisionData:
    train: VisionExamples
    val: VisionExamples
    manifest: dict
    pad_id: int


def load_vision(folder: Path) -> VisionData:
    from safetensors.numpy import load_file

    manifest = read_json(Path(folder) / MANIFEST_FILE)
    splits = {
        split: VisionExamples(
            load_file(str(Path(folder) / f"{split}.safetensors")),
            read_json(Path(folder) / f"{split}.images.json"),
        )
        for split in ("train", "val")
    }
    return VisionData(splits["train"], splits["val"], manifest, int(manifest["tokenizer"]["pad_id"]))


def vision_batch(
    examples: VisionExamples, indices: Sequence[int], max_len: int, pad_id: int, processor: VisionProcessor
) -> dict[str, torch.Tensor]:
    """Right-padded ids and labels of the samples, their images' pixels, and mm_token_type_ids."""
    batch = unpacked_batch(examples, indices, max_len, pad_id)
    refs = [ref for i in indices for ref in examples.images[i]]
    if refs:
        batch |= processor.pixels([_batch_image(ref, indices) for ref in refs])
        expected = int((batch["input_ids"] == processor.image_token_id).sum())
        made = int(batch["image_grid_thw"].prod(-1).sum()) // (processor.merge * processor.merge)
        if made != expected:
            raise InputError(
                f"the images of samples {list(indices)} make {made} image tokens but the prepared text holds "
                f"{expected}; an image changed since the data was prepared: delete the dataset's cache folder"
            )
    # Which positions are image tokens (1) or text (0): Qwen-VL models place M-RoPE positions by it.
    batch["mm_token_type_ids"] = (batch["input_ids"] == processor.image_token_id).long()
    return batch


def _batch_image(ref: str, indices: Sequence[int]) -> Image.Image:
    """The image decoded; InputError naming it when it no longer reads (deleted or damaged since preparing)."""
    try:
        return open_image(ref)
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        raise InputError(
            f"image {ref} of samples {list(indices)} cannot be read ({type(exc).__name__}: {exc}); it was read "
            "when the data was prepared: restore the file, or drop its row and delete the dataset's cache folder"
        ) from None


class VisionBatches(SftBatches):
    """SftBatches' order (padded, never packed: an image's tokens must stay in its row), with pixels."""

    def __init__(self, examples: VisionExamples, processor: VisionProcessor, *args: Any, **kwargs: Any):
        super().__init__(examples, *args, packing=False, **kwargs)
        self.processor = processor

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self._step == self.steps_per_epoch:
            self._epoch, self._step = self._epoch + 1, 0
            self._rows = self._plan(self._epoch)
        start = self._step * self._global_rows + self.rank * self.micro_batch_size
        rows = self._rows[start : start + self.micro_batch_size]
        self._step += 1
        indices = [row[0] for row in rows]
        batch = vision_batch(self.examples, indices, self.max_len, self.pad_id, self.processor)
        self.last_trained_tokens = int((batch["labels"] != -100).sum())
        self.last_real_tokens = int(sum(self.lengths[i] for i in indices))
        return batch
