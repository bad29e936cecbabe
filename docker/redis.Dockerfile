# Redis for the CPU stack (docker-compose.cpu.yml): Debian's redis-server on BASE_IMAGE, for
# machines that cannot pull the redis:7.4 image from Docker Hub (the GPU stack's).
#   docker build -f docker/redis.Dockerfile -t pagedserve-redis docker
ARG BASE_IMAGE=debian:bookworm-slim
FROM ${BASE_IMAGE}
RUN apt-get update \
    && apt-get install -y --no-install-recommends redis-server \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /data \
    && chown redis:redis /data
# The append-only file goes to /data (a volume in the compose files), written as Debian's
# redis user. No configuration file: the compose command gives the options.
USER redis
WORKDIR /data
EXPOSE 6379
CMD ["redis-server"]
