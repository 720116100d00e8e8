"""The tensor-level merge of plain LoRA writes what peft's merge_and_unload + save_pretrained writes, and
outputs hashed while being written carry the same sha256 as the files on disk.

.venv/bin/pytest -q tests/test_convert_fast_merge.py
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import pytest
import safetensors.torch
import torch

from trainpod import tensorfile
from trainpod.convert import adapter as peft_adapter
from trainpod.convert import merge, output, run_convert, tensor_merge
from trainpod.errors import TemporaryError
from trainpod.preemption import PreemptionWatch
from trainpod.volume import Volume

from convert_support import convert_config, make_adapter, make_base

QLORA_SUMMARY = {
    "method": "qlora",
    "quantization": {"quant_type": "nf4", "double_quant": True, "compute_dtype": "bfloat16"},
}


@pytest.fixture
def base(tmp_path: Path) -> Path:
    return make_base(tmp_path / "base")


def reason(adapter_dir: Path, base: Path) -> str | None:
    adapter = peft_adapter.load_adapter(adapter_dir)
    return tensor_merge.reason_for_peft(adapter, tensor_merge.skeleton(base), base)


@pytest.mark.parametrize(
    "lora",
    [
        pytest.param({}, id="lora"),
        pytest.param(
            {"use_rslora": True, "rank_pattern": {"q_proj": 8}, "alpha_pattern": {"v_proj": 3}}, id="rslora"
        ),
    ],
)
def test_plain_lora_takes_the_tensor_level_merge(base: Path, tmp_path: Path, lora: dict) -> None:
    assert reason(make_adapter(base, tmp_path / "adapter", **lora), base) is None


@pytest.mark.parametrize(
    ("lora", "named"),
    [
        pytest.param({"use_dora": True}, "use_dora", id="dora"),
        pytest.param({"modules_to_save": ["lm_head"]}, "modules_to_save", id="modules_to_save"),
        pytest.param({"lora_bias": True}, "lora_bias", id="lora_bias"),
        pytest.param({"bias": "all"}, "bias", id="bias"),
        pytest.param({"target_modules": ["q_proj", "embed_tokens"]}, "embed_tokens", id="embedding-lora"),
    ],
)
def test_everything_but_plain_lora_goes_through_peft(
    base: Path, tmp_path: Path, lora: dict, named: str
) -> None:
    why = reason(make_adapter(base, tmp_path / "adapter", **lora), base)
    assert why is not None and (named in why or "besides LoRA A/B" in why), why


def test_a_base_with_tied_embeddings_goes_through_peft(tmp_path: Path) -> None:
    tied = make_base(tmp_path / "tied", tie=True)
    assert "ties" in reason(make_adapter(tied, tmp_path / "adapter"), tied)


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_weights_in_another_layout_beside_the_models_are_not_read(tmp_path: Path, sharded: bool) -> None:
    # Mistral's hub repos hold the weights twice: the HF files and consolidated.safetensors under Mistral's
    # own names. Every *.safetensors counted as the model's, so its names "differed" and a plain LoRA took
    # peft's path (the whole model built in float32 in memory) instead of the streamed tensor merge.
    base = make_base(tmp_path / "base")
    if sharded:
        model = safetensors.torch.load_file(base / "model.safetensors")
        (base / "model.safetensors").unlink()
        names = sorted(model)
        halves = {
            "model-00001-of-00002.safetensors": names[::2],
            "model-00002-of-00002.safetensors": names[1::2],
        }
        for shard, shard_names in halves.items():
            safetensors.torch.save_file(
                {n: model[n] for n in shard_names}, base / shard, metadata={"format": "pt"}
            )
        weight_map = {n: shard for shard, shard_names in halves.items() for n in shard_names}
        (base / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": weight_map})
        )
    consolidated = {"tok_embeddings.weight": torch.zeros(4, 4), "output.weight": torch.zeros(4, 4)}
    safetensors.torch.save_file(consolidated, base / "consolidated.safetensors")
    adapter_dir = make_adapter(base, tmp_path / "adapter")
    assert reason(adapter_dir, base) is None
    vol = Volume(tmp_path / "volume")
    config = convert_config(
        {"kind": "merge", "dtype": "float32"}, adapter=str(adapter_dir), base_model=str(base)
    )
    [out] = run_convert(config, vol, PreemptionWatch())
    merged = merge.merged_model(adapter_dir, base, None, "dequantized").state_dict()
    got = safetensors.torch.load_file(out / "model.safetensors")
    assert set(got) == set(merged) and all(torch.equal(got[n], merged[n]) for n in got)


def write_both(base: Path, adapter_dir: Path, tmp_path: Path, **task) -> tuple[Path, Path]:
    """The same merge by the tensor-level path and by peft's path, into two folders."""
    adapter = peft_adapter.load_adapter(adapter_dir)
    args = {"dtype": "float32", "quantization": adapter.quantization, "qlora_base": "dequantized"}
    args |= {"max_shard_size": "5GB"} | task
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    round_trip = merge.nf4_round_trip(args["quantization"]) if args["quantization"] else None
    skeleton = tensor_merge.skeleton(base)
    tensor_merge.write_merged(
        adapter, base, skeleton, output.Staging(fast), args["dtype"], round_trip, args["max_shard_size"]
    )
    merge.write_merged_with_peft(adapter_dir, base, slow, **args)
    return fast, slow


