# pagedserve: one image for the kvstore, the compute workers and the gateway (the subcommand
# picks the process; see docker-compose.yml). torch and Triton come from the base image: pip is
# held to the base's versions, so a base older than pyproject's torch/triton floors fails the
# build instead of pulling a second torch.
#   docker build -t pagedserve .
#   docker build --build-arg BASE_IMAGE=pytorch/pytorch:<torch>-cuda<x.y>-cudnn9-runtime -t pagedserve .
ARG BASE_IMAGE=pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime
FROM ${BASE_IMAGE}

# Triton builds a small C launcher the first time a kernel runs: it needs a C compiler and libc
# headers, which CUDA runtime images lack.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HF_HUB_OFFLINE=1

WORKDIR /opt/pagedserve
COPY pyproject.toml README.md ./
COPY pagedserve ./pagedserve
COPY kvstore ./kvstore
COPY compute ./compute
COPY gateway ./gateway
COPY kernels ./kernels
COPY contracts ./contracts
RUN python -m pip list --format=freeze | grep -E '^(torch|triton)==' > /tmp/base-constraints.txt \
    && grep -q '^torch==' /tmp/base-constraints.txt \
    && python -m pip install --constraint /tmp/base-constraints.txt . \
    && rm /tmp/base-constraints.txt \
    && pagedserve --help > /dev/null \
    && python -m pagedserve.probe --help > /dev/null

# Not root. The model directory is mounted read-only: it must be readable by this uid.
RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin pagedserve
USER pagedserve
WORKDIR /home/pagedserve

ENTRYPOINT ["pagedserve"]
CMD ["--help"]
