"""How far each run's policy moved and how much of its update was clipped, from the committed per-run metrics:
seeds 0-4, synchronous against one step ahead under each correction (steps 3-80: mean clip fraction, KL loss to the
warm-start policy, ppo_kl; training score over steps 71-80). Usage: python movement.py (from this folder)."""

import gzip
import json
from pathlib import Path

import numpy as np

RUNS = {"synchronous": "seed{s}_async_false", "token IS": "seed{s}_async_true", "bypass": "seed{s}_async_true_bypass",
        "bypass (implied)": "seed{s}_async_true_bypass_implied", "none": "seed{s}_async_true_nois"}
KEYS = {"clip fraction": "actor/pg_clipfrac", "KL to warm start": "actor/kl_loss", "ppo_kl": "actor/ppo_kl"}


def load(path: Path) -> dict[int, dict]:
    out: dict[int, dict] = {}
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        for line in f:
            r = json.loads(line)
            out.setdefault(r["step"], {}).update(r)
    return out


here = Path(__file__).parent / "per_run"
for seed in range(5):
    for name, stem in RUNS.items():
        name_of = stem.format(s=seed)
        found = [p for p in (here / f"{name_of}_metrics.jsonl", here / f"{name_of}_metrics.jsonl.gz") if p.is_file()]
        if not found:
            continue
        m = load(found[0])
        row = {k: round(float(np.mean([m[i][key] for i in range(3, 81)])), 4) for k, key in KEYS.items()}
        row["score 71-80"] = round(float(np.mean([m[i]["critic/score/mean"] for i in range(71, 81)])), 3)
        print(json.dumps({"seed": seed, "run": name, **row}))
