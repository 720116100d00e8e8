"""The pod boot contract: env only, volume folders, git sync, preflight one-liners with exit 2."""

from __future__ import annotations

import base64
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainpod import boot as boot_module
from trainpod.errors import ConfigError, TemporaryError
from trainpod.gitsync import repo_name, sync

from support import TINY_DATAGEN, TINY_PRETRAIN, child_env, debian_binary

TOKEN = "ghp_supersecrettoken0123456789"


def boot_process(volume: Path, **env: str) -> subprocess.CompletedProcess:
    environ = child_env({"TRAINPOD_VOLUME": str(volume), **env})
    return subprocess.run(
        [sys.executable, "-m", "trainpod", "boot"], env=environ, capture_output=True, text=True, timeout=300
    )


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout


def boot_datagen_from_repo(volume: Path, repo: Path, config: str) -> subprocess.CompletedProcess:
    return boot_process(
        volume, TRAINPOD_WORKLOAD="datagen", TRAINPOD_CONFIG=config, TRAINPOD_GIT_REPO=f"file://{repo}"
    )


def commit_all(work: Path, message: str) -> str:
    """Commit everything in `work` (a repo made on `main` when there is none yet); returns the commit."""
    if not (work / ".git").is_dir():
        git("init", "-q", "-b", "main", cwd=work)
    git("add", ".", cwd=work)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", message, cwd=work)
    return git("rev-parse", "HEAD", cwd=work).strip()


@pytest.fixture
def config_repo(tmp_path: Path) -> Path:
    """A bare git repo holding a datagen config on `main` and a different one at tag v2."""
    work = tmp_path / "work"
    work.mkdir()
    git("init", "-q", "-b", "main", cwd=work)
    (work / "configs").mkdir()
    (work / "configs/data.yaml").write_text(
        TINY_DATAGEN.read_text().replace("name: tiny-stories", "name: from-git")
    )
    git("add", ".", cwd=work)
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one", cwd=work)
    (work / "configs/data.yaml").write_text(
        TINY_DATAGEN.read_text().replace("name: tiny-stories", "name: tagged")
    )
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two", cwd=work)
    git("tag", "v2", cwd=work)
    git("reset", "-q", "--hard", "HEAD~1", cwd=work)
    bare = tmp_path / "configs.git"
    git("clone", "-q", "--bare", str(work), str(bare), cwd=tmp_path)
    subprocess.run(
        ["git", "--git-dir", str(bare), "fetch", "-q", str(work), "refs/tags/v2:refs/tags/v2"], check=True
    )
    return bare


def test_missing_workload_exits_2_with_one_line(tmp_path):
    result = boot_process(tmp_path)
    assert result.returncode == 2
    assert "TRAINPOD_WORKLOAD is unset; set it to one of: datagen, pretrain" in result.stdout


def test_boot_creates_the_volume_layout_and_runs_the_workload_from_env_alone(tmp_path):
    result = boot_process(tmp_path, TRAINPOD_WORKLOAD="datagen", TRAINPOD_CONFIG=str(TINY_DATAGEN))
    assert result.returncode == 0, result.stdout + result.stderr
    assert {p.name for p in tmp_path.iterdir()} >= {"datasets", "tokenizers", "runs", "repos", "cache"}
    assert (tmp_path / "datasets/tiny-stories/manifest.json").is_file()


