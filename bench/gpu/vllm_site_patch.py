"""Make vLLM 0.33.0's Python sources, unpacked without its flash-attention extensions
(_vllm_fa2_C/_vllm_fa3_C, 480 MB: they cannot travel to the H200), importable on CUDA: its
``vllm_flash_attn/__init__.py`` raises ImportError when neither extension loads, and
``v1/attention/backends/fa_utils.py`` imports it on every CUDA import of the model loader.
The patched package imports; its kernels still raise if called. The run uses the Triton
attention backend, which needs neither.
Usage: python vllm_site_patch.py SITE_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

RAISE = "if not (FA2_AVAILABLE or FA3_AVAILABLE):\n    raise ImportError("
INSTEAD = ("if False:  # patched for the H200 run: no flash-attn extension; Triton attention\n"
           "    raise ImportError(")


def main() -> None:
    init = Path(sys.argv[1]) / "vllm" / "vllm_flash_attn" / "__init__.py"
    text = init.read_text()
    if INSTEAD in text:
        return
    if RAISE not in text:
        raise SystemExit(f"{init}: the import guard is not where 0.33.0 has it")
    init.write_text(text.replace(RAISE, INSTEAD))
    print(f"patched {init}")


if __name__ == "__main__":
    main()
