"""`python -m jaxppo.export --ckpt RUN/checkpoints/STEP --out DIR`: the actor of a jaxppo checkpoint as a
Hugging Face model directory (safetensors + config.json + tokenizer) that transformers and vLLM load."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from jaxppo.errors import JaxppoError


def export(ckpt: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    import jax.numpy as jnp
    import orbax.checkpoint as ocp

    import flax.linen as nn
    import jax

    from jaxppo.config import load_config
    from jaxppo.errors import CheckpointError
    from jaxppo.models import abstract_params, build_model, load_config as load_model_config, save_hf_checkpoint
    from jaxppo.setup import DTYPES

    ckpt = Path(ckpt).absolute()
    if not ckpt.is_dir() or not ckpt.name.isdigit():
        raise CheckpointError(f"{ckpt}: expected a checkpoint step directory (RUN/checkpoints/<step>)")
    run_dir = ckpt.parent.parent
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir}: no config.yaml next to the checkpoints (not a jaxppo run directory)")
    cfg = load_config(run_dir / "config.yaml")
    model_dir = Path(cfg.model.path) if cfg.model.path else run_dir / "init_model"
    mcfg, _ = load_model_config(model_dir)
    # the parameter tree's shapes only (nothing read from model_dir's weights): the checkpoint has the values
    shapes = nn.unbox(abstract_params(build_model(mcfg, param_dtype=DTYPES[cfg.model.param_dtype])))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    target = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=device), shapes)
    mngr = ocp.CheckpointManager(ckpt.parent)
    # restore the actor's parameters only (optimizer state skipped)
    meta = mngr.item_metadata(int(ckpt.name))
    if meta is None or "actor" not in meta:
        raise CheckpointError(f"{ckpt}: no actor state in this checkpoint")
    restored = mngr.restore(int(ckpt.name), args=ocp.args.Composite(actor=ocp.args.PyTreeRestore(
        item={"params": target}, partial_restore=True)))
    params = restored["actor"]["params"]
    mngr.close()
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype or "float32"]
    out = save_hf_checkpoint(params, mcfg, out, dtype=dt)
    tok_dir = Path(cfg.data.tokenizer) if cfg.data.tokenizer else (model_dir if cfg.model.path else run_dir / "tokenizer")
    for f in tok_dir.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, out / f.name)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxppo.export", description=__doc__)
    p.add_argument("--ckpt", required=True, help="a checkpoint step directory, RUN/checkpoints/<step>")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = p.parse_args(argv)
    try:
        out = export(args.ckpt, args.out, args.dtype)
    except JaxppoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.ckpt} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
