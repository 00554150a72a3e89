"""Write a random-weight Hugging Face checkpoint of a real architecture shape (no weights can be
downloaded here), for `python -m jaxppo.compare ppo-step --model DIR` and other tools that read a directory.

    python scripts/make_checkpoint.py --shape qwen2.5-1.5b --out /tmp/qwen1.5b [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jaxppo.models import build_model, init_params, save_hf_checkpoint  # noqa: E402
from scripts.shapes import SHAPES  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    cfg = SHAPES[args.shape]
    params = init_params(build_model(cfg), jax.random.PRNGKey(args.seed))
    out = save_hf_checkpoint(params, cfg, args.out, dtype={"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype])
    print(out)


if __name__ == "__main__":
    main()
