"""Whether this environment can run kernels on a GPU, for ``certify`` and ``tune``: one line
saying what is missing and how to get it, never a traceback.

The daemon's environment has torch's CPU build by default (deploy/install-deps.sh: the
daemon never opens a GPU); on a GPU node the same script with ``TORCH_BUILD=cuda`` installs
torch's CUDA build (docs/operations.md, "Certify and tune on a GPU node")."""

from __future__ import annotations

import os

INSTALL_HINT = ("on a GPU node, install torch's CUDA build into this environment: "
                "TORCH_BUILD=cuda sh deploy/install-deps.sh PIP (docs/operations.md, "
                "'Certify and tune on a GPU node')")


def why_not(command: str) -> str | None:
    """Why ``cached COMMAND`` cannot run kernels here (one line, with the fix), or None."""
    try:
        import torch
    except ImportError as exc:
        return f"cached {command}: runs kernels on a GPU and needs torch ({exc}); {INSTALL_HINT}"
    if torch.version.cuda is None:
        return (f"cached {command}: runs kernels on a GPU, and this environment's torch "
                f"{torch.__version__} is the CPU build; {INSTALL_HINT}")
    if not torch.cuda.is_available():
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        seen = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        return (f"cached {command}: runs kernels on a GPU: no CUDA device is visible here"
                f"{seen} with torch {torch.__version__} (CUDA {torch.version.cuda}); run it "
                "on a GPU node, as a user who may open /dev/nvidia*")
    return None
