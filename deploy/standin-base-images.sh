#!/usr/bin/env bash
# Local stand-ins for the stack's two base images, python:3.11-slim and nginx:1.27-alpine, built from
# Debian packages for a machine that reaches a Debian mirror but not Docker Hub. Only the compose
# smoke test (tests/deploy/test_compose_stack.py) uses them: the Dockerfiles keep the official images.
#   sudo deploy/standin-base-images.sh     (root, debootstrap, a running dockerd; ~1 min)
# One Debian root holds Python 3.11 in a venv on PATH (as the official image's `python` and `pip`)
# and Debian's nginx; it is imported as the Python image, and the nginx tag is that image running nginx.
set -euo pipefail

MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
PYTHON_TAG="${PYTHON_TAG:-python:3.11-slim}"
NGINX_TAG="${NGINX_TAG:-nginx:1.27-alpine}"

root="$(mktemp -d)"
trap 'rm -rf "$root"' EXIT

debootstrap --variant=minbase --include=python3.11,python3.11-venv,python3-distutils,ca-certificates,passwd,nginx \
    bookworm "$root" "$MIRROR" >/dev/null
chroot "$root" python3.11 -m venv /opt/python
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin

tar -C "$root" -c . | docker import \
    --change 'ENV PATH=/opt/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["python3"]' \
    - "$PYTHON_TAG" >/dev/null
printf 'FROM %s\nSTOPSIGNAL SIGQUIT\nCMD ["nginx", "-g", "daemon off;"]\n' "$PYTHON_TAG" |
    docker build -q -t "$NGINX_TAG" - >/dev/null
echo "stand-ins built: $PYTHON_TAG, $NGINX_TAG"
