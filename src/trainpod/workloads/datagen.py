"""`trainpod run datagen`: token shards, SFT samples, or a user's generator's records into datasets/<name>/.

    TRAINPOD_CONFIG=configs/datagen/tiny.yaml trainpod run datagen

The config says which with `kind:` (tokens, sft, generator). Each kind resumes from its own progress
on the volume (data/datagen.py, sft/prepare.py, data/generate.py), so a killed datagen run again
writes byte-identical output.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from trainpod.config.datagen import DatagenConfig
from trainpod.config.generate import GeneratorDatagenConfig
from trainpod.config.sft import SftDatagenConfig
from trainpod.context import RunContext
from trainpod.errors import ConfigError

log = logging.getLogger(__name__)

KINDS: dict[str, type] = {
    "tokens": DatagenConfig,
    "sft": SftDatagenConfig,
    "generator": GeneratorDatagenConfig,
}
# Configs written before `kind:` existed were told apart by one distinctive top-level key.
LEGACY_KEYS = {"sft": "sft", "generator": "generator"}


def config_type(tree: dict[str, Any]) -> type:
    kind = tree.get("kind")
    if kind is None:
        kind = next((k for key, k in LEGACY_KEYS.items() if key in tree), "tokens")
        log.warning(
            "this datagen config has no `kind:`; reading it as `kind: %s` by its keys. That guess is "
            "deprecated: add `kind: %s` at the top of the YAML",
            kind,
            kind,
        )
    if not isinstance(kind, str) or kind not in KINDS:  # `kind: [sft]` is a list: unhashable, not a kind
        raise ConfigError([f"kind = {kind!r} is not a datagen kind; set it to one of: {', '.join(KINDS)}"])
    return KINDS[kind]


def preflight(ctx: RunContext, config: Any) -> None:
    """Each kind checks its inputs as it starts, before it writes anything."""


def run(ctx: RunContext, config: Any) -> list[Path]:
    if isinstance(config, SftDatagenConfig):
        from trainpod.sft import run_sft_datagen

        return [run_sft_datagen(config, ctx.volume, ctx.watch)]
    if isinstance(config, GeneratorDatagenConfig):
        from trainpod.data.generate import run_generator

        return [run_generator(config, ctx.volume, ctx.watch)]
    from trainpod.data.datagen import run_datagen

    return [run_datagen(config, ctx.volume, ctx.watch)]


def disk_estimate(config: Any) -> int | None:
    return None  # the output's size depends on the corpus, which is streamed
