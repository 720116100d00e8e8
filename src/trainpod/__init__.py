"""trainpod: train and finetune language models on rented GPUs, crash-safe and exactly resumable.

For your own training loop: `from trainpod import Checkpointer` (README, "Bring your own trainer").
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

# Imported on first use (PEP 562): `import trainpod` stays cheap for the CLI, which never needs torch.
_LAZY = {
    "Checkpointer": "trainpod.checkpointer",
    "Restored": "trainpod.checkpointer",
    "capture_rng": "trainpod.train.state",
    "restore_rng": "trainpod.train.state",
}
__all__ = ["Checkpointer", "Restored", "__version__", "capture_rng", "restore_rng"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module 'trainpod' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_LAZY[name]), name)
