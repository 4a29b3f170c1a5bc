"""Fuzz the socket protocol against one live daemon with N inputs of each kind (default
50,000): structured frames, raw bytes, hostile frames (NaN/Infinity/huge numbers spliced in
as raw JSON, JSON nested up to 5,000 deep in the body or in a kernel's params) and
pipelines (1-12 frames of those kinds sent back to back in one write); report crashes,
reply errors and daemon RSS.
Usage: python bench/fuzz.py [--examples 50000]"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from common import ROOT, save


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=50_000)
    args = parser.parse_args()
    with tempfile.NamedTemporaryFile(suffix=".json") as report:
        started = time.monotonic()
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/test_fuzz.py", "-k", "structured or raw_bytes or nan_huge or pipelined"],
            cwd=ROOT, capture_output=True, text=True,
            env={**os.environ, "CACHED_FUZZ_EXAMPLES": str(args.examples),
                 "CACHED_FUZZ_REPORT": report.name})
        result = json.loads(open(report.name).read())
    result.update(inputs=4 * args.examples, seconds=round(time.monotonic() - started, 1),
                  pytest_rc=proc.returncode, pytest_tail=proc.stdout.strip().splitlines()[-1])
    if proc.returncode:  # what failed, for the record (the summary line alone says nothing)
        result["pytest_failures"] = [line for line in proc.stdout.splitlines()
                                     if line.startswith(("E ", "FAILED", "Falsifying"))][:60]
    save("fuzz", result)


if __name__ == "__main__":
    main()
