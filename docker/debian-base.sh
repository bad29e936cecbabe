#!/usr/bin/env bash
# Makes a Debian bookworm base image from Debian's packages (mmdebstrap, minbase variant), for
# machines that cannot pull debian:bookworm-slim from Docker Hub:
#   docker/debian-base.sh [IMAGE]          (default IMAGE: pagedserve-base:bookworm)
# then BASE_IMAGE=IMAGE for docker-compose.cpu.yml. Needs root (or fakeroot) and mmdebstrap.
set -euo pipefail
image="${1:-pagedserve-base:bookworm}"
tar="$(mktemp -d)/base.tar"
trap 'rm -rf "$(dirname "$tar")"' EXIT
echo "debian-base: mmdebstrap --variant=minbase bookworm (a minute or two)" >&2
mmdebstrap --quiet --variant=minbase bookworm "$tar"
docker import --change 'CMD ["bash"]' "$tar" "$image" >/dev/null
echo "debian-base: $image" >&2
