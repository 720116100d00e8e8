#!/bin/sh
# Pushes image references to one registry, logging in first when the environment has credentials.
#
#   sh docker/push.sh REGISTRY_HOST REF...        # `make push` calls it with every tag
#
# Credentials, read from the environment only:
#   REGISTRY_USER + REGISTRY_PASSWORD   any registry;
#   GITHUB_TOKEN (user GITHUB_ACTOR)     ghcr.io only: a GitHub token is never sent to another host.
# Without them the pushes use whatever `docker login` the user did before.
#
# The password reaches `docker login --password-stdin` through a pipe from printf, a shell builtin,
# so it is in no process's argv and in no log. The login lands in a throwaway DOCKER_CONFIG folder
# that is removed on exit, so it is never stored in ~/.docker/config.json.
# `docker push` prints "<tag>: digest: sha256:... size: N" for each reference: what was pushed.
set -eu

DOCKER=${DOCKER:-/usr/bin/docker}
if [ "$#" -lt 2 ]; then
  echo "usage: sh docker/push.sh REGISTRY_HOST REF... (run through: make push REGISTRY=host/namespace)" >&2
  exit 2
fi
host=$1
shift

user=${REGISTRY_USER:-}
password=${REGISTRY_PASSWORD:-}
if [ -z "$password" ] && [ -n "${GITHUB_TOKEN:-}" ] && [ "$host" = ghcr.io ]; then
  password=$GITHUB_TOKEN
  user=${user:-${GITHUB_ACTOR:-}}
fi

if [ -n "$password" ]; then
  if [ -z "$user" ]; then
    echo "push: a password for $host is set but no user name: set REGISTRY_USER (or GITHUB_ACTOR for ghcr.io)" >&2
    exit 2
  fi
  DOCKER_CONFIG=$(mktemp -d)
  export DOCKER_CONFIG
  trap 'rm -rf "$DOCKER_CONFIG"' EXIT
  # sh runs the EXIT trap on `exit`, not when a signal kills it: turn the signals into exits.
  trap 'exit 130' INT
  trap 'exit 143' TERM
  printf '%s' "$password" | "$DOCKER" login --username "$user" --password-stdin "$host" >/dev/null
  echo "push: logged in to $host as $user (credentials from the environment)"
fi

for ref in "$@"; do
  "$DOCKER" push "$ref"
done
