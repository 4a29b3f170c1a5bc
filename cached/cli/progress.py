"""What ``cached warm`` shows while it runs, on stderr.

On a terminal (``bar``): a tqdm bar with the rate, the elapsed time, the ETA and the counts
so far, and under it the kernel finished last; redrawn at least every second. Anywhere else
(``lines``: the journal, CI, a warm-up run by a unit): one line per ``every`` kernels or
per ``interval`` seconds, whichever comes first, so a long compilation still shows the
warm-up is alive; a line when it starts and one when it ends. ``off``: nothing.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, TextIO

from ..stats import duration_text

MODES = ("auto", "bar", "lines", "off")
FALLBACK_SIZE = (120, 24)  # columns, rows


class Progress:
    """Counts of a warm-up of ``total`` kernels as their replies come in (:meth:`done`);
    thread-safe; :meth:`close` stops the ticker and draws the last state."""

    def __init__(self, total: int, mode: str, stream: TextIO, every: int = 50,
                 interval: float = 10.0) -> None:
        if mode == "auto":
            mode = "bar" if stream.isatty() else "lines"
        self.mode, self.total, self.stream = mode, total, stream
        self.every, self.interval = every, interval
        self.counts = {"compiled": 0, "cached": 0, "remote": 0, "failed": 0}
        self.last = ""
        self.started = time.monotonic()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._printed_at = (0, self.started)  # (kernels done, time) of the last line
        self._bar: Any = None
        self._kernel_line: Any = None
        self._ticker: threading.Thread | None = None
        if mode == "off":
            return
        if mode == "bar":
            from tqdm import tqdm

            try:  # a terminal that reports no size (some ptys): a fixed one
                sized = os.get_terminal_size(stream.fileno()).columns > 0
            except (OSError, ValueError, AttributeError):
                sized = False
            size = {} if sized else {"ncols": FALLBACK_SIZE[0], "nrows": FALLBACK_SIZE[1]}
            self._bar = tqdm(total=total, desc="warm", unit=" kernel", file=stream,
                             dynamic_ncols=sized, smoothing=0.05, mininterval=0.2, **size)
            # a second line under the bar: the kernel finished last
            self._kernel_line = tqdm(total=0, position=1, bar_format="{desc}", file=stream,
                                     dynamic_ncols=sized, leave=False, **size)
        else:
            self._line(f"cached warm: {total} kernels to warm; a line every {every} kernels "
                       f"or {interval:g}s")
        self._ticker = threading.Thread(target=self._tick, name="warm-progress", daemon=True)
        self._ticker.start()

    @property
    def finished(self) -> int:
        return sum(self.counts.values())

    def done(self, outcome: str, kernel: str) -> None:
        """One reply: ``outcome`` is compiled, cached, remote or failed; ``kernel`` its name."""
        with self._lock:
            self.counts[outcome] += 1
            self.last = kernel
            if self._bar is not None:
                self._kernel_line.set_description_str(f"  last: {kernel}", refresh=False)
                self._bar.set_postfix_str(self._summary(last=False), refresh=False)
                self._bar.update(1)
                self._kernel_line.refresh()
            elif self.mode == "lines" and self.finished - self._printed_at[0] >= self.every:
                self._status_line()

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        with self._lock:
            if self._bar is not None:
                self._kernel_line.close()
                self._bar.close()
            elif self.mode == "lines" and self._printed_at[0] != self.finished:
                self._status_line()

    def _tick(self) -> None:
        period = 1.0 if self.mode == "bar" else min(1.0, self.interval / 4)
        while not self._stop.wait(period):
            with self._lock:
                if self._bar is not None:
                    self._bar.refresh()  # elapsed and ETA move during a long compilation
                    self._kernel_line.refresh()
                elif time.monotonic() - self._printed_at[1] >= self.interval:
                    self._status_line()

    def _summary(self, last: bool = True) -> str:
        c = self.counts
        parts = [f"{c['compiled']} compiled", f"{c['cached']} cached"]
        if c["remote"]:
            parts.append(f"{c['remote']} from the fleet tier")
        parts.append(f"{c['failed']} failed")
        return ", ".join(parts) + (f", last: {self.last}" if last and self.last else "")

    def _status_line(self) -> None:
        now = time.monotonic()
        done, elapsed = self.finished, now - self.started
        rate = done / elapsed if elapsed > 0 else 0.0
        if done >= self.total:
            eta = ""
        else:
            eta = f", ETA {duration_text((self.total - done) / rate) if rate else 'unknown'}"
        percent = 100 * done / self.total if self.total else 100.0
        self._line(f"cached warm: {done}/{self.total} kernels ({percent:.0f}%): "
                   f"{self._summary()}; {rate:.2f} kernels/s, {duration_text(elapsed)} "
                   f"elapsed{eta}")
        self._printed_at = (done, now)

    def _line(self, text: str) -> None:
        self.stream.write(text + "\n")
        self.stream.flush()
