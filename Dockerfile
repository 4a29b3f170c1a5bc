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
#     -v cached-store:/var/lib/cached:ro -e CACHED_SOCKET=/run/cached/cached.sock ...
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

# Workers link each kernel into a shared library with gcc.
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc=4:12.2.0-3 libc6-dev=2.36-9+deb12u14 \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/cached
# Pinned runtime dependencies first (torch first: the same order as the Makefile).
COPY requirements.txt ./
RUN pip install torch==2.13.0 && pip install -r requirements.txt

COPY client/ client/
COPY pyproject.toml ./
COPY cached/ cached/
RUN pip install --no-deps ./client . && rm -rf /opt/cached/client /opt/cached/cached
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

HEALTHCHECK --interval=30s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import json, sys, urllib.request; r = urllib.request.urlopen('http://127.0.0.1:8377/healthz', timeout=4); sys.exit(0 if json.load(r)['ok'] else 1)"]

# SIGTERM drains running compilations (drain_timeout): give `docker stop -t 60`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["cached"]
CMD ["serve"]
