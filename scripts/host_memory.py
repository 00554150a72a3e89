"""This process's host memory by kind, sampled through a run: what the memory plan's host figure is measured against.

`ru_maxrss` (the peak resident set) mixes memory that cannot be given back (anonymous pages: Python, the libraries'
heaps, JAX's arrays in host memory, CUDA's pinned buffers) with pages of mapped files (shared libraries, a checkpoint
read through mmap) that the kernel drops under pressure. /proc/self/status tells them apart now, not at their peak,
so a thread samples it (every `interval` s) and at each `mark(phase)`; the peaks say in which phase they were reached.
What the anonymous memory is, the kinds cannot say: at each mark and whenever the resident set has grown by `every_gb`
since the last look, /proc/self/smaps is read and its mappings grouped (`mappings()`: by file, anonymous ones of at
least 1 GiB one by one, the rest together), so the largest groups near the peak are on record with their phase.
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


def mappings(top: int = 12, own_gb: float = 1.0) -> list[dict] | None:
    """This process's mappings now, grouped, the `top` largest by resident size (GiB): a file's mappings together
    under its path; an anonymous mapping (heaps, arenas, pinned buffers, which smaps names by their driver device or
    not at all) resident for at least `own_gb` on its own (with its size and address), the smaller ones as "[anon]".
    Each group: name, rss, anon (of rss, anonymous pages), locked, size (virtual), n (mappings). None off Linux."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return None
    groups: dict[str, dict] = {}
    cur: dict | None = None

    def close(m):
        if m is None:
            return
        name = m["name"]
        if (not name or name.startswith("[anon") or name.startswith("[heap")) and m["rss"] >= own_gb * GiB:
            name = f"{name or '[anon]'} {m['addr']} ({m['size'] / GiB:.1f} GiB mapped)"
        elif not name:
            name = "[anon]"
        g = groups.setdefault(name, {"name": name, "rss": 0, "anon": 0, "locked": 0, "size": 0, "n": 0})
        for k in ("rss", "anon", "locked", "size"):
            g[k] += m[k]
        g["n"] += 1

    for line in text.splitlines():
        head = line.split(None, 5)
        if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's first line
            close(cur)
            lo, hi = (int(x, 16) for x in head[0].split("-"))
            cur = {"addr": head[0].split("-")[0], "name": head[5].strip() if len(head) > 5 else "", "size": hi - lo,
                   "rss": 0, "anon": 0, "locked": 0}
        elif cur is not None and head:
            key = {"Rss:": "rss", "Anonymous:": "anon", "Locked:": "locked"}.get(head[0])
            if key:
                cur[key] = int(head[1]) * 1024
    close(cur)
    out = sorted(groups.values(), key=lambda g: -g["rss"])[:top]
    return [{**g, **{k: round(g[k] / GiB, 3) for k in ("rss", "anon", "locked", "size")}} for g in out]


class HostMemory:
    """Samples `status()` in a daemon thread until `stop()`; `mark(phase)` samples at once (the last sample of the
    phase before) and names the phase later samples belong to. `peaks()`: each kind's largest sample and the phase
    it was in; `snapshots[phase]`: the sample taken as that phase began; `maps[phase]`: `mappings()` as it began,
    `maps["at peak"]`: the last look taken as the resident set reached a new height (every `every_gb` of growth)."""

    def __init__(self, interval: float = 0.1, every_gb: float = 2.0):
        self.interval = interval
        self.every_gb = every_gb
        self.maps: dict[str, dict] = {}
        self._maps_rss = 0.0
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
            look = now["rss"] >= self._maps_rss + self.every_gb
            if look:
                self._maps_rss = now["rss"]
        if look:
            self.maps["at peak"] = {"phase": self.phase, "rss": now["rss"], "groups": mappings()}
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
        groups = mappings()
        with self._lock:
            if now is not None:
                self.snapshots[phase] = now
                self.maps[phase] = {"phase": phase, "rss": now["rss"], "groups": groups}
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
        return {"interval_s": self.interval, "peaks": self.peaks(), "snapshots": self.snapshots, "maps": self.maps}
