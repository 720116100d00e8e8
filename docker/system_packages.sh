#!/bin/sh
# Build step of docker/Dockerfile (both targets): the system packages every image needs.
#
#   RUN --mount=type=bind,source=docker/system_packages.sh,target=/tmp/system_packages.sh sh /tmp/system_packages.sh
#
# python3 + venv (the kit's venv), ca-certificates + git and git-lfs (TRAINPOD_GIT_REPO and its LFS
# files; Debian main, Ubuntu universe), tini (PID 1), and
# what torch.compile needs at run time: Inductor compiles its CPU kernels with g++ against the
# Python headers, Triton builds a small C launcher with gcc at its first GPU kernel ("Failed to find
# C compiler" otherwise); libc6-dev gives both the libc headers. openssh-server for `PUBLIC_KEY`
# (trainpod.sshd starts it only then). About 150 MB in all.
#
# apt runs only when the base lacks one of them: the CI base (debootstrap, tests/container/engine.py)
# has them all, so the offline build (`--network none`) works there. Unpinned apt versions: the lock
# that matters is the Python one, Debian/Ubuntu drop old point releases from their mirrors, and the
# base image's tag pins the distribution.
set -eu

PACKAGES="python3 python3-venv python3-dev ca-certificates git git-lfs tini gcc g++ libc6-dev openssh-server"

python_headers() {
  python3 -c 'import os, sysconfig, sys; sys.exit(not os.path.isfile(os.path.join(sysconfig.get_paths()["include"], "Python.h")))'
}

have_all() {
  command -v tini && command -v git && command -v git-lfs && command -v gcc && command -v g++ && test -x /usr/sbin/sshd \
    && test -f /usr/include/stdio.h && python3 -c 'import ensurepip, venv' && python_headers
}

if ! have_all >/dev/null 2>&1; then
  apt-get update
  # shellcheck disable=SC2086 # one word per package
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $PACKAGES
  rm -rf /var/lib/apt/lists/*
fi
if ! have_all >/dev/null 2>&1; then
  echo "system_packages.sh: still missing one of: $PACKAGES" >&2
  exit 1
fi
# sshd's host keys are made at each start (trainpod.sshd): keys in a layer would be the same in
# every pod ever started from this image, and anyone with the image could impersonate them.
rm -f /etc/ssh/ssh_host_*
