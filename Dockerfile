# pagedserve: one image for the kvstore, the compute workers and the gateway (the subcommand
# picks the process; see docker-compose.yml). Built with BuildKit (Docker 23+'s default; Compose
# v2 always): a RUN step binds docker/wheels/ of the build context.
#   docker build -t pagedserve .                      # GPU: torch and Triton from the base
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:<torch>-cuda<x.y>-cudnn9-runtime -t pagedserve .
#   docker build --build-arg BASE_IMAGE=debian:bookworm-slim -t pagedserve:cpu .   # CPU
# A base that has torch (the pytorch/pytorch images): pip is held to the base's torch and Triton,
# so a base older than pyproject's floors fails the build instead of pulling a second torch.
# A base without Python (plain Debian): Debian's python3 in a venv at /opt/venv, and TORCH from
# a wheel in docker/wheels/ when one is there (a local CPU build), else from TORCH_INDEX_URL.
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}
ARG TORCH=torch==2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HF_HUB_OFFLINE=1 \
    PATH=/opt/venv/bin:$PATH

# Triton builds a small C launcher the first time a kernel runs: it needs a C compiler and libc
# headers, which CUDA runtime images lack. A base without torch gets Python (its kernels never
# run there: no GPU, so no Python headers).
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if ! python -c "import torch" 2>/dev/null; then \
         apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
         && python3 -m venv /opt/venv; \
       fi \
    && rm -rf /var/lib/apt/lists/*

# PIP_CERT: the build secret `pip-cert` (the compose files pass the host's $PIP_CERT): a CA
# bundle for a TLS-intercepting proxy between the build and the package index. Build-time only.
RUN --mount=type=bind,source=docker/wheels,target=/tmp/wheels \
    --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
    && if ! python -c "import torch" 2>/dev/null; then \
      if ls /tmp/wheels/torch-*.whl >/dev/null 2>&1; then \
        python -m pip install --find-links /tmp/wheels "$TORCH"; \
      else \
        python -m pip install --index-url "$TORCH_INDEX_URL" "$TORCH"; \
      fi; \
    fi

# The dependencies first, in a layer of their own: a change to the code or README alone reuses it.
WORKDIR /opt/pagedserve
COPY pyproject.toml ./
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
    && python -m pip list --format=freeze | grep -E '^(torch|triton)==' > /opt/base-constraints.txt \
    && grep -q '^torch==' /opt/base-constraints.txt \
    && python -c "import tomllib; print(*tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'], sep='\n')" > /tmp/requirements.txt \
    && python -m pip install --constraint /opt/base-constraints.txt -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt
COPY README.md ./
COPY pagedserve ./pagedserve
COPY kvstore ./kvstore
COPY compute ./compute
COPY gateway ./gateway
COPY kernels ./kernels
COPY contracts ./contracts
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
    && python -m pip install --constraint /opt/base-constraints.txt . \
    && pagedserve --help > /dev/null \
    && python -m pagedserve.probe --help > /dev/null

# Not root. The model directory is mounted read-only: it must be readable by this uid. The
# kvstore's socket directory is this user's: a fresh named volume mounted there (the compose
# files' kvstore-socket) takes the image directory's owner.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin pagedserve \
    && install -d -o pagedserve -g pagedserve -m 0700 /run/pagedserve
USER pagedserve
WORKDIR /home/pagedserve

ENTRYPOINT ["pagedserve"]
CMD ["--help"]
