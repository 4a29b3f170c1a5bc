# The cached daemon's image (docs/operations.md, "Container").
#
#   docker build -t cached:0.1.0 .
#   docker run -d --name cached --restart unless-stopped --init \
#     --memory 10g --cpus 8 -e CACHED_WORKERS=8 -e CACHED_MAX_BYTES=20G \
#     -v cached-store:/var/lib/cached -v cached-socket:/run/cached \
#     -p 127.0.0.1:8377:8377 cached:0.1.0
#
# An inference container shares the socket volume and the daemon's group (gid 990):
#   docker run ... --group-add 990 -v cached-socket:/run/cached \
#     -v cached-store:/var/lib/cached:ro -e CACHED_SOCKET=/run/cached/cached.sock \
#     -e CACHED_DAEMON_UID=990 ...   (the client trusts a daemon of root, its own uid, or this)
# (without the store volume, use Client(transfer="bytes")).
FROM python:3.11.7-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    HOME=/var/lib/cached \
    XDG_CACHE_HOME=/var/cache/cached \
    CACHED_STORE=/var/lib/cached/store \
    CACHED_SOCKET=/run/cached/cached.sock \
    CACHED_HTTP=0.0.0.0:8377

# Workers link each kernel into a shared library with gcc. gcc is pinned to Debian 12's
# compiler (the same for the whole release); libc6-dev is left to apt, which must take the
# version of the image's libc6 anyway: a point-release pin breaks at the next point release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc=4:12.2.0-3 libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/cached
# Pinned runtime dependencies first: torch's CPU build from PyTorch's CPU wheel index (PyPI's
# torch is the CUDA build, gigabytes of nvidia-* wheels the daemon never uses), then the rest
# (deploy/install-deps.sh; --build-arg TORCH_INDEX=URL for a mirror of the CPU index).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
# --build-arg TORCH_BUILD=cuda: torch's CUDA build instead, for an image that runs
# `cached certify` and `cached tune` on the node's GPU (docker run --gpus ...).
ARG TORCH_BUILD=cpu
COPY requirements.txt ./
COPY deploy/install-deps.sh deploy/
RUN sh deploy/install-deps.sh pip

COPY client/ client/
COPY pyproject.toml ./
COPY cached/ cached/
RUN pip install --no-deps ./client . && rm -rf /opt/cached/client /opt/cached/cached /opt/cached/deploy
COPY manifests/ /usr/share/cached/manifests/
COPY docs/operations.md /usr/share/doc/cached/operations.md

RUN groupadd --system --gid 990 cached \
    && useradd --system --uid 990 --gid cached --home-dir /var/lib/cached \
       --shell /usr/sbin/nologin cached \
    && mkdir -p /var/lib/cached/store /var/cache/cached /run/cached \
    && chown -R cached:cached /var/lib/cached /var/cache/cached /run/cached

USER 990:990
VOLUME ["/var/lib/cached", "/run/cached"]
EXPOSE 8377

# GET /healthz on the configured address (CACHED_HTTP; a wildcard host is asked on loopback;
# with CACHED_HTTP=off, the socket's stats): cached/node/healthcheck.py.
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-m", "cached.node.healthcheck"]

# SIGTERM drains running compilations (drain_timeout): give `docker stop -t 60`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["cached"]
CMD ["serve"]
