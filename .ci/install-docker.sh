#!/usr/bin/env bash
# Makes a Docker engine with Compose v2 answer on this machine, for the compose test
# (tests/e2e/test_compose_run.py), where it can: as root (or with password-less sudo) on Debian.
#   - the engine: Debian's docker.io (dockerd, containerd, runc) and mmdebstrap (the base image);
#   - Compose v2: the plugin of Debian trixie's docker-compose package (2.26; bookworm's
#     docker-compose is v1, which rejects depends_on.restart), unpacked from its .deb into
#     /usr/local/lib/docker/cli-plugins/ (fetched through a private apt list: the machine's apt
#     sources are left as they are);
#   - dockerd started in the background when none answers (log: /var/log/pagedserve-dockerd.log);
#     it keeps running afterwards, as a service would.
# Never fails the run: where this cannot make an engine answer it says why in one line and the
# compose test skips, saying why. `docker info` answering already: nothing is installed.
set -uo pipefail

say() { echo "install-docker: $*" >&2; }

engine_answers() { timeout 20 docker info >/dev/null 2>&1; }
compose_answers() { timeout 20 docker compose version >/dev/null 2>&1; }

if command -v docker >/dev/null && engine_answers && compose_answers; then
  say "$(docker compose version 2>/dev/null | head -1); engine $(docker version -f '{{.Server.Version}}' 2>/dev/null) answers"
  exit 0
fi

sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo="sudo -n"; else
    say "not root and no sudo: cannot install or start Docker; the compose test will skip"
    exit 0
  fi
fi
if ! command -v apt-get >/dev/null; then
  say "no apt-get: cannot install Docker here; the compose test will skip"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive

if ! command -v dockerd >/dev/null || ! command -v mmdebstrap >/dev/null; then
  say "installing Debian's docker.io and mmdebstrap"
  if ! out="$($sudo apt-get update -qq 2>&1 &&
    $sudo apt-get install -y -qq --no-install-recommends docker.io mmdebstrap ca-certificates 2>&1)"; then
    echo "$out" | tail -5 >&2
    say "apt-get could not install docker.io: the compose test will skip"
    exit 0
  fi
fi

if ! compose_answers; then
  say "installing Compose v2 (the plugin of Debian trixie's docker-compose package)"
  tmp="$(mktemp -d)"
  trap 'rm -rf "$tmp"' EXIT
  mkdir -p "$tmp/lists/partial" "$tmp/archives/partial" "$tmp/deb"
  echo "deb http://deb.debian.org/debian trixie main" >"$tmp/sources.list"
  apt_opts=(-o "Dir::Etc::SourceList=$tmp/sources.list" -o "Dir::Etc::SourceParts=/dev/null"
    -o "Dir::State::Lists=$tmp/lists" -o "Dir::Cache::archives=$tmp/archives"
    -o "Dir::Cache::pkgcache=" -o "Dir::Cache::srcpkgcache=" -o "APT::Sandbox::User=root")
  if apt-get "${apt_opts[@]}" update -qq >/dev/null &&
    (cd "$tmp/deb" && apt-get "${apt_opts[@]}" download -qq docker-compose >/dev/null) &&
    dpkg-deb -x "$tmp"/deb/docker-compose_*.deb "$tmp/x"; then
    $sudo install -D -m 0755 "$tmp/x/usr/libexec/docker/cli-plugins/docker-compose" \
      /usr/local/lib/docker/cli-plugins/docker-compose
  else
    say "could not fetch trixie's docker-compose: the compose test will skip"
    exit 0
  fi
fi

if ! engine_answers; then
  if pgrep -x dockerd >/dev/null; then
    say "a dockerd is running but does not answer; waiting for it"
  else
    say "starting dockerd (log: /var/log/pagedserve-dockerd.log)"
    # setsid + nohup: it outlives this script and the test run, as a service would. The log is
    # opened by root's shell (with sudo, this one could not write to /var/log).
    $sudo sh -c 'setsid nohup dockerd >>/var/log/pagedserve-dockerd.log 2>&1 </dev/null &'
  fi
  for _ in $(seq 1 60); do engine_answers && break; sleep 1; done
fi
if engine_answers && compose_answers; then
  say "$(docker compose version | head -1); engine $(docker version -f '{{.Server.Version}}') answers"
else
  say "the Docker engine does not answer (see /var/log/pagedserve-dockerd.log): the compose test will skip"
fi
exit 0
