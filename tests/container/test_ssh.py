"""SSH into a running pod for debugging (trainpod.sshd): with PUBLIC_KEY set, a generated key logs in,
a password is refused, and `docker stop -t 5` still ends the workload with 143.

The containers run with `--network none`, so the SSH client runs inside the container (`docker
exec`) against 127.0.0.1:22, the port RunPod exposes.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import PRETRAIN_ENV, Pods, unique, wait_for

from engine import docker

pytestmark = pytest.mark.container
# A run long enough to be still training when the SSH checks are done, whatever the machine's load.
LONG_RUN = {
    **PRETRAIN_ENV,
    "TRAINPOD_SET": "train.max_steps=5000 checkpoint.every_steps=100 train.cpu_threads=1",
}

SSH = ["ssh", "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "BatchMode=yes",
       "-o", "ConnectTimeout=10", "-p", "22"]  # fmt: skip


def generated_key(image: str, folder: Path) -> str:
    """A fresh ed25519 key pair made by the image's ssh-keygen; returns the public key line."""
    folder.mkdir()
    docker("run", "--rm", "--network", "none", "-v", f"{folder}:/keys", "--entrypoint", "ssh-keygen", image,
           "-q", "-t", "ed25519", "-N", "", "-C", "test@laptop", "-f", "/keys/id")  # fmt: skip
    return (folder / "id.pub").read_text().strip()


def ssh(cid: str, *options: str) -> tuple[int, str]:
    res = docker("exec", cid, *SSH, *options, "root@127.0.0.1", "echo logged-in-as-$(id -un)", check=False)
    return res.returncode, res.stdout + res.stderr


def test_a_key_logs_in_a_password_is_refused_and_docker_stop_still_gives_143(
    pods: Pods, fresh_volume: Path, tmp_path: Path
) -> None:
    keys = tmp_path / "keys"
    public = generated_key(pods.image, keys)
    box = pods.start(fresh_volume, {**LONG_RUN, "PUBLIC_KEY": public}, pod=unique("ssh"))
    docker("cp", str(keys / "id"), f"{box.cid}:/tmp/id")  # the user's private key, on the client side
    wait_for(lambda: ssh(box.cid, "-i", "/tmp/id")[0] == 0 or not box.running(), 120, 0.5, "an SSH login")
    code, out = ssh(box.cid, "-i", "/tmp/id")
    assert code == 0 and "logged-in-as-root" in out, f"key login failed ({code}): {out}\n{box.logs()[-2000:]}"

    code, out = ssh(
        box.cid,
        "-o",
        "PubkeyAuthentication=no",
        "-o",
        "PreferredAuthentications=password,keyboard-interactive",
    )
    assert code == 255 and "Permission denied (publickey)" in out, (
        f"the server must offer public keys only, never passwords ({code}): {out}"
    )
    assert box.running(), f"the workload died while SSH was used:\n{box.logs()[-3000:]}"
    box.stop(5)
    assert box.wait(60) == 143, f"docker stop gave {box.exit_code()} with sshd running:\n{box.logs()[-3000:]}"
