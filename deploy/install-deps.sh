#!/bin/sh
# The daemon's pinned Python dependencies, installed the same way by the image (Dockerfile),
# `make setup` and docs/operations.md ("Install"); tests/test_ops_deploy.py runs it into a
# fresh virtualenv.
#
#   sh deploy/install-deps.sh PIP [PIP-OPTION...]     (e.g. /opt/cached/venv/bin/pip -q)
#
# torch comes first, alone (--no-deps), as the CPU build: the daemon never opens a GPU, and
# `pip install torch` from PyPI is the CUDA build, gigabytes of nvidia-* wheels. A wheel the
# machine already holds (pip's find-links) is taken without asking any index; otherwise it
# comes from PyTorch's CPU wheel index ($TORCH_INDEX, a mirror of it if set). Its pin in
# requirements.txt carries the +cpu label, so the second step finds it satisfied and brings
# only torch's own dependencies, from the ordinary index; a plain
# `pip install -r requirements.txt` against PyPI fails instead of pulling the CUDA build.
set -eu
PIP=$1
shift
HERE=$(dirname "$0")
TORCH=$(grep '^torch==' "$HERE/../requirements.txt")
"$PIP" install "$@" --no-index --no-deps "$TORCH" 2>/dev/null ||
  "$PIP" install "$@" --no-deps --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" "$TORCH"
"$PIP" install "$@" -r "$HERE/../requirements.txt"
