"""The benchmark ledger: `docs/benchmarks/results.jsonl`, one JSON object per measured result.

Every figure quoted in README.md and docs/benchmarks.md is a row here. A row says what was measured
(`bench`: update, ppo_step, sync, packing, mesh_sweep, gpu_starts, ...), when (`date`), on which code
(`commit`), where (`device`, `versions`), how (`command`, and `config` / `overrides` where a config was
used) and the figures themselves (medians, with the number of samples behind each in `samples`).

Benchmark scripts take `--ledger PATH` (default: this file) and append their rows; on the device machine
they write to a file under $OUT that is appended here afterwards (`python scripts/ledger.py --append FILE`).
The commit is `git rev-parse --short HEAD` where a repository is at hand, else $JAXPPO_COMMIT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LEDGER = ROOT / "docs" / "benchmarks" / "results.jsonl"
REQUIRED = ("bench", "date", "commit", "device", "versions", "command")


def commit() -> str:
    if os.environ.get("JAXPPO_COMMIT"):
        return os.environ["JAXPPO_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return out.stdout.strip() + ("-dirty" if dirty else "") if out.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def versions() -> dict[str, str]:
    """Versions of the packages a result depends on (those importable in this process)."""
    out = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "optax", "torch", "transformers", "vllm", "triton"):
        mod = sys.modules.get(name)
        if mod is None:
            try:
                from importlib.metadata import version

                out[name] = version(name if name != "vllm" else "vllm")
            except Exception:  # noqa: BLE001 - not installed
                continue
        else:
            out[name] = str(getattr(mod, "__version__", "?"))
    return out


def device() -> str:
    """The accelerator's name (and count), or the CPU."""
    torch = sys.modules.get("torch")
    if torch is None and "jax" not in sys.modules:
        try:
            import torch
        except ImportError:
            torch = None
    if torch is not None and torch.cuda.is_available():
        n = torch.cuda.device_count()
        return f"{n} x {torch.cuda.get_device_name()}" if n > 1 else torch.cuda.get_device_name()
    jax = sys.modules.get("jax")
    if jax is not None:
        devs = jax.devices()
        kind = getattr(devs[0], "device_kind", devs[0].platform)
        return f"{len(devs)} x {kind}" if len(devs) > 1 else kind
    return f"cpu ({platform.machine()})"


def make_row(bench: str, figures: dict[str, Any], *, config: str | None = None, overrides: list[str] | None = None,
             samples: dict[str, int] | None = None, command: str | None = None, **extra: Any) -> dict[str, Any]:
    row = {"bench": bench, "date": datetime.date.today().isoformat(), "commit": commit(), "device": device(),
           "versions": versions(), "command": command or " ".join(shlex.quote(a) for a in ["python", *sys.argv])}
    if config is not None:
        row["config"] = config
        row["overrides"] = list(overrides or [])
    row["figures"] = figures
    if samples:
        row["samples"] = samples
    row.update(extra)
    return row


def append(row: dict[str, Any], path: str | Path | None = None) -> Path:
    missing = [k for k in REQUIRED if k not in row]
    if missing:
        raise ValueError(f"ledger row lacks {missing}")
    path = Path(path or LEDGER)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row, sort_keys=False) + "\n")
    return path


def read(path: str | Path | None = None) -> list[dict[str, Any]]:
    path = Path(path or LEDGER)
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--append", nargs="+", help="ledger files (e.g. from a device run) whose rows join the ledger")
    p.add_argument("--ledger", default=str(LEDGER))
    args = p.parse_args(argv)
    n = 0
    for f in args.append or []:
        for row in read(f):
            append(row, args.ledger)
            n += 1
    print(f"{n} rows appended to {args.ledger}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
