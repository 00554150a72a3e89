"""This process's host memory by kind, sampled through a run: what the memory plan's host figure is measured against.

`ru_maxrss` (the peak resident set) mixes memory that cannot be given back (anonymous pages: Python, the libraries'
heaps, JAX's arrays in host memory, CUDA's pinned buffers) with pages of mapped files (shared libraries, a checkpoint
read through mmap) that the kernel drops under pressure. /proc/self/status tells them apart now, not at their peak,
so a thread samples it (every `interval` s) and at each `mark(phase)`; the peaks say in which phase they were reached.
Linux only (elsewhere every figure is None).
"""

from __future__ import annotations

import threading
from pathlib import Path

GiB = 2**30
FIELDS = {"RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmRSS": "rss", "VmHWM": "rss_peak"}


def status() -> dict[str, float] | None:
    """This process's resident memory now, GiB: anon, file, shmem, rss (their sum) and rss_peak (the kernel's
    high-water mark of rss); None where /proc/self/status is absent."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    out = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key in FIELDS:
            out[FIELDS[key]] = int(value.split()[0]) * 1024 / GiB  # kB
    return out


class HostMemory:
    """Samples `status()` in a daemon thread until `stop()`; `mark(phase)` samples at once (the last sample of the
    phase before) and names the phase later samples belong to. `peaks()`: each kind's largest sample and the phase
    it was in; `snapshots[phase]`: the sample taken as that phase began."""

    def __init__(self, interval: float = 0.1):
        self.interval = interval
        self.phase = "start"
        self.snapshots: dict[str, dict[str, float]] = {}
        self._peaks: dict[str, tuple[float, str]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> dict[str, float] | None:
        now = status()
        if now is None:
            return None
        with self._lock:
            for kind, gb in now.items():
                if kind != "rss_peak" and gb > self._peaks.get(kind, (-1.0, ""))[0]:
                    self._peaks[kind] = (gb, self.phase)
        return now

    def start(self) -> "HostMemory":
        self.sample()
        self._thread = threading.Thread(target=self._run, name="host-memory", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sample()

    def mark(self, phase: str) -> None:
        """`phase` begins: a sample now ends the phase before and is kept as `phase`'s starting snapshot."""
        now = self.sample()
        with self._lock:
            if now is not None:
                self.snapshots[phase] = now
            self.phase = phase

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()

    def peaks(self) -> dict[str, dict[str, float | str]]:
        """kind -> {"gb": its largest sample, "phase": the phase it was in}; the kernel's own high-water mark of the
        resident set (which a sample can miss between two ticks) as "rss_peak"."""
        now = status() or {}
        with self._lock:
            out: dict[str, dict[str, float | str]] = {k: {"gb": gb, "phase": p} for k, (gb, p) in self._peaks.items()}
        if "rss_peak" in now:
            out["rss_peak"] = {"gb": now["rss_peak"], "phase": "(kernel's high-water mark)"}
        return out

    def summary(self) -> dict:
        return {"interval_s": self.interval, "peaks": self.peaks(), "snapshots": self.snapshots}
