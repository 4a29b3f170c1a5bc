#!/bin/sh
# The daemon's pinned Python dependencies, installed the same way by the image (Dockerfile),
# `make setup` and docs/operations.md ("Install"); tests/test_ops_deploy.py runs it into a
# fresh virtualenv.
#
#   sh deploy/install-deps.sh PIP [PIP-OPTION...]     (e.g. /opt/cached/venv/bin/pip -q)
#   TORCH_BUILD=cuda sh deploy/install-deps.sh PIP    (a GPU node: certify and tune run here)
#
# TORCH_BUILD=cpu (the default): torch comes first, alone (--no-deps), as the CPU build: the
# daemon never opens a GPU, and `pip install torch` from PyPI is the CUDA build, gigabytes
# of nvidia-* wheels. A wheel the machine already holds (pip's find-links) is taken without
# asking any index; otherwise it comes from PyTorch's CPU wheel index ($TORCH_INDEX, a mirror
# of it if set). Its pin in requirements.txt carries the +cpu label, so the second step finds
# it satisfied and brings only torch's own dependencies, from the ordinary index; a plain
# `pip install -r requirements.txt` against PyPI fails instead of pulling the CUDA build.
#
# TORCH_BUILD=cuda: the same torch version as PyPI's CUDA build (with its nvidia-* wheels),
# for `cached certify` and `cached tune`, which run kernels on the node's GPU; the daemon
# itself still never opens it (the unit's PrivateDevices=). `===` takes exactly the version
# without a local label, so a +cpu wheel on disk is not taken for it.
set -eu
PIP=$1
shift
HERE=$(dirname "$0")
TORCH=$(grep '^torch==' "$HERE/../requirements.txt")
case "${TORCH_BUILD:-cpu}" in
cpu)
  "$PIP" install "$@" --no-index --no-deps "$TORCH" 2>/dev/null ||
    "$PIP" install "$@" --no-deps --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" "$TORCH"
  "$PIP" install "$@" -r "$HERE/../requirements.txt"
  ;;
cuda)
  REST=$(mktemp)
  trap 'rm -f "$REST"' EXIT
  grep -v '^torch==' "$HERE/../requirements.txt" > "$REST"
  VERSION=${TORCH#torch==}
  "$PIP" install "$@" -r "$REST" "torch===${VERSION%+cpu}"
  ;;
*)
  echo "install-deps.sh: TORCH_BUILD must be cpu or cuda, not '$TORCH_BUILD'" >&2
  exit 2
  ;;
esac