@pytest.mark.parametrize(
    ("summary", "task"),
    [
        pytest.param(None, {}, id="float32"),
        pytest.param(None, {"dtype": "bfloat16", "max_shard_size": "100KB"}, id="bfloat16-sharded"),
        pytest.param(QLORA_SUMMARY, {}, id="qlora-dequantized"),
    ],
)
def test_tensor_level_merge_writes_what_peft_and_save_pretrained_write(
    base: Path, tmp_path: Path, summary: dict | None, task: dict
) -> None:
    adapter_dir = make_adapter(base, tmp_path / "adapter", summary=summary)
    fast, slow = write_both(base, adapter_dir, tmp_path, **task)
    assert sorted(p.name for p in fast.iterdir()) == sorted(p.name for p in slow.iterdir())
    for name in ("config.json", "generation_config.json", "model.safetensors.index.json"):
        if (slow / name).exists():
            assert json.loads((fast / name).read_text()) == json.loads((slow / name).read_text()), name
    for path in slow.glob("*.safetensors"):
        expected, got = safetensors.torch.load_file(path), safetensors.torch.load_file(fast / path.name)
        assert set(got) == set(expected), path.name
        for key in expected:
            assert got[key].dtype == expected[key].dtype and torch.equal(got[key], expected[key]), (
                f"{path.name}:{key} differs from peft's merge; the tensor-level merge must repeat peft's "
                "arithmetic exactly (B @ A, times scale, plus W, in float32, then cast)"
            )
        assert safetensors.safe_open(fast / path.name, "pt").metadata() == {"format": "pt"}


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class DirectWrites:
    """Counts the bytes written through O_DIRECT descriptors; `refuse_after` makes the filesystem refuse
    direct writes (EINVAL) once that many calls went through, the last one only half written."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, mode: str):
        self.direct_fds: set[int] = set()
        self.direct_bytes = 0
        self.calls = 0
        self.refuse_after = 2 if mode == "direct refused mid-file" else None
        open_direct, pwrite_all = output._open_direct, output._pwrite_all

        def counting_open(path: Path) -> int | None:
            fd = None if mode == "page cache only" else open_direct(path)
            if fd is not None:
                self.direct_fds.add(fd)
            return fd

        def counting_pwrite(fd: int, data: memoryview, offset: int) -> None:
            if fd in self.direct_fds and len(data):
                self.calls += 1
                if self.refuse_after is not None and self.calls > self.refuse_after:
                    pwrite_all(fd, data[: len(data) // 2 // 4096 * 4096], offset)
                    self.direct_fds.discard(fd)  # closed by the writer; its number may be reused
                    raise OSError(errno.EINVAL, "Invalid argument")
                self.direct_bytes += len(data)
            pwrite_all(fd, data, offset)

        monkeypatch.setattr(output, "_open_direct", counting_open)
        monkeypatch.setattr(output, "_pwrite_all", counting_pwrite)


def direct_writes_work_in(folder: Path) -> bool:
    probe = folder / "direct-probe"
    probe.touch()
    fd = output._open_direct(probe)
    if fd is None:
        return False
    buffer = output._ChunkBuffers().take(4096)[:4096]
    try:
        os.pwrite(fd, memoryview(buffer.numpy()), 0)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
        probe.unlink()


@pytest.mark.parametrize("mode", ["direct", "page cache only", "direct refused mid-file"])
def test_files_hashed_while_written_carry_the_sha256_of_their_bytes_on_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    # Tensors spanning several chunks: one larger than a chunk, small ones that end a chunk early, and
    # more chunks than buffers, so buffers are reused; files written by hand are hashed from the disk.
    # Whole blocks go direct where the filesystem allows it, and every byte through the page cache where
    # it does not, or stops allowing it mid-file.
    if mode != "page cache only" and not direct_writes_work_in(tmp_path):
        pytest.skip(f"the filesystem of {tmp_path} refuses O_DIRECT writes")
    direct = DirectWrites(monkeypatch, mode)
    small = output.CHUNK_BYTES // 4 // 3  # three of them leave a quarter of a chunk: the next does not fit
    specs = {
        "big": (torch.float32, (output.CHUNK_BYTES // 4 + 5,)),
        **{f"small{i}": (torch.float32, (small,)) for i in range(8)},
        "odd": (torch.bfloat16, (3, 7)),
        "scalar": (torch.int8, ()),
        "nothing": (torch.float16, (0, 4)),
    }
    generator = torch.Generator().manual_seed(0)
    expected = {
        name: (torch.randn(shape, generator=generator) * 100).to(dtype)
        for name, (dtype, shape) in specs.items()
    }
    staging = output.Staging(tmp_path / "out")
    staging.folder.mkdir()
    staging.write_tensors(
        "t.safetensors",
        tensorfile.layout(specs, {"format": "pt"}),
        lambda name, slot: slot.copy_(expected[name]),
    )
    staging.write_tensors(
        "again.safetensors", tensorfile.layout({"x": specs["odd"]}, {}), lambda _, s: s.fill_(1)
    )
    staging.write_file("empty", b"")
    (staging.folder / "by-hand.txt").write_text("written without the staging's help")
    (staging.folder / "empty-by-hand").write_bytes(b"")
    digests = staging.file_digests()
    for name in ("t.safetensors", "again.safetensors", "empty", "by-hand.txt", "empty-by-hand"):
        path = tmp_path / "out" / name
        assert digests[name] == {"bytes": path.stat().st_size, "sha256": sha256_of(path)}, name
    loaded = safetensors.torch.load_file(tmp_path / "out" / "t.safetensors")
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
    assert torch.equal(
        safetensors.torch.load_file(tmp_path / "out" / "again.safetensors")["x"],
        torch.ones(3, 7, dtype=torch.bfloat16),
    )
    if mode == "direct":  # all but the partial blocks at the chunks' ends went direct
        assert direct.direct_bytes > (tmp_path / "out" / "t.safetensors").stat().st_size - 10 * 4096
    elif mode == "page cache only":
        assert direct.direct_bytes == 0
    else:
        assert direct.calls > direct.refuse_after, "the refusal must have happened mid-file"


def test_tensors_read_from_their_offsets_equal_what_safetensors_loads(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    tensors = {
        "w": torch.randn(5, 3, generator=generator),
        "half": torch.randn(7, generator=generator).to(torch.bfloat16),
        "double": torch.randn(2, 2, generator=generator).double(),
        "scalar": torch.tensor(3, dtype=torch.int8),
        "nothing": torch.zeros(0, 4, dtype=torch.float16),
    }
    path = tmp_path / "model.safetensors"
    safetensors.torch.save_file(tensors, path, metadata={"format": "pt"})
    index = tensorfile.read_index(path)
    assert index.keys() == tensors.keys()
    with open(path, "rb") as f:
        for name, expected in tensors.items():
            stored = index[name]
            assert (stored.dtype, stored.shape) == (expected.dtype, tuple(expected.shape)), name
            out = torch.full(stored.shape, 9, dtype=stored.dtype)
            tensorfile.read_into(f.fileno(), stored, out)
            assert torch.equal(out, expected), name
        # A file cut short after its header was read has changed under the conversion: exit 75.
        os.truncate(path, index["w"].offset + 4)
        with pytest.raises(TemporaryError, match="truncated while being converted"):
            tensorfile.read_into(f.fileno(), index["w"], torch.empty(5, 3))


def test_a_fill_that_fails_is_the_error_reported(tmp_path: Path) -> None:
    specs = {f"t{i}": (torch.float32, (output.CHUNK_BYTES // 8,)) for i in range(6)}  # several chunks

    def fill(name: str, slot: torch.Tensor) -> None:
        if name == "t4":
            raise ValueError("no such tensor in the base")
        slot.zero_()

    staging = output.Staging(tmp_path / "out")
    staging.folder.mkdir()
    with pytest.raises(ValueError, match="no such tensor in the base"):
        staging.write_tensors("t.safetensors", tensorfile.layout(specs, {}), fill)


def test_a_rewritten_adapter_is_converted_again_to_the_same_bytes(tmp_path: Path, base: Path) -> None:
    # Inputs are known by path, size and mtime, not read: a new mtime means converting again.
    vol = Volume(tmp_path / "volume")
    adapter_dir = make_adapter(base, vol.run("ft").export / "adapter")
    config = convert_config(["mlx", {"kind": "merge", "dtype": "float32"}])
    run_convert(config, vol, PreemptionWatch())
    export = vol.run("ft").export
    first = {name: json.loads((export / name / "manifest.json").read_text()) for name in ("mlx", "merged")}
    weights = adapter_dir / "adapter_model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    run_convert(config, vol, PreemptionWatch())
    for name in ("mlx", "merged"):
        manifest = json.loads((export / name / "manifest.json").read_text())
        assert manifest["key"] != first[name]["key"], name
        assert manifest["files"] == first[name]["files"], name
        assert (
            manifest["inputs"]["adapter/adapter_model.safetensors"]["mtime_ns"] == weights.stat().st_mtime_ns
        )
    assert not list(export.glob("*.tmp-*")), "no temp folder may stay behind"


def test_an_input_changed_during_the_conversion_is_exit_75_and_nothing_is_published(tmp_path: Path) -> None:
    source = tmp_path / "input.bin"
    source.write_bytes(b"version 1")

    def write_while_the_input_changes(staging: output.Staging) -> None:
        staging.folder.mkdir()
        staging.write_file("out.bin", source.read_bytes())
        source.write_bytes(b"version 2, longer")

    with pytest.raises(TemporaryError, match="input.bin changed while out was being made"):
        output.produce(tmp_path / "out", {"in": source}, {}, write_while_the_input_changes)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input.bin"]


@pytest.mark.parametrize(
    "read_after_removal", [False, True], ids=["removed-after-reading", "removed-before-reading"]
)
def test_an_input_removed_during_the_conversion_is_exit_75_and_nothing_is_published(
    tmp_path: Path, read_after_removal: bool
) -> None:
    # Another run's retention deletes the checkpoint being exported, or a finetune publishes its adapter
    # again (the old folder renamed away): the stat of the vanished input, or the write's own read of it,
    # was a FileNotFoundError traceback, exit 1, instead of the exit 75 of any other changed input.
    source = tmp_path / "input.bin"
    source.write_bytes(b"version 1")

    def write_while_the_input_is_removed(staging: output.Staging) -> None:
        staging.folder.mkdir()
        if not read_after_removal:
            staging.write_file("out.bin", source.read_bytes())
        source.unlink()
        staging.write_file("more.bin", source.read_bytes() if read_after_removal else b"")

    with pytest.raises(TemporaryError, match="input.bin was removed while out was being made"):
        output.produce(tmp_path / "out", {"in": source}, {}, write_while_the_input_is_removed)
    assert list(tmp_path.iterdir()) == []
