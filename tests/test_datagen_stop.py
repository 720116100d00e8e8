"""A stop while datagen trains its tokenizer, after the last training document is read: a real `trainpod run
datagen` process gets a real SIGTERM while the tokenizers library merges (one Rust call, tens of seconds on a
large corpus, in which the signal's Python handler never runs), and must exit 143 with the dataset's and the
tokenizer's leases released and nothing published; the next start makes the same dataset.

A spot pod gets SIGKILL 5 s after the SIGTERM: run on into it, the leases were held, and the next start on
another host waited out their TTL (90 s). The driver below stands in for the merges with a C call that never
returns.

.venv/bin/pytest -q tests/test_datagen_stop.py
"""

from __future__ import annotations

from pathlib import Path

from trainpod.errors import ExitCode

from support import TINY_DATAGEN, run_trainpod, sigterm_once_marked

DRIVER = """
import ctypes, os, runpy, sys
from pathlib import Path
import trainpod.data.tokenizer as tokenizer


def merges_in_one_endless_c_call(documents, settings):
    for _ in documents:  # every training document is read first, as the library does
        pass
    Path(os.environ["STOP_MARKER"]).touch()
    # The merges: a C call that releases the GIL and runs on through signals. A mutex locked twice never returns.
    libc = ctypes.CDLL(None)
    mutex = ctypes.create_string_buffer(64)
    libc.pthread_mutex_init(mutex, None)
    libc.pthread_mutex_lock(mutex)
    libc.pthread_mutex_lock(mutex)


tokenizer.train_bpe = merges_in_one_endless_c_call
sys.argv = ["trainpod", *sys.argv[1:]]
runpy.run_module("trainpod", run_name="__main__")
"""

DATAGEN = ("run", "datagen", "--config", str(TINY_DATAGEN))


def files_of(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_sigterm_while_the_tokenizer_merges_exits_143_with_both_leases_released(
    tmp_path: Path, tiny_dataset_volume: Path
) -> None:
    volume = tmp_path / "volume"
    volume.mkdir()
    code, out = sigterm_once_marked(DRIVER, DATAGEN, volume, tmp_path / "merging", {}, "tokenizer's merges")
    assert code == ExitCode.PREEMPTED, f"a stop while the tokenizer merges must exit 143:\n{out}"
    assert [p.name for p in volume.glob("*/.*LEASE")] == [], (
        f"the stopped datagen kept a lease: a new pod on another host would wait out its TTL:\n{out}"
    )
    assert not list((volume / "tokenizers").iterdir()), (
        f"a tokenizer whose training was stopped was published:\n{out}"
    )
    assert "Traceback" not in out, out

    resumed = run_trainpod(*DATAGEN, volume=volume)
    assert resumed.returncode == ExitCode.DONE, resumed.stdout + resumed.stderr
    for folder in ("tokenizers", "datasets"):
        made, uninterrupted = files_of(volume / folder), files_of(tiny_dataset_volume / folder)
        assert made.keys() == uninterrupted.keys(), folder
        differing = [
            name for name in made if made[name] != uninterrupted[name] and not name.endswith(".json")
        ]
        assert not differing, f"the next start made other {folder}: {differing}"