def test_config_from_the_synced_repo_at_a_ref_and_the_token_never_lands(tmp_path, config_repo):
    volume = tmp_path / "volume"
    volume.mkdir()
    env = {
        "TRAINPOD_WORKLOAD": "datagen",
        "TRAINPOD_CONFIG": "configs/data.yaml",
        "TRAINPOD_GIT_TOKEN": TOKEN,
        "TRAINPOD_GIT_REPO": f"file://{config_repo}",
        "TRAINPOD_GIT_REF": "v2",
    }
    result = boot_process(volume, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert (volume / "datasets/tagged/manifest.json").is_file(), (
        "the config at tag v2 names the dataset 'tagged'"
    )
    assert TOKEN not in result.stdout + result.stderr
    for path in volume.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path
    assert "url" not in (volume / "repos/configs@v2/.git/config").read_text(), "no remote URL is stored"


def test_pods_on_two_refs_of_one_repo_never_sync_into_the_checkout_the_other_runs_from(tmp_path, config_repo):
    """repos/ is shared by every pod on the volume: a pod on `main` booting while one on tag v2 ran checked
    main out into the v2 pod's checkout, under its running program (its next import, its shell script, its
    workdir), and two syncing at once could each check out the other's FETCH_HEAD. A checkout per ref."""
    repos = tmp_path / "repos"
    on_v2 = sync(f"file://{config_repo}", "v2", repos).path
    on_main = sync(f"file://{config_repo}", "main", repos).path
    assert "name: tagged" in (on_v2 / "configs/data.yaml").read_text(), "the v2 pod's code stayed v2's"
    assert "name: from-git" in (on_main / "configs/data.yaml").read_text()
    assert sorted(p.name for p in repos.iterdir()) == ["configs@main", "configs@v2"]
    feature = sync(f"file://{config_repo}", "refs/tags/v2", repos).path
    assert feature.parent == repos and feature.name == "configs@refs%2Ftags%2Fv2", (
        "a ref's / stays in the name"
    )
    assert sync(f"file://{config_repo}", None, repos).path == repos / "configs", (
        "the remote's HEAD: as before"
    )
    assert not list(repos.glob("*.tmp-*"))


def test_a_checkouts_folder_never_takes_its_name_from_the_urls_password():
    """A URL with credentials and no path named its checkout after `token@host`: a password on the volume."""
    from trainpod.gitsync import checkout_name

    assert checkout_name(f"https://me:{TOKEN}@example.com", "main") == "example.com@main"
    assert checkout_name(f"https://me:{TOKEN}@example.com/org/cfg.git", None) == "cfg"


def test_a_workload_reads_its_own_refs_checkout_never_the_same_repo_at_another_ref(tmp_path, config_repo):
    """The config search and the generators' import path look in other checkouts under repos/ too: the same
    repo at another ref holds the same paths at other commits, which must not stand in for this ref's."""
    from trainpod.gitsync import other_checkouts, own_checkout

    repos = tmp_path / "repos"
    for ref in ("v2", "main"):
        sync(f"file://{config_repo}", ref, repos)
    (repos / "another-repo").mkdir()
    environ = {"TRAINPOD_GIT_REPO": f"file://{config_repo}", "TRAINPOD_GIT_REF": "v2"}
    own = own_checkout(repos, environ)
    assert own == repos / "configs@v2"
    assert other_checkouts(repos, own) == [repos / "another-repo"]


def test_a_first_clones_temp_folder_is_no_checkout_for_the_config_search_or_the_import_path(
    tmp_path, config_repo
):
    """repos/configs.tmp-<id> (a clone running in another pod, or one a killed pod left) was listed among the
    other checkouts: the config search and a generator's python_path found files there, at another commit
    of TRAINPOD_GIT_REPO's own repo (or half checked out), that its checkout does not have."""
    from trainpod.gitsync import other_checkouts, own_checkout

    repos = tmp_path / "repos"
    sync(f"file://{config_repo}", None, repos)
    (repos / "configs.tmp-0badc10e/configs").mkdir(parents=True)
    (repos / "another-repo").mkdir()
    own = own_checkout(repos, {"TRAINPOD_GIT_REPO": f"file://{config_repo}"})
    assert own == repos / "configs"
    assert other_checkouts(repos, own) == [repos / "another-repo"]


def test_the_config_comes_from_the_repo_just_synced_not_another_runs_checkout(tmp_path, config_repo):
    """repos/ is shared by every run on the volume: another run's checkout, first in name order, holding
    a file at the same path must not be read instead of the one TRAINPOD_GIT_REPO names."""
    volume = tmp_path / "volume"
    other = volume / "repos/aaa-other-run/configs"
    other.mkdir(parents=True)
    (other / "data.yaml").write_text(TINY_DATAGEN.read_text().replace("name: tiny-stories", "name: not-mine"))
    result = boot_datagen_from_repo(volume, config_repo, "configs/data.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (volume / "datasets/from-git/manifest.json").is_file()
    assert not (volume / "datasets/not-mine").exists()


def test_a_folder_in_the_way_of_the_checkout_exits_2_and_stays_as_it_was(tmp_path, config_repo):
    volume = tmp_path / "volume"
    (volume / "repos/configs").mkdir(parents=True)
    (volume / "repos/configs/notes.txt").write_text("mine")
    result = boot_datagen_from_repo(volume, config_repo, "configs/data.yaml")
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "repos/configs is on the volume but is not a git checkout" in result.stdout
    assert [p.name for p in (volume / "repos").iterdir()] == ["configs"]
    assert [p.name for p in (volume / "repos/configs").iterdir()] == ["notes.txt"]


def test_locks_left_by_a_killed_git_do_not_block_every_later_sync(tmp_path, config_repo):
    """A pod SIGKILLed during `git fetch` (or git killed at its timeout) leaves shallow.lock/index.lock."""
    import time

    from trainpod import gitsync

    repos = tmp_path / "repos"
    checkout = sync(f"file://{config_repo}", "main", repos).path
    stale = time.time() - 3600
    for name in ("shallow.lock", "index.lock"):
        (checkout / ".git" / name).write_text("")
        os.utime(checkout / ".git" / name, (stale, stale))
    assert sync(f"file://{config_repo}", "main", repos, sleep=lambda _: None).path == checkout
    assert "name: from-git" in (checkout / "configs/data.yaml").read_text()
    assert not list((checkout / ".git").glob("*.lock"))
    # A young lock may be another pod's sync of the same checkout, running now: waited for until it is older
    # than any git of a sync runs, and only then removed.
    (checkout / ".git/shallow.lock").write_text("")
    all_but_done = time.time() - gitsync.GIT_TIMEOUT_S + 2
    os.utime(checkout / ".git/shallow.lock", (all_but_done, all_but_done))
    started = time.monotonic()
    assert sync(f"file://{config_repo}", "main", repos, sleep=lambda _: None).path == checkout
    assert time.monotonic() - started >= 1, "it waited for the lock's git"
    assert not list((checkout / ".git").glob("*.lock"))


def test_pods_syncing_one_checkout_at_once_wait_for_each_other_instead_of_exiting_75(tmp_path, config_repo):
    """An Instant Cluster's nodes all sync the run's checkout at each start: a fetch beside another node's failed
    on its shallow.lock, three times when that fetch outlasted the retries' waits (a large repo), and the node
    exited 75, a failed start of the whole cluster. A sync now waits for the lock of one running beside it."""
    repos = tmp_path / "repos"
    checkout = sync(f"file://{config_repo}", "main", repos).path
    other_nodes_fetch = checkout / ".git/shallow.lock"
    other_nodes_fetch.write_text("")
    threading.Timer(
        1.5, other_nodes_fetch.unlink
    ).start()  # it runs 1.5 s, longer than the retries' waits here
    assert sync(f"file://{config_repo}", "main", repos, sleep=lambda _: None).path == checkout
    assert "name: from-git" in (checkout / "configs/data.yaml").read_text()


def test_a_first_clone_killed_midway_leaves_no_temp_clone_once_the_next_start_syncs(tmp_path, config_repo):
    """A pod killed during its first clone (a spot interruption, the OOM killer) left repos/<name>.tmp-<id>, a
    whole clone's size, on the volume for good, listed beside the checkouts. The next sync removes such a
    folder once it is older than any first clone runs; a younger one may be another pod's clone, running now."""
    import time

    repos = tmp_path / "repos"
    killed = repos / "configs@main.tmp-0badc10e"
    running = repos / "configs@main.tmp-11ce0e0e"
    for folder in (killed, running):
        (folder / ".git/objects").mkdir(parents=True)
        (folder / ".git/objects/pack.tmp").write_bytes(b"half a pack")
    a_day_ago = time.time() - 86400
    os.utime(killed, (a_day_ago, a_day_ago))
    checkout = sync(f"file://{config_repo}", "main", repos).path
    assert "name: from-git" in (checkout / "configs/data.yaml").read_text()
    assert not killed.exists(), "the killed clone's leftovers are gone"
    assert running.exists(), "a clone that may still be running is left alone"


def test_two_pods_cloning_a_ref_at_once_both_start_on_the_checkout_the_first_renamed_into_place(
    tmp_path, config_repo, monkeypatch
):
    """Two pods of one ref starting together (a cluster's nodes, a run and its eval pod) each clone into a temp
    folder; the second's rename onto the first's checkout failed (OSError: directory not empty), a crash and
    exit 1 of that pod. It now takes the first one's checkout, at the commit it fetched itself."""
    from trainpod import gitsync

    repos = tmp_path / "repos"
    fetch_checkout = gitsync._fetch_checkout
    other_pod: list[gitsync.Synced] = []

    def the_other_pod_renames_first(url, ref, checkout, credentials):
        fetch_checkout(url, ref, checkout, credentials)
        if not other_pod and ".tmp-" in checkout.name:  # this pod's clone is done, its rename next
            monkeypatch.setattr(gitsync, "_fetch_checkout", fetch_checkout)
            other_pod.append(sync(f"file://{config_repo}", "v2", repos))

    monkeypatch.setattr(gitsync, "_fetch_checkout", the_other_pod_renames_first)
    synced = sync(f"file://{config_repo}", "v2", repos, sleep=lambda _: None)
    assert other_pod and synced == other_pod[0], "both run from repos/configs@v2 at the same commit"
    assert "name: tagged" in (synced.path / "configs/data.yaml").read_text()
    assert [p.name for p in repos.iterdir()] == ["configs@v2"], "the loser's temp clone is gone"


@pytest.fixture
def file_submodules_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    """git refuses file:// submodules unless told (protocol.file.allow, since 2.38.1); a pod's are https."""
    monkeypatch.setenv("GIT_CONFIG_COUNT", "1")
    monkeypatch.setenv("GIT_CONFIG_KEY_0", "protocol.file.allow")
    monkeypatch.setenv("GIT_CONFIG_VALUE_0", "always")


def test_a_repos_submodules_are_checked_out_at_the_commits_it_records_and_follow_it(
    tmp_path, file_submodules_allowed
):
    """A repo holding its model code in a submodule (../lib.git beside it, as GitHub users add one) was synced
    without it: an empty lib/ folder, and the program's first import from it failed in the pod."""
    lib = tmp_path / "lib-work"
    lib.mkdir()
    (lib / "helper.py").write_text("VALUE = 1\n")
    first = commit_all(lib, "one")
    git("clone", "-q", "--bare", str(lib), str(tmp_path / "lib.git"), cwd=tmp_path)
    (lib / "helper.py").write_text("VALUE = 2\n")
    second = commit_all(lib, "two")
    git("push", "-q", str(tmp_path / "lib.git"), "main", cwd=lib)
    trainer = tmp_path / "trainer-work"
    trainer.mkdir()
    (trainer / "train.py").write_text("from lib.helper import VALUE\n")
    commit_all(trainer, "trainer")
    git("submodule", "add", "-q", "../lib.git", "lib", cwd=trainer)  # relative: beside the trainer's repo
    git("-C", "lib", "checkout", "-q", first, cwd=trainer)
    commit_all(trainer, "lib at its first commit")
    git("clone", "-q", "--bare", str(trainer), str(tmp_path / "trainer.git"), cwd=tmp_path)

    repos = tmp_path / "volume/repos"
    checkout = sync(f"file://{tmp_path}/trainer.git", "main", repos).path
    assert (checkout / "lib/helper.py").read_text() == "VALUE = 1\n", (
        "the commit the repo records, not lib's newest"
    )
    git("-C", "lib", "checkout", "-q", second, cwd=trainer)
    commit_all(trainer, "lib at its second commit")
    git("push", "-q", str(tmp_path / "trainer.git"), "main", cwd=trainer)
    assert sync(f"file://{tmp_path}/trainer.git", "main", repos).path == checkout
    assert (checkout / "lib/helper.py").read_text() == "VALUE = 2\n", (
        "a later start follows the repo's update"
    )


@pytest.mark.parametrize("protocol", ["2", "0"])
def test_a_repos_submodules_are_fetched_shallow_at_the_commit_it_pins_not_their_whole_history(
    tmp_path, monkeypatch, file_submodules_allowed, protocol
):
    """The repo itself is fetched with --depth 1, but its submodules were cloned whole: a vendored library or
    model repo with years of history (gigabytes of old blobs) downloaded at each first clone and kept on the
    volume. They are shallow now, at the commit the repo pins, though it is no branch's tip; a server that
    hands out no commit by its id (protocol 0 without uploadpack.allowReachableSHA1InWant) is fetched whole."""
    monkeypatch.setenv("GIT_CONFIG_COUNT", "2")
    monkeypatch.setenv("GIT_CONFIG_KEY_1", "protocol.version")
    monkeypatch.setenv("GIT_CONFIG_VALUE_1", protocol)
    lib = tmp_path / "lib-work"
    lib.mkdir()
    commits = []
    for value in range(5):
        (lib / "helper.py").write_text(f"VALUE = {value}\n")
        commits.append(commit_all(lib, f"value {value}"))
    git("clone", "-q", "--bare", str(lib), str(tmp_path / "lib.git"), cwd=tmp_path)
    trainer = tmp_path / "trainer-work"
    trainer.mkdir()
    (trainer / "train.py").write_text("from lib.helper import VALUE\n")
    commit_all(trainer, "trainer")
    git("submodule", "add", "-q", "../lib.git", "lib", cwd=trainer)
    git("-C", "lib", "checkout", "-q", commits[3], cwd=trainer)  # pinned behind lib's tip
    commit_all(trainer, "lib at its fourth commit")
    git("clone", "-q", "--bare", str(trainer), str(tmp_path / "trainer.git"), cwd=tmp_path)

    checkout = sync(f"file://{tmp_path}/trainer.git", "main", tmp_path / "repos", sleep=lambda _: None).path
    assert (checkout / "lib/helper.py").read_text() == "VALUE = 3\n", "the commit the repo pins"
    history = git("-C", "lib", "rev-list", "--count", "HEAD", cwd=checkout).strip()
    if protocol == "2":
        assert git("-C", "lib", "rev-parse", "--is-shallow-repository", cwd=checkout).strip() == "true"
        assert history == "1", f"the submodule's history was fetched: {history} commits"
    else:
        assert history == "4", "a server refusing a commit by its id: the submodule fetched whole"


LFS_POINTER = """version https://git-lfs.github.com/spec/v1
oid sha256:5b6d432e398ffe3c43d8ad7a00d917b480a176557020059e6ca47569f11127de
size 100
"""


def test_a_repo_with_lfs_files_in_an_image_without_git_lfs_exits_2_never_running_on_pointers(
    tmp_path, monkeypatch
):
    """Without git-lfs a checkout holds each LFS file's pointer (three lines of text): the program read its
    weights or data as that, and failed on it or, worse, trained on it. Exit 2 naming git-lfs instead."""
    work = tmp_path / "work"
    work.mkdir()
    (work / ".gitattributes").write_text("# weights\n*.bin filter=lfs diff=lfs merge=lfs -text\n")
    (work / "weights.bin").write_text(LFS_POINTER)  # what git holds of an LFS file
    commit_all(work, "weights in LFS")
    git("clone", "-q", "--bare", str(work), str(tmp_path / "trainer.git"), cwd=tmp_path)
    no_git_lfs = tmp_path / "bin"
    no_git_lfs.mkdir()
    (no_git_lfs / "git").symlink_to(shutil.which("git"))
    monkeypatch.setenv("PATH", str(no_git_lfs))
    sleeps: list[float] = []
    with pytest.raises(ConfigError, match="stores files with Git LFS .* this image has no git-lfs"):
        sync(f"file://{tmp_path}/trainer.git", "main", tmp_path / "repos", sleep=sleeps.append)
    assert sleeps == [], "not retried"
    assert list((tmp_path / "repos").iterdir()) == [], (
        "no checkout of pointers is left for a program to run on"
    )


def test_a_repos_lfs_files_are_fetched_with_it(tmp_path, monkeypatch):
    # The image has git-lfs (docker/system_packages.sh); a test machine without it takes Debian's.
    git_lfs = debian_binary("git-lfs", "git-lfs")
    monkeypatch.setenv("PATH", f"{git_lfs.parent}{os.pathsep}{os.environ['PATH']}")
    weights = os.urandom(4096)
    lfs_repo(tmp_path, weights)
    work = tmp_path / "trainer-work"
    checkout = sync(f"file://{tmp_path}/trainer.git", "main", tmp_path / "repos").path
    assert (checkout / "weights.bin").read_bytes() == weights, "the file, not its pointer"
    (work / "weights.bin").write_bytes(weights[::-1])
    commit_all(work, "new weights")
    git("push", "-q", f"file://{tmp_path}/trainer.git", "main", cwd=work)
    assert sync(f"file://{tmp_path}/trainer.git", "main", tmp_path / "repos").path == checkout
    assert (checkout / "weights.bin").read_bytes() == weights[::-1], "a later start fetches the new file"


def lfs_repo(tmp_path: Path, weights: bytes, name: str = "trainer") -> str:
    """A bare repo <name>.git (its URL) with `weights.bin` stored by Git LFS, made from <name>-work; git-lfs must be
    on PATH."""
    work = tmp_path / f"{name}-work"
    work.mkdir()
    git("init", "-q", "-b", "main", cwd=work)
    git("lfs", "install", "--local", cwd=work)
    (work / ".gitattributes").write_text("*.bin filter=lfs diff=lfs merge=lfs -text\n")
    (work / "weights.bin").write_bytes(weights)
    commit_all(work, "weights in LFS")
    git("init", "-q", "--bare", "-b", "main", str(tmp_path / f"{name}.git"), cwd=tmp_path)
    git("push", "-q", f"file://{tmp_path}/{name}.git", "main", cwd=work)  # LFS objects go with it
    return f"file://{tmp_path}/{name}.git"


def test_lfs_files_of_a_submodule_are_fetched_with_it(tmp_path, monkeypatch, file_submodules_allowed):
    """A repo whose weights or data live in a submodule stored with Git LFS (a vendored model repo, a data repo) was
    synced with that submodule's LFS pointers in place of its files, three lines of text the program read as them:
    only the top repo's LFS files were pulled."""
    git_lfs = debian_binary("git-lfs", "git-lfs")
    monkeypatch.setenv("PATH", f"{git_lfs.parent}{os.pathsep}{os.environ['PATH']}")
    weights = os.urandom(4096)
    lfs_repo(tmp_path, weights, name="model")
    trainer = tmp_path / "trainer-work"
    trainer.mkdir()
    (trainer / "train.py").write_text("open('model/weights.bin', 'rb').read()\n")
    commit_all(trainer, "trainer")
    git("submodule", "add", "-q", "../model.git", "model", cwd=trainer)
    commit_all(trainer, "the model's weights in a submodule")
    git("clone", "-q", "--bare", str(trainer), str(tmp_path / "trainer.git"), cwd=tmp_path)
    checkout = sync(f"file://{tmp_path}/trainer.git", "main", tmp_path / "repos", sleep=lambda _: None).path
    assert (checkout / "model/weights.bin").read_bytes() == weights, (
        "the submodule's file, not its LFS pointer"
    )
    assert git("status", "--porcelain", "--ignore-submodules=none", cwd=checkout) == "", (
        "the checkout is clean"
    )


def test_an_lfs_pull_outlasting_the_git_bound_has_its_own_which_a_timeout_names_with_its_variable(
    tmp_path, monkeypatch
):
    """The LFS pull downloads every LFS file whole (weights: gigabytes) under the 600 s bound of the shallow
    fetch: on a slow link it timed out at every attempt and every start (exit 75), saying 'git lfs did not
    finish'. It has its own bound now, TRAINPOD_GIT_LFS_TIMEOUT_S, which the timeout names."""
    from trainpod import gitsync

    real = debian_binary("git-lfs", "git-lfs")
    slow_link = tmp_path / "bin"
    slow_link.mkdir()
    (slow_link / "git-lfs").write_text(  # its pull takes 3 s, as gigabytes over a slow link do
        f'#!/bin/sh\n[ "$1" = pull ] && sleep 3\nexec {real} "$@"\n'
    )
    (slow_link / "git-lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{real.parent}{os.pathsep}{os.environ['PATH']}")
    weights = os.urandom(4096)
    url = lfs_repo(tmp_path, weights)
    monkeypatch.setenv("PATH", f"{slow_link}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(gitsync, "GIT_TIMEOUT_S", 2.0)  # every other git command: a small repo's, quick
    checkout = sync(url, "main", tmp_path / "repos", sleep=lambda _: None).path
    assert (checkout / "weights.bin").read_bytes() == weights, (
        "the LFS pull ran past GIT_TIMEOUT_S to its end"
    )

    monkeypatch.setenv("TRAINPOD_GIT_LFS_TIMEOUT_S", "1")
    with pytest.raises(TemporaryError) as timed_out:
        sync(url, "main", tmp_path / "repos", sleep=lambda _: None)
    assert "git lfs pull did not finish in 1 s" in str(timed_out.value), str(timed_out.value)
    assert "raise TRAINPOD_GIT_LFS_TIMEOUT_S" in str(timed_out.value)
    monkeypatch.setenv("TRAINPOD_GIT_LFS_TIMEOUT_S", "an hour")
    with pytest.raises(ConfigError, match="TRAINPOD_GIT_LFS_TIMEOUT_S='an hour' is not a number of seconds"):
        sync(url, "main", tmp_path / "repos", sleep=lambda _: None)


def test_a_clusters_nodes_syncing_a_new_commit_together_all_start_none_exits_75(tmp_path):
    """Four nodes booting at once each saw no lock, then fetched beside the others: all but one failed on
    shallow.lock, again at each retry, and some ran out of attempts (exit 75, the cluster's start failed)."""
    work = tmp_path / "work"
    work.mkdir()
    for name in range(20):
        (work / f"{name}.bin").write_bytes(
            os.urandom(100_000)
        )  # a fetch long enough for the others to collide
    commit_all(work, "one")
    git("clone", "-q", "--bare", str(work), str(tmp_path / "trainer.git"), cwd=tmp_path)
    repos = tmp_path / "repos"
    checkout = sync(f"file://{tmp_path}/trainer.git", "main", repos).path
    for name in range(20):
        (work / f"{name}.bin").write_bytes(os.urandom(100_000))
    pushed = commit_all(work, "two")
    git("push", "-q", str(tmp_path / "trainer.git"), "main", cwd=work)
    synced: list[object] = []

    def node() -> None:
        try:
            synced.append(sync(f"file://{tmp_path}/trainer.git", "main", repos, sleep=lambda _: None).commit)
        except TemporaryError as exc:
            synced.append(exc)

    nodes = [threading.Thread(target=node) for _ in range(4)]
    for thread in nodes:
        thread.start()
    for thread in nodes:
        thread.join()
    assert synced == [pushed] * 4, synced
    assert git("rev-parse", "HEAD", cwd=checkout).strip() == pushed


def test_failing_sync_is_retried_then_exits_75(tmp_path):
    result = boot_process(
        tmp_path,
        TRAINPOD_WORKLOAD="datagen",
        TRAINPOD_CONFIG=str(TINY_DATAGEN),
        TRAINPOD_GIT_REPO=f"file://{tmp_path}/missing.git",
        TRAINPOD_GIT_TOKEN=TOKEN,
    )
    assert result.returncode == 75, result.stdout + result.stderr
    assert result.stdout.count("git sync attempt") == 3 and "after 3 attempts (fatal:" in result.stdout
    assert TOKEN not in result.stdout + result.stderr
    assert not (tmp_path / "datasets/tiny-stories").exists()


@pytest.mark.parametrize(
    "ref", ["no-such-branch", "0123456789abcdef0123456789abcdef01234567", "--upload-pack=x"]
)
def test_a_ref_the_repo_does_not_have_exits_2_at_once_naming_it(tmp_path, config_repo, ref):
    volume = tmp_path / "volume"
    volume.mkdir()
    result = boot_process(
        volume,
        TRAINPOD_WORKLOAD="datagen",
        TRAINPOD_CONFIG="configs/data.yaml",
        TRAINPOD_GIT_REPO=f"file://{config_repo}",
        TRAINPOD_GIT_REF=ref,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"TRAINPOD_GIT_REF={ref}" in result.stdout or f"TRAINPOD_GIT_REF={ref!r}" in result.stdout
    assert "git sync attempt 2/3" not in result.stdout, "a missing ref is not retried"
    assert "Traceback" not in result.stdout + result.stderr
    assert not (volume / "repos/configs").exists()


def test_a_commit_given_by_its_abbreviated_id_exits_2_asking_for_its_full_id(tmp_path, config_repo):
    """A pinned commit pasted as GitHub shows it (7 characters) was 'not in the repo ... (pushed)', though it is:
    git fetches a commit by its full id alone."""
    full = git("rev-parse", "main", cwd=config_repo).strip()
    with pytest.raises(ConfigError) as refused:
        sync(f"file://{config_repo}", full[:7], tmp_path / "repos", sleep=lambda _: None)
    assert "full 40-character id" in str(refused.value) and f"git rev-parse {full[:7]}" in str(refused.value)
    assert "pushed" not in str(refused.value)
    assert sync(f"file://{config_repo}", full, tmp_path / "repos").commit == full, "the full id is fetched"


def test_a_git_that_hangs_is_a_failed_attempt_then_exit_75_not_a_crash(tmp_path, monkeypatch):
    """A host that accepts the connection and never answers: git runs into its timeout."""
    import socket

    from trainpod import gitsync

    silent = socket.create_server(("127.0.0.1", 0))  # accepts (the backlog), never answers
    monkeypatch.setattr(gitsync, "GIT_TIMEOUT_S", 1.0)
    try:
        with pytest.raises(TemporaryError, match=r"after 3 attempts \(git fetch did not finish in 1 s\)"):
            sync(f"http://127.0.0.1:{silent.getsockname()[1]}/org/cfg.git", "main", tmp_path / "repos",
                 sleep=lambda _: None)  # fmt: skip
    finally:
        silent.close()
    assert list((tmp_path / "repos").iterdir()) == []


def test_a_git_step_past_its_bound_is_ended_with_the_programs_it_started(tmp_path, monkeypatch):
    """The timeout killed git alone: `git lfs pull` runs git-lfs (as a fetch runs git-remote-https) as its child,
    which went on downloading beside the next attempt's pull into the same checkout, or into the temp folder the
    sync had removed, each attempt adding one more to the slow link. The whole step ends at its bound now."""
    real = debian_binary("git-lfs", "git-lfs")
    monkeypatch.setenv("PATH", f"{real.parent}{os.pathsep}{os.environ['PATH']}")
    url = lfs_repo(tmp_path, os.urandom(4096))
    still_running = tmp_path / "still-running"
    slow_link = tmp_path / "bin"
    slow_link.mkdir()
    (slow_link / "git-lfs").write_text(
        f'#!/bin/sh\nif [ "$1" = pull ]; then sleep 2; touch {still_running}; fi\nexec {real} "$@"\n'
    )
    (slow_link / "git-lfs").chmod(0o755)
    monkeypatch.setenv("PATH", f"{slow_link}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("TRAINPOD_GIT_LFS_TIMEOUT_S", "0.5")
    with pytest.raises(TemporaryError, match="git lfs pull did not finish in 0.5 s"):
        sync(url, "main", tmp_path / "repos", sleep=lambda _: None)
    time.sleep(3)  # past the slow pull's 2 s
    assert not still_running.exists(), "git-lfs went on after its git was killed"


def test_repo_name_comes_from_the_url():
    assert repo_name("https://github.com/org/my-configs.git") == "my-configs"
    assert repo_name("git@github.com:org/cfg") == "cfg"


def test_pod_with_gpus_on_a_host_without_a_usable_gpu_exits_4_with_one_line(tmp_path):
    """This machine has no GPU and no NVIDIA driver: exactly what a broken GPU host looks like."""
    result = boot_process(
        tmp_path,
        TRAINPOD_WORKLOAD="pretrain",
        TRAINPOD_CONFIG="configs/pretrain/tiny.yaml",
        TRAINPOD_IMAGE_CUDA="12.8",
        RUNPOD_GPU_COUNT="1",
    )
    assert result.returncode == 4, result.stdout + result.stderr
    (line,) = [line for line in result.stdout.splitlines() if "ERROR" in line]
    assert "no NVIDIA driver" in line and "CUDA 12.8" in line and "replace the pod" in line, line
    assert "Traceback" not in result.stdout + result.stderr


def test_your_own_trainer_on_a_gpu_pod_without_a_usable_gpu_exits_4(tmp_path):
    """Your own trainer on a broken GPU host: replace the pod (exit 4), not three failed starts of it."""
    config = tmp_path / "command.yaml"
    config.write_text("name: gpu-prog\ncommand: [python, -c, \"print('my GPU program ran')\"]\n")
    result = boot_process(
        tmp_path,
        TRAINPOD_WORKLOAD="command",
        TRAINPOD_CONFIG=str(config),
        TRAINPOD_IMAGE_CUDA="12.8",
        RUNPOD_GPU_COUNT="1",
    )
    assert result.returncode == 4, result.stdout + result.stderr
    assert "my GPU program ran" not in result.stdout
    assert "no NVIDIA driver" in result.stdout and "replace the pod" in result.stdout


def test_not_enough_free_space_for_the_checkpoints_exits_5(tmp_path, monkeypatch, capsys):
    # A volume this small cannot be made here without a mount; the measurement itself is faked.
    monkeypatch.setattr(boot_module.shutil, "disk_usage", lambda _: type("U", (), {"free": 2**30})())
    environ = {
        "TRAINPOD_VOLUME": str(tmp_path),
        "TRAINPOD_WORKLOAD": "pretrain",
        "TRAINPOD_CONFIG": str(Path(__file__).parents[1] / "configs/pretrain/1b.yaml"),
    }
    assert boot_module.boot(environ) == 5
    out = capsys.readouterr().out
    assert "has 1.0 GiB free; this run needs about" in out and "grow the network volume" in out


@pytest.mark.parametrize(
    "config", ["missing.yaml", "configs/pretrain/tiny.yaml"], ids=["missing", "bad-override"]
)
def test_bad_input_at_boot_exits_2_and_writes_nothing(tmp_path, config):
    result = boot_process(
        tmp_path, TRAINPOD_WORKLOAD="pretrain", TRAINPOD_CONFIG=config, TRAINPOD_SET="train.max_steps=none"
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert list(tmp_path.iterdir()) == [], "preflight failures must leave the volume as it was"


def test_a_missing_field_at_boot_names_trainpod_set_the_pods_way_to_override_it(tmp_path):
    """On the pod, boot's config check said "pass --set train=VALUE": a pod has no command line to pass it on;
    the pod's environment's TRAINPOD_SET (a deploy's env.set) is the way."""
    config = tmp_path / "pretrain.yaml"
    config.write_text("name: x\ndata: {dataset: d}\n")
    volume = tmp_path / "volume"
    volume.mkdir()
    result = boot_process(volume, TRAINPOD_WORKLOAD="pretrain", TRAINPOD_CONFIG=str(config))
    assert result.returncode == 2, result.stdout + result.stderr
    assert (
        "train: required but missing; add it to the YAML or add train=VALUE to TRAINPOD_SET" in result.stdout
    )
    assert "--set" not in result.stdout + result.stderr, (
        "a pod has no --set flag: the fix must name TRAINPOD_SET"
    )


def test_trainpod_set_with_an_unbalanced_quote_exits_2_at_boot_not_a_crash(tmp_path):
    # Exit 1 before the run is known is never counted: RunPod would restart the pod without end.
    result = boot_process(
        tmp_path, TRAINPOD_WORKLOAD="pretrain", TRAINPOD_CONFIG="configs/pretrain/tiny.yaml",
        TRAINPOD_SET="train.lr='1e-4",
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    assert "TRAINPOD_SET=" in result.stdout and "no closing quotation" in result.stdout
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("run", ["..", "../datasets/tiny-stories", "/tmp/elsewhere", "a/b"])
def test_a_run_name_that_leaves_runs_exits_2_and_marks_nothing(tmp_path, capsys, run):
    (tmp_path / "runs").mkdir()
    environ = {
        "TRAINPOD_VOLUME": str(tmp_path),
        "TRAINPOD_WORKLOAD": "pretrain",
        "TRAINPOD_CONFIG": str(Path(__file__).parents[1] / "configs/pretrain/tiny.yaml"),
        "TRAINPOD_RUN": run,
    }
    assert boot_module.boot(environ) == 2
    out = capsys.readouterr().out
    assert f"TRAINPOD_RUN={run!r} (or --run) is not a run name" in out, out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"], (
        "no FAILED, config.yaml or LEASE outside runs/"
    )
    assert list((tmp_path / "runs").iterdir()) == []


def test_trainpod_run_with_a_run_name_that_leaves_runs_exits_2(tmp_path, capsys):
    from trainpod.volume import Volume
    from trainpod.workloads.lifecycle import RunRequest, execute

    config = str(Path(__file__).parents[1] / "configs/pretrain/tiny.yaml")
    request = RunRequest("pretrain", config, run_name="..", volume=Volume(tmp_path))
    assert execute(request) == 2
    assert "TRAINPOD_RUN='..' (or --run) is not a run name" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []


def test_a_missing_dataset_in_a_pod_exits_2_and_leaves_no_run_folder_nor_failed(tmp_path):
    """In a pod (RUNPOD_POD_ID) boot marks the start before the workload's preflight: a refusal there is
    bad input like any other, and a run that never started has no FAILED to delete by hand."""
    result = boot_process(
        tmp_path,
        TRAINPOD_WORKLOAD="pretrain",
        TRAINPOD_CONFIG="configs/pretrain/tiny.yaml",
        RUNPOD_POD_ID="pod-without-a-key",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "dataset 'tiny-stories' not found" in result.stdout
    assert list((tmp_path / "runs").iterdir()) == []


def test_unknown_on_finish_action_exits_2(tmp_path):
    result = boot_process(
        tmp_path,
        TRAINPOD_WORKLOAD="datagen",
        TRAINPOD_CONFIG=str(TINY_DATAGEN),
        TRAINPOD_ON_FINISH="shutdown",
    )
    assert result.returncode == 2
    assert "TRAINPOD_ON_FINISH='shutdown'; set it to one of: stop, terminate, idle" in result.stdout


def test_an_unknown_on_finish_action_exits_2_before_the_git_sync(tmp_path):
    """The check ran after the sync: a repo out of reach took three tries (minutes against an outage) and ended
    as a counted exit 75, the typo unreported."""
    result = boot_process(
        tmp_path,
        TRAINPOD_WORKLOAD="datagen",
        TRAINPOD_CONFIG=str(TINY_DATAGEN),
        TRAINPOD_GIT_REPO=f"file://{tmp_path}/missing.git",
        TRAINPOD_ON_FINISH="shutdown",
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert "TRAINPOD_ON_FINISH='shutdown'; set it to one of: stop, terminate, idle" in result.stdout
    assert "git sync attempt" not in result.stdout, "refused before any slow work"


def test_malformed_price_exits_2_at_boot_not_hours_into_the_run(tmp_path):
    result = boot_process(
        tmp_path,
        TRAINPOD_WORKLOAD="datagen",
        TRAINPOD_CONFIG=str(TINY_DATAGEN),
        TRAINPOD_GPU_HOURLY_USD="$2.49",
    )
    assert result.returncode == 2
    assert (
        "TRAINPOD_GPU_HOURLY_USD='$2.49' is not an amount in USD; set it like TRAINPOD_GPU_HOURLY_USD=2.49"
        in result.stdout
    )
    assert list(tmp_path.iterdir()) == []


def test_a_budget_without_a_price_exits_2_at_boot_instead_of_never_capping_the_run(tmp_path):
    """The pod counts its cost as hours x TRAINPOD_GPU_HOURLY_USD: without a price, a budget would never be spent."""
    result = boot_process(
        tmp_path,
        TRAINPOD_WORKLOAD="pretrain",
        TRAINPOD_CONFIG=str(TINY_PRETRAIN),
        TRAINPOD_BUDGET_USD="50",
    )
    assert result.returncode == 2
    assert "TRAINPOD_BUDGET_USD='50' is set but TRAINPOD_GPU_HOURLY_USD is not" in result.stdout
    assert list(tmp_path.iterdir()) == []


def test_a_workload_that_counts_no_cost_runs_beside_a_budget_without_a_price(tmp_path):
    """Datagen and convert have no budget to keep: a TRAINPOD_BUDGET_USD left in the shell or a template is no error."""
    result = boot_process(
        tmp_path, TRAINPOD_WORKLOAD="datagen", TRAINPOD_CONFIG=str(TINY_DATAGEN), TRAINPOD_BUDGET_USD="50"
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_pretrain_config_too_big_for_the_gpu_exits_2_at_boot_naming_the_knobs(tmp_path, monkeypatch, capsys):
    # No GPU here: the GPU's size is the one thing faked (a 24 GB card), the estimate is real.
    from trainpod.train import memory

    monkeypatch.setattr(memory, "visible_gpu_bytes", lambda: 24 * 2**30)
    environ = {
        "TRAINPOD_VOLUME": str(tmp_path),
        "TRAINPOD_WORKLOAD": "pretrain",
        "TRAINPOD_CONFIG": str(Path(__file__).parents[1] / "configs/pretrain/2b.yaml"),
    }
    assert boot_module.boot(environ) == 2
    out = capsys.readouterr().out
    assert "more than this GPU's 24.0 GiB" in out and "train.micro_batch_size" in out
    assert "Traceback" not in out
    assert not (tmp_path / "runs").exists(), "a refused config must leave the volume as it was"


def _command_run_on_a_git_branch(tmp_path: Path) -> tuple[Path, Path, str, dict[str, str]]:
    """A repo (work/) whose branch main holds a command config, its first commit, an empty volume and the env
    of a pod that runs it: (work, volume, first commit, env)."""
    work, volume = tmp_path / "work", tmp_path / "volume"
    (work / "configs").mkdir(parents=True)
    volume.mkdir()
    (work / "configs/cmd.yaml").write_text("name: code-run\ncommand: [python, -c, 'print(1)']\n")
    first = commit_all(work, "one")
    env = {
        "TRAINPOD_WORKLOAD": "command",
        "TRAINPOD_CONFIG": "configs/cmd.yaml",
        "TRAINPOD_GIT_REPO": f"file://{work}",
        "TRAINPOD_GIT_REF": "main",
        "RUNPOD_POD_ID": "pod-1",  # a pod: its boot makes the run folder before the workload
    }
    return work, volume, first, env


def test_a_resume_on_another_commit_of_the_branch_says_so_and_records_it(tmp_path):
    """Every start syncs the ref's newest commit: a push between two spot starts changes the code that
    continues the checkpoints. runs/<run>/code.json holds the commit, and a change is logged."""
    work, volume, first, env = _command_run_on_a_git_branch(tmp_path)
    result = boot_process(volume, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    run = volume / "runs/code-run"
    assert json.loads((run / "code.json").read_text())["commit"] == first
    (work / "train.py").write_text("# a fix pushed while the pod was stopped\n")
    second = commit_all(work, "two")
    (run / "DONE").unlink()  # as if the spot pod had been stopped before the end

    result = boot_process(volume, **env)

    assert result.returncode == 0, result.stdout + result.stderr
    assert f"TRAINPOD_GIT_REF=main is now at {second[:12]}, was at {first[:12]}" in result.stdout
    assert json.loads((run / "code.json").read_text())["commit"] == second


def test_a_done_runs_code_json_keeps_the_commit_that_finished_it_when_its_pod_boots_again(tmp_path):
    """A finished run's pod started again (by hand, to reach the volume) after a push: code.json was rewritten to
    the new commit, which never ran a step of the run, with a warning that the run continued on it."""
    work, volume, first, env = _command_run_on_a_git_branch(tmp_path)
    assert boot_process(volume, **env).returncode == 0
    (work / "train.py").write_text("# pushed after the run finished\n")
    commit_all(work, "two")

    result = boot_process(volume, **env)

    assert result.returncode == 0 and "already DONE" in result.stdout, result.stdout + result.stderr
    assert json.loads((volume / "runs/code-run/code.json").read_text())["commit"] == first
    assert "the code changed since the run's previous start" not in result.stdout


def test_code_json_records_the_commit_the_sync_checked_out_asking_git_once(tmp_path):
    """boot asked git for HEAD twice, after the sync and again for code.json: a second git on the network
    volume, and a read of whatever the shared checkout held by then rather than of what this start synced."""
    work, volume, shim = tmp_path / "work", tmp_path / "volume", tmp_path / "bin"
    (work / "configs").mkdir(parents=True)
    volume.mkdir()
    shim.mkdir()
    (work / "configs/cmd.yaml").write_text("name: code-run\ncommand: [python, -c, 'print(1)']\n")
    commit = commit_all(work, "one")
    argv_log = tmp_path / "git-argv.log"
    (shim / "git").write_text(f'#!/bin/sh\necho "$@" >> {argv_log}\nexec {shutil.which("git")} "$@"\n')
    (shim / "git").chmod(0o755)
    env = {
        "TRAINPOD_WORKLOAD": "command",
        "TRAINPOD_CONFIG": "configs/cmd.yaml",
        "TRAINPOD_GIT_REPO": f"file://{work}",
        "RUNPOD_POD_ID": "pod-1",  # a pod: its boot makes the run folder before the workload
        "PATH": f"{shim}:{os.environ['PATH']}",
    }
    result = boot_process(volume, **env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert json.loads((volume / "runs/code-run/code.json").read_text())["commit"] == commit
    asked = [line for line in argv_log.read_text().splitlines() if "rev-parse" in line]
    assert len(asked) == 1, asked


def test_a_config_in_the_synced_repo_wins_over_the_images_shipped_one_at_the_same_path(tmp_path):
    """In a pod the working directory is the image's /opt/trainpod, with its configs/ (here: this checkout's,
    the test's working directory). A user who edits configs/datagen/tiny.yaml in their repo gets their edit."""
    work, volume = tmp_path / "work", tmp_path / "volume"
    (work / "configs/datagen").mkdir(parents=True)
    volume.mkdir()
    (work / "configs/datagen/tiny.yaml").write_text(
        TINY_DATAGEN.read_text().replace("name: tiny-stories", "name: my-edit")
    )
    commit_all(work, "one")
    result = boot_datagen_from_repo(volume, work, "configs/datagen/tiny.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert (volume / "datasets/my-edit/manifest.json").is_file()
    assert not (volume / "datasets/tiny-stories").exists()


class _GitOverHttp(http.server.BaseHTTPRequestHandler):
    """git's smart HTTP protocol (git-http-backend as CGI) behind basic auth, as GitHub answers it."""

    project_root = Path()
    user, password = "", ""

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def _serve(self) -> None:
        expected = base64.b64encode(f"{self.user}:{self.password}".encode()).decode()
        if self.headers.get("Authorization") != f"Basic {expected}":
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        cgi_env = {
            "PATH": os.environ["PATH"],
            "GIT_PROJECT_ROOT": str(self.project_root),
            "GIT_HTTP_EXPORT_ALL": "1",
            "PATH_INFO": path,
            "QUERY_STRING": query,
            "REQUEST_METHOD": self.command,
            "CONTENT_TYPE": self.headers.get("Content-Type", ""),
            "CONTENT_LENGTH": str(len(body)),
            "REMOTE_USER": self.user,
        }
        backend = Path(git("--exec-path", cwd=self.project_root).strip()) / "git-http-backend"
        out = subprocess.run([backend], input=body, env=cgi_env, capture_output=True, check=True).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        headers = [line.split(":", 1) for line in head.decode().split("\r\n") if ":" in line]
        status = next((int(value.split()[0]) for name, value in headers if name.lower() == "status"), 200)
        self.send_response(status)
        for name, value in headers:
            if name.lower() != "status":
                self.send_header(name, value.strip())
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *_: object) -> None:
        pass


@pytest.fixture
def git_over_http(config_repo: Path) -> Iterator[str]:
    """config_repo served at http://127.0.0.1:<port>/configs.git to user "me" with password TOKEN."""
    handler = type(
        "Handler", (_GitOverHttp,), {"project_root": config_repo.parent, "user": "me", "password": TOKEN}
    )
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_port}/{config_repo.name}"
    finally:
        server.shutdown()


def test_credentials_in_the_repo_url_reach_git_by_askpass_never_in_its_arguments(
    tmp_path: Path, git_over_http: str, monkeypatch: pytest.MonkeyPatch
):
    """https://user:token@host/... works as before, but git's argv (`ps`, readable by every process)
    and the checkout never hold the token."""
    shim = tmp_path / "bin"
    shim.mkdir()
    argv_log = tmp_path / "git-argv.log"
    real_git = shutil.which("git")
    (shim / "git").write_text(f'#!/bin/sh\necho "$@" >> {argv_log}\nexec {real_git} "$@"\n')
    (shim / "git").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    checkout = sync(f"http://me:{TOKEN}@{git_over_http}", "v2", tmp_path / "repos", sleep=lambda _: None).path
    assert "name: tagged" in (checkout / "configs/data.yaml").read_text(), "fetched with the URL's token"
    assert "fetch" in argv_log.read_text()
    assert TOKEN not in argv_log.read_text()
    for path in checkout.rglob("*"):
        if path.is_file():
            assert TOKEN.encode() not in path.read_bytes(), path


def test_a_refused_token_or_a_missing_repo_is_bad_input_at_once_not_a_retry(
    tmp_path: Path, git_over_http: str, monkeypatch: pytest.MonkeyPatch
):
    """Retries cannot fix a wrong token or URL: each restart billed a pod start and ended the same way."""
    sleeps: list[float] = []
    wrong = "ghp_wrongtoken0123456789"
    monkeypatch.setenv("TRAINPOD_GIT_TOKEN", wrong)
    with pytest.raises(ConfigError, match="Authentication failed") as refused:
        sync(f"http://{git_over_http}", None, tmp_path / "repos", sleep=sleeps.append)
    assert "TRAINPOD_GIT_TOKEN" in str(refused.value) and wrong not in str(refused.value)

    monkeypatch.setenv("TRAINPOD_GIT_USER", "me")
    monkeypatch.setenv("TRAINPOD_GIT_TOKEN", TOKEN)
    missing_repo = f"http://{git_over_http}".replace("configs.git", "nope.git")
    with pytest.raises(ConfigError, match=r"TRAINPOD_GIT_REPO=http://127\.0\.0\.1:\d+/nope\.git .*not found"):
        sync(missing_repo, None, tmp_path / "repos", sleep=sleeps.append)
    assert sleeps == [], "not retried"
    assert not (tmp_path / "repos/configs").exists() and not (tmp_path / "repos/nope").exists()


def test_a_submodule_on_another_server_never_gets_the_repos_token(tmp_path: Path, file_submodules_allowed):
    """git hands whatever server asks for credentials to the askpass: a submodule on another forge or a mirror
    asking would have got TRAINPOD_GIT_REPO's token. Only the repo's own server gets it, and the refusal names the
    submodule and its server (it told the user to check a token that was never sent there)."""
    lib = tmp_path / "elsewhere/lib-work"
    lib.mkdir(parents=True)
    (lib / "helper.py").write_text("VALUE = 1\n")
    commit_all(lib, "one")
    git("clone", "-q", "--bare", str(lib), str(tmp_path / "elsewhere/lib.git"), cwd=tmp_path)
    seen_elsewhere: list[str] = []
    handler = type(
        "Elsewhere",
        (_GitOverHttp,),
        {"project_root": tmp_path / "elsewhere", "user": "someone", "password": "not-the-token"},
    )
    original_serve = handler._serve

    def recording_serve(self) -> None:
        seen_elsewhere.append(self.headers.get("Authorization") or "")
        original_serve(self)

    handler._serve = recording_serve
    elsewhere = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=elsewhere.serve_forever, daemon=True).start()
    trainer = tmp_path / "home/trainer-work"
    trainer.mkdir(parents=True)
    (trainer / "train.py").write_text("from lib.helper import VALUE\n")
    commit_all(trainer, "trainer")
    git("submodule", "add", "-q", str(tmp_path / "elsewhere/lib.git"), "lib", cwd=trainer)
    git("config", "-f", ".gitmodules", "submodule.lib.url", f"http://127.0.0.1:{elsewhere.server_port}/lib.git",
        cwd=trainer)  # fmt: skip
    commit_all(trainer, "lib from another server")
    git("clone", "-q", "--bare", str(trainer), str(tmp_path / "home/trainer.git"), cwd=tmp_path)
    home = type("Home", (_GitOverHttp,), {"project_root": tmp_path / "home", "user": "me", "password": TOKEN})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), home)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(ConfigError) as refused:  # the other server wants credentials it is never given
            sync(f"http://me:{TOKEN}@127.0.0.1:{server.server_port}/trainer.git", "main", tmp_path / "repos",
                 sleep=lambda _: None)  # fmt: skip
    finally:
        server.shutdown()
        elsewhere.shutdown()
    assert seen_elsewhere, "the submodule's server was asked"
    sent = [base64.b64decode(header.split()[1]).decode() for header in seen_elsewhere if header]
    assert not any(TOKEN in credentials for credentials in sent), sent
    message = str(refused.value)
    assert "submodule 'lib'" in message and f"127.0.0.1:{elsewhere.server_port}/lib.git" in message, message
    assert "TRAINPOD_GIT_TOKEN goes to TRAINPOD_GIT_REPO's server alone" in message, message
    assert TOKEN not in message


@pytest.mark.parametrize(
    "refusal", ["Host key verification failed.", "git@github.com: Permission denied (publickey)."]
)
def test_an_ssh_url_the_pod_has_no_key_for_is_bad_input_at_once_naming_https(tmp_path, monkeypatch, refusal):
    """The clone URL GitHub shows an SSH user (git@github.com:org/repo.git) reaches a pod with no SSH key and no
    known host: each attempt and each restart of the pod ended the same way, until the crash-loop limit, with
    'check the URL, the ref and the token'."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ssh").write_text(f"#!/bin/sh\necho '{refusal}' >&2\nexit 255\n")  # what ssh says in such a pod
    (shim / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    monkeypatch.delenv("GIT_SSH_COMMAND", raising=False)
    sleeps: list[float] = []
    with pytest.raises(ConfigError) as refused:
        sync("git@github.com:org/trainer.git", "main", tmp_path / "repos", sleep=sleeps.append)
    assert sleeps == [], "not retried"
    assert refusal in str(refused.value) and "https://" in str(refused.value), str(refused.value)
    assert not (tmp_path / "repos/trainer@main").exists()


def test_an_ssh_submodule_url_is_bad_input_naming_the_submodule_and_its_gitmodules_fix(
    tmp_path, monkeypatch, file_submodules_allowed
):
    """A repo on https whose .gitmodules gives a submodule's SSH URL (git@github.com:org/lib.git, as `git submodule
    add` copies it from GitHub) was refused telling the user to set TRAINPOD_GIT_REPO to its https URL, which it
    already was: the fix is the submodule's URL in .gitmodules."""
    shim = tmp_path / "bin"
    shim.mkdir()
    (shim / "ssh").write_text("#!/bin/sh\necho 'Host key verification failed.' >&2\nexit 255\n")
    (shim / "ssh").chmod(0o755)
    monkeypatch.setenv("PATH", f"{shim}:{os.environ['PATH']}")
    monkeypatch.delenv("GIT_SSH_COMMAND", raising=False)
    lib = tmp_path / "lib-work"
    lib.mkdir()
    (lib / "helper.py").write_text("VALUE = 1\n")
    commit_all(lib, "one")
    git("clone", "-q", "--bare", str(lib), str(tmp_path / "lib.git"), cwd=tmp_path)
    trainer = tmp_path / "trainer-work"
    trainer.mkdir()
    (trainer / "train.py").write_text("from vendor.lib.helper import VALUE\n")
    commit_all(trainer, "trainer")
    git("submodule", "add", "-q", "../lib.git", "vendor/lib", cwd=trainer)
    git("config", "-f", ".gitmodules", "submodule.vendor/lib.url", "git@github.com:org/lib.git", cwd=trainer)
    commit_all(trainer, "lib by its SSH URL")
    git("clone", "-q", "--bare", str(trainer), str(tmp_path / "trainer.git"), cwd=tmp_path)
    sleeps: list[float] = []
    with pytest.raises(ConfigError) as refused:
        sync(f"file://{tmp_path}/trainer.git", "main", tmp_path / "repos", sleep=sleeps.append)
    message = str(refused.value)
    assert sleeps == [], "not retried"
    assert "submodule 'vendor/lib'" in message and "git@github.com:org/lib.git" in message, message
    assert ".gitmodules" in message and "https://" in message, message
    assert "set TRAINPOD_GIT_REPO" not in message, message
