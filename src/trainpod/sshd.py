"""SSH into a pod to debug it: `trainpod boot` starts openssh-server in the background when PUBLIC_KEY is set.

    PUBLIC_KEY="ssh-ed25519 AAAA... you@laptop" trainpod boot      # RunPod sets PUBLIC_KEY from your account

RunPod puts the public keys registered in the user's account into PUBLIC_KEY, exposes 22/tcp and
its "connect" button expects an SSH server there. The server here is key-only: no passwords, no
keyboard-interactive, root by key only; the keys go into a file of its own (not ~/.ssh), and the
host keys are made at each start (none are in the image: keys in a layer would be the same in every
pod and readable by anyone with the image). Without PUBLIC_KEY nothing listens. sshd runs as a
background child in boot's process group: the workload stays boot's own process and its signal
handling is unchanged (tini's SIGTERM reaches sshd too, which just exits). SSH is a debugging aid:
when sshd cannot start, boot logs one warning and runs the workload anyway.
"""

from __future__ import annotations

import logging
import os
import subprocess
import time
from pathlib import Path

log = logging.getLogger("trainpod.sshd")

SSHD = "/usr/sbin/sshd"
SSH_KEYGEN = "/usr/bin/ssh-keygen"
STATE_DIR = Path("/run/trainpod-sshd")
PRIVSEP_DIR = Path("/run/sshd")  # sshd refuses to start without its privilege-separation folder
KEY_TYPES = ("ssh-", "ecdsa-", "sk-ssh-", "sk-ecdsa-")
STARTUP_CHECK_S = 0.5  # sshd that dies on a bad config does so within milliseconds


def public_keys(environ: dict[str, str]) -> list[str]:
    """The key lines of PUBLIC_KEY (one or several, newline-separated); anything else is dropped."""
    lines = (line.strip() for line in (environ.get("PUBLIC_KEY") or "").splitlines())
    return [line for line in lines if line.startswith(KEY_TYPES)]


def sshd_config(state: Path, port: int = 22) -> str:
    """Key-only sshd settings; everything sshd needs lives in `state`."""
    return "\n".join(
        [
            f"Port {port}",
            f"HostKey {state / 'ssh_host_ed25519_key'}",
            f"AuthorizedKeysFile {state / 'authorized_keys'}",
            f"PidFile {state / 'sshd.pid'}",
            "AuthenticationMethods publickey",
            "PubkeyAuthentication yes",
            "PasswordAuthentication no",
            "KbdInteractiveAuthentication no",
            "PermitEmptyPasswords no",
            "PermitRootLogin prohibit-password",
            "UsePAM no",
            "StrictModes yes",
            "PrintMotd no",
            "Subsystem sftp internal-sftp",
            "",
        ]
    )


def start_sshd(
    environ: dict[str, str], state: Path = STATE_DIR, sshd: str = SSHD, port: int = 22
) -> subprocess.Popen | None:
    """Start sshd in the background when PUBLIC_KEY holds a key; None when it does not or cannot."""
    keys = public_keys(environ)
    if not keys:
        if environ.get("PUBLIC_KEY"):
            log.warning(
                "PUBLIC_KEY holds no ssh public key line (ssh-ed25519 ..., ssh-rsa ...): no SSH server"
            )
        return None
    if not Path(sshd).exists():
        log.warning("PUBLIC_KEY is set but this image has no %s: no SSH server", sshd)
        return None
    try:
        config = _prepare(state, keys, port)
        server = subprocess.Popen([sshd, "-D", "-e", "-f", str(config)], stdin=subprocess.DEVNULL)
        time.sleep(STARTUP_CHECK_S)
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("could not start the SSH server (%s); the workload runs without it", exc)
        return None
    if server.poll() is not None:
        log.warning("the SSH server exited at once (code %s, its log is above); the workload runs without it",
                    server.returncode)  # fmt: skip
        return None
    log.info("SSH server listening on port %d (key-only, %d key(s) from PUBLIC_KEY)", port, len(keys))
    return server


def _prepare(state: Path, keys: list[str], port: int) -> Path:
    """Host key, authorized keys and config in `state` (mode 700: sshd's StrictModes checks it)."""
    state.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(state, 0o700)
    PRIVSEP_DIR.mkdir(mode=0o755, parents=True, exist_ok=True)
    host_key = state / "ssh_host_ed25519_key"
    if not host_key.exists():
        subprocess.run([SSH_KEYGEN, "-q", "-t", "ed25519", "-N", "", "-f", str(host_key)], check=True)
    authorized = state / "authorized_keys"
    authorized.write_text("\n".join(keys) + "\n")
    os.chmod(authorized, 0o600)
    config = state / "sshd_config"
    config.write_text(sshd_config(state, port))
    return config
