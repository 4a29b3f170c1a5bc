"""Run every CPU benchmark in turn, then draw the pictures. Results: bench/out/*.json.
Usage: python bench/run_all.py   (about 20 minutes on a 2-core machine; run it alone)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

for script in ("cold.py", "warm.py", "herd.py", "load.py", "fuzz.py", "fleet.py", "plots.py"):
    print(f"== {script}", flush=True)
    subprocess.run([sys.executable, str(HERE / script)], check=True)
