"""Logging to stdout and the run's log file, with every secret's value masked on the way out.

Secrets (HF_TOKEN, WANDB_API_KEY, RUNPOD_API_KEY, git tokens, the S3 API key) must never reach a log
line, even when a library prints a URL with a token in it, so the mask sits on the handlers, not the
callers. A secret that comes from somewhere else than these variables (the S3 key from an AWS
profile file, say) is masked once `register_secret` has been told its value.
"""

from __future__ import annotations

import logging
import os
import re
import sys
import warnings
from pathlib import Path

SECRET_ENV_VARS = (
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
    "WANDB_API_KEY",
    "RUNPOD_API_KEY",
    "GIT_TOKEN",
    "TRAINPOD_GIT_TOKEN",
    "GITHUB_TOKEN",
    "AWS_ACCESS_KEY_ID",  # RunPod's S3 API key: the user_... id and its rps_... secret
    "AWS_SECRET_ACCESS_KEY",
)
# Any other variable named like a secret (a deploy config's `secrets:` may name any, OPENAI_API_KEY say):
# ..._TOKEN, ..._KEY, ..._SECRET, ..._PASSWORD, RunPod's RUNPOD_SECRET_...; not an ssh PUBLIC_KEY.
# One rule for the log filter, the command config and `trainpod deploy`'s check of env.extra: a last word
# TOKEN, KEY, SECRET or PASSWORD (not TOKENIZERS_PARALLELISM, which only starts like one).
_SECRET_NAME = re.compile(r"(^|_)(TOKEN|KEY|SECRET|PASSWORD)$|^RUNPOD_SECRET_", re.IGNORECASE)
_NOT_SECRET_NAME = re.compile(r"PUBLIC_KEY$", re.IGNORECASE)
# Credentials embedded in URLs (https://user:token@host/...), whatever variable they came from, and whatever
# the scheme: a program's database or cache (postgresql://user:password@host, redis://:password@host).
# Found from its "://" (a scheme's last character before it): a pattern that began with the scheme tried it at
# every letter of a long word and read on to the word's end each time, quadratic: a line holding a run of 100 kB
# without a space (a DNA sample, base64) took 25 s, with the GIL held (the lease's heartbeat waited), and the
# program that printed it blocked at its next write meanwhile.
_URL_CREDENTIALS = re.compile(r"(?<=[A-Za-z0-9+.-])(://)(?:[^/\s:@]+(?::[^/\s@]*)?|:[^/\s@]+)@")
_MIN_SECRET_LENGTH = 6  # shorter values would mask ordinary words
# Set by `trainpod deploy` in the pod's env: the deploy config's `secrets` whose names is_secret_name does not know.
SECRET_NAMES_ENV = "TRAINPOD_SECRET_NAMES"


_REGISTERED: set[str] = set()


def register_secret(value: str | None) -> None:
    """Mask `value` in every log line and redacted text from now on (this process)."""
    if value and len(value) >= _MIN_SECRET_LENGTH:
        _REGISTERED.add(value)


def is_secret_name(name: str) -> bool:
    """Whether a variable called `name` holds a secret (its value is masked, never written to the volume)."""
    return name in SECRET_ENV_VARS or (
        _SECRET_NAME.search(name) is not None and _NOT_SECRET_NAME.search(name) is None
    )


def secret_values(environ: dict[str, str] | None = None) -> list[str]:
    environ = os.environ if environ is None else environ
    names = {name for name in environ if is_secret_name(name)}
    # A deploy config's `secrets:` may list any variable (DB_CREDS): deploy names those unknown by name here.
    names |= {
        name.strip() for name in environ.get(SECRET_NAMES_ENV, "").split(",") if name.strip() in environ
    }
    # Each as set and as the libraries use it: huggingface_hub strips a pasted token's spaces and line end, and
    # what it (or a program) prints then is the bare token, which the value as set does not match.
    raw = {environ[name] for name in names if name in environ}
    values = {form for value in raw for form in (value, value.strip()) if len(form) >= _MIN_SECRET_LENGTH}
    return sorted(values | _REGISTERED, key=len, reverse=True)


def redact(text: str, secrets: list[str] | None = None) -> str:
    for value in secret_values() if secrets is None else secrets:
        text = text.replace(value, "***")
    return _URL_CREDENTIALS.sub(r"\1***@", text)


class RedactingFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        return redact(super().format(record))


_FORMAT = "%(asctime)s %(levelname)s [%(name)s] %(message)s"

# Library warnings a user can do nothing about, printed at every finetune, merge and generate: peft 0.21
# reads transformers 5's deprecated `is_gradient_checkpointing` when it wraps a model (a pair of versions
# the lock pins together). Matched by message, so any other FutureWarning still shows.
LIBRARY_NOISE = (r"`is_gradient_checkpointing` is deprecated",)


def setup_logging(log_file: Path | None = None, rank: int = 0) -> None:
    """Log INFO to stdout (rank 0 only; other ranks log warnings) and everything to `log_file`."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        handler.close()
    root.setLevel(logging.INFO)
    formatter = RedactingFormatter(_FORMAT, datefmt="%Y-%m-%d %H:%M:%S")
    stream = logging.StreamHandler(sys.stdout)
    stream.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    stream.setFormatter(formatter)
    root.addHandler(stream)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
        file_handler = logging.FileHandler(log_file, encoding="utf-8")
        file_handler.setFormatter(formatter)
        root.addHandler(file_handler)
    # httpx2: huggingface_hub 2.x's client, a line per request; an LFS part's is its presigned upload URL
    for noisy in ("urllib3", "filelock", "matplotlib", "PIL", "httpx", "httpx2"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    for message in LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=message, category=FutureWarning)


def attach_log_file(log_file: Path) -> None:
    """Also write every record to `log_file` (secrets masked), unless a handler writes there already:
    a crash before the run's log was set up still leaves its traceback on the volume."""
    root = logging.getLogger()
    target = str(log_file.resolve())
    if any(getattr(handler, "baseFilename", None) == target for handler in root.handlers):
        return
    log_file.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.FileHandler(log_file, encoding="utf-8")
    handler.setFormatter(RedactingFormatter(_FORMAT, datefmt="%Y-%m-%d %H:%M:%S"))
    root.addHandler(handler)
