"""A run's metrics.jsonl -> PNG curves (score, validation score, KL, entropy, response length, step time).

    python scripts/plot_metrics.py runs/default/metrics.jsonl --out runs/default/curves.png
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PANELS = [
    ("score", ["critic/score/mean", "val/score"]),
    ("KL", ["actor/ppo_kl", "actor/kl_loss", "actor/reward_kl_penalty"]),
    ("entropy", ["actor/entropy"]),
    ("response length", ["response_length/mean"]),
    ("step time (s)", ["timing_s/step", "timing_s/gen", "timing_s/update_actor"]),
]


def load(path: Path) -> dict[str, list[tuple[int, float]]]:
    """Each metric's (step, value) pairs. A line that is not a JSON record with a step (the last line of a run
    killed while writing it) is skipped with a warning naming it; the rest are plotted."""
    series: dict[str, dict[int, float]] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            int(rec["step"])
        except (ValueError, KeyError, TypeError):
            print(f"{path}:{n}: not a metrics record (cut short by a kill?), skipped: {line[:60]!r}", file=sys.stderr)
            continue
        for k, v in rec.items():
            if isinstance(v, (int, float)) and k not in ("step", "time"):
                series.setdefault(k, {})[rec["step"]] = float(v)  # a resumed run repeats steps: last wins
    return {k: sorted(v.items()) for k, v in series.items()}


def plot(metrics_file: str | Path, out: str | Path, title: str | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = load(Path(metrics_file))
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4 * len(PANELS), 3.2))
    for ax, (name, keys) in zip(axes, PANELS):
        for k in keys:
            if k in series:
                xs, ys = zip(*series[k])
                ax.plot(xs, ys, marker="o" if k.startswith("val/") else None, ms=3, label=k)
        ax.set_title(name)
        ax.set_xlabel("step")
        if ax.lines:
            ax.legend(fontsize=7)
    fig.suptitle(title or str(metrics_file))
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("metrics", help="metrics.jsonl of a run")
    p.add_argument("--out", default=None, help="PNG path (default: curves.png next to the metrics)")
    p.add_argument("--title", default=None)
    args = p.parse_args(argv)
    out = plot(args.metrics, args.out or Path(args.metrics).with_name("curves.png"), args.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
