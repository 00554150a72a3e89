"""`python -m jaxppo.compare`'s command line (the package's docstring is its help)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import jaxppo.compare as package
from jaxppo.compare.logits import logits_report
from jaxppo.compare.models import DTYPES
from jaxppo.compare.ppo_step import ppo_step_report

SUBCOMMANDS = ("logits", "ppo-step")


def _print_table(report: dict) -> None:
    width = max(len(k) for k in report)
    for k, v in report.items():
        if k in ("rows", "timing"):
            continue
        print(f"{k:<{width}}  {v}")
    if "rows" in report:
        print(f"\n{'quantity':<48} {'jax':>14} {'torch':>14} {'rel diff':>10} {'tolerance':>10}  relative to")
        for r in report["rows"]:
            notes = [f"float64 AdamW on the two gradient sequences predicts {r['predicted']:.2e}"] \
                if "predicted" in r else []
            if r.get("storage_rounding"):
                notes.append(f"float32 storage rounds {r['storage_rounding']:.2e}")
            tol = "-" if r["tolerance"] is None else f"{r['tolerance']:.2e}"
            flag = "  FAIL" if r["tolerance"] is not None and r["rel_diff"] > r["tolerance"] else ""
            print(f"{r['quantity']:<48} {r['jax']:>14.6g} {r['torch']:>14.6g} {r['rel_diff']:>10.2e} {tol:>10}  "
                  f"{r.get('relative_to', '')}" + (f"  ({'; '.join(notes)})" if notes else "") + flag)
    if "timing" in report:
        t = report["timing"]
        print(f"\n{'phase (median s)':<18} {'jax':>10} {'torch':>10} {'torch/jax':>10}")
        for k in t["jax"]:
            print(f"{k:<18} {t['jax'][k]:>10.4f} {t['torch'][k]:>10.4f} {t['speedup'][k]:>10.2f}")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS + ("-h", "--help"):
        argv.insert(0, "logits")
    parser = argparse.ArgumentParser(prog="python -m jaxppo.compare", description=package.__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    lg = sub.add_parser("logits", help="forward-pass parity with transformers")
    lg.add_argument("--model", required=True, help="Hugging Face model directory")
    lg.add_argument("--dtype", choices=DTYPES, default="float32", help="float64: JAX in x64 mode, torch in double")
    lg.add_argument("--batch", type=int, default=4)
    lg.add_argument("--seq", type=int, default=32)
    lg.add_argument("--seed", type=int, default=0)
    lg.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the torch model runs")
    ps = sub.add_parser("ppo-step", help="one PPO step in jaxppo and in plain torch, side by side",
                        description="Trailing key=value arguments are jaxppo config overrides (loss_agg_mode, "
                                    "KL, clip ratios, optimizer, ...), e.g. actor.loss_agg_mode=seq-mean-token-sum "
                                    "algorithm.use_kl_in_reward=true actor.use_kl_loss=true")
    ps.add_argument("--model", required=True, help="actor: Hugging Face causal-LM directory")
    ps.add_argument("--critic", default=None, help="critic: token-classification directory (default: the actor "
                                                   "with a new value head, the same in both frameworks)")
    ps.add_argument("--ref", default=None, help="reference policy directory (default: the actor)")
    ps.add_argument("--config", default=None, help="jaxppo YAML config (default: built-in defaults)")
    ps.add_argument("--dtype", choices=DTYPES, default="float32",
                    help="compute dtype (fp32 master weights in both; bf16 = autocast in torch; float64: JAX in "
                         "x64 mode and torch in double, float64 master weights, every quantity within 1e-8). Exit "
                         "1 when a quantity exceeds its tolerance (the report's `criterion`)")
    ps.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="where the torch side runs")
    ps.add_argument("--batch", type=int, default=8, help="sequences (prompts x rollout.n)")
    ps.add_argument("--prompt-len", type=int, default=16)
    ps.add_argument("--response-len", type=int, default=16)
    ps.add_argument("--mini-batches", type=int, default=2, help="optimizer steps per update (the 2nd sees ratio != 1)")
    ps.add_argument("--micro-batches", type=int, default=2, help="gradient-accumulation micro-batches per mini-batch")
    ps.add_argument("--seed", type=int, default=0)
    ps.add_argument("--time", action="store_true", help="also time each phase in each framework (median)")
    ps.add_argument("--repeats", type=int, default=5)
    ps.add_argument("--out", default=None, help="also write the JSON report here")
    args, rest = parser.parse_known_args(argv)
    bad = [r for r in rest if "=" not in r or r.startswith("-")]
    if bad or (rest and args.cmd != "ppo-step"):
        parser.error(f"unrecognized arguments: {' '.join(bad or rest)}")

    import contextlib

    import jax

    from jaxppo.errors import JaxppoError

    try:  # float64: JAX's x64 mode for this comparison only (the process's other work keeps its dtypes)
        with jax.enable_x64(True) if args.dtype == "float64" else contextlib.nullcontext():
            if args.cmd == "logits":
                report = logits_report(args.model, args.dtype, args.batch, args.seq, args.seed, args.device)
            else:
                os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the accelerator
                report = ppo_step_report(args, rest)
    except JaxppoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_table(report)
    line = json.dumps(report)
    if getattr(args, "out", None):
        Path(args.out).write_text(line + "\n")
    print(line)
    if report.get("failed"):
        print(f"error: over the tolerance ({report['criterion']}): {', '.join(report['failed'])}", file=sys.stderr)
        return 1
    return 0
