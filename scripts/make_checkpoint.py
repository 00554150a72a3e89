"""Write a random-weight Hugging Face checkpoint of a real architecture shape (no weights can be
downloaded here), for `python -m jaxppo.compare ppo-step --model DIR` and other tools that read a directory.

    python scripts/make_checkpoint.py --shape qwen2.5-1.5b --out /tmp/qwen1.5b [--dtype bfloat16]

`--out` is a new or empty directory; one that holds a checkpoint (config.json) is replaced only with `--force`, and a
directory with anything else in it is refused (the checkpoint replaces the directory as a whole).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.shapes import SHAPES  # noqa: E402


def refusal(out: Path, force: bool) -> str | None:
    """Why `out` may not be written (None: it may)."""
    if out.exists() and not out.is_dir():
        return f"--out {out}: a file is there, not a directory"
    if not out.is_dir() or not any(out.iterdir()):
        return None
    if not (out / "config.json").is_file():
        return (f"--out {out}: the directory is not empty and holds no checkpoint (no config.json); the checkpoint "
                "would replace it as a whole: choose a new or empty directory")
    if not force:
        return f"--out {out}: a checkpoint is there; pass --force to replace it with random weights"
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", required=True, choices=sorted(SHAPES))
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="replace a checkpoint already at --out")
    args = p.parse_args(argv)
    out = Path(args.out).expanduser()
    why = refusal(out, args.force)
    if why:
        print(f"error: {why}", file=sys.stderr)
        return 2
    import jax
    import jax.numpy as jnp

    from jaxppo.models import build_model, init_params, save_hf_checkpoint

    cfg = SHAPES[args.shape]
    params = init_params(build_model(cfg), jax.random.PRNGKey(args.seed))
    print(save_hf_checkpoint(params, cfg, out, dtype={"float32": jnp.float32, "bfloat16": jnp.bfloat16}[args.dtype]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
