"""trainpod.sshd: the SSH server boot starts for debugging, key-only, and only when PUBLIC_KEY is set.

sshd itself is not installed on this machine: logging in with a key, a refused password and exit 143
under `docker stop` are checked in the image (tests/container/test_ssh.py). Here: the settings it
runs with and that nothing starts without a key.
"""

from __future__ import annotations

import logging

from trainpod.sshd import public_keys, sshd_config, start_sshd

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGk0c2VjcmV0bm90cmVhbGx5YWtleWF0YWxsMTIz you@laptop"


def settings(text: str) -> dict[str, str]:
    return dict(line.split(" ", 1) for line in text.splitlines() if line)


def test_the_server_accepts_keys_only_and_root_only_by_key(tmp_path):
    conf = settings(sshd_config(tmp_path))
    assert conf["AuthenticationMethods"] == "publickey"
    assert conf["PasswordAuthentication"] == "no" and conf["KbdInteractiveAuthentication"] == "no"
    assert conf["PermitEmptyPasswords"] == "no" and conf["PermitRootLogin"] == "prohibit-password"
    assert conf["AuthorizedKeysFile"] == str(tmp_path / "authorized_keys"), "its own file, not ~/.ssh"
    assert conf["HostKey"].startswith(str(tmp_path)), "host keys are made per start, none from the image"
    assert conf["Port"] == "22", "RunPod exposes 22/tcp"


def test_without_public_key_no_server_starts_and_nothing_is_written(tmp_path):
    state = tmp_path / "sshd"
    assert start_sshd({}, state=state, sshd="/bin/true") is None
    assert not state.exists()


def test_a_public_key_without_any_key_line_starts_nothing_and_says_why(tmp_path, caplog):
    caplog.set_level(logging.WARNING, "trainpod")
    assert start_sshd({"PUBLIC_KEY": "not a key"}, state=tmp_path / "s", sshd="/bin/true") is None
    assert "PUBLIC_KEY holds no ssh public key line" in caplog.text


def test_several_keys_one_per_line_are_all_kept_and_junk_is_dropped():
    second = "ssh-rsa AAAAB3NzaC1yc2EAAAADAQABAAABAQ other@host"
    assert public_keys({"PUBLIC_KEY": f"{KEY}\n\n# comment\n{second}\n"}) == [KEY, second]
