"""`python -m jaxppo.export --ckpt RUN/checkpoints/STEP --out DIR`: the actor of a jaxppo checkpoint as a
Hugging Face model directory (safetensors + config.json + tokenizer) that transformers and vLLM load.

Under LoRA (`actor.lora_rank` > 0) the checkpoint holds the adapters only; the export merges them into the
run's base (its warm-start model if it had one, else `model.path`): W + (alpha / r) B A in float32. `--peft`
also writes the adapter in PEFT's format to DIR/adapter (`adapter_config.json` + `adapter_model.safetensors`),
which `peft.PeftModel.from_pretrained(<the base>, DIR/adapter)` loads; its `base_model_name_or_path` names the
base directory."""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path

from jaxppo.errors import JaxppoError


def export(ckpt: str | Path, out: str | Path, dtype: str | None = None, peft: bool = False) -> Path:
    import jax.numpy as jnp

    from jaxppo.checkpoint import restore_actor
    from jaxppo.errors import CheckpointError
    from jaxppo.models import save_hf_checkpoint
    from jaxppo.models.lora import spec_from

    actor = restore_actor(ckpt)
    if peft and actor.adapters is None:
        raise CheckpointError(f"{actor.run_dir}: --peft needs a LoRA run (actor.lora_rank > 0); this run trained the "
                              "whole model")
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype or "float32"]
    out = save_hf_checkpoint(actor.params, actor.model_cfg, out, dtype=dt)
    cfg, run_dir = actor.cfg, actor.run_dir
    tok_dir = Path(cfg.data.tokenizer) if cfg.data.tokenizer else (actor.model_dir if cfg.model.path
                                                                   else run_dir / "tokenizer")
    for f in tok_dir.glob("*"):
        if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(f, out / f.name)
    if peft:
        write_peft_adapter(actor.adapters, spec_from(cfg.actor), actor.model_cfg.num_hidden_layers,
                           actor.base_dir.absolute(), out / "adapter")
    return out


def write_peft_adapter(adapters, spec, num_layers: int, base_dir: Path, out: Path) -> Path:
    """The adapters in PEFT's on-disk format: tensors `base_model.model.<HF weight name>.lora_{A,B}.weight`
    (float32) and a LoRA `adapter_config.json` (no dropout, no bias, targets by projection name)."""
    import json

    import numpy as np
    from flax import traverse_util
    from safetensors.numpy import save_file

    from jaxppo.models.hf_io import iter_hf_names

    tensors = {}
    for path, value in traverse_util.flatten_dict(adapters).items():
        weight_path = path[:-1] + ("weight",)
        arr = np.asarray(value, np.float32)
        for i, name in enumerate(iter_hf_names(weight_path, num_layers)):
            stem = name[: -len(".weight")]
            tensors[f"base_model.model.{stem}.{path[-1]}.weight"] = np.ascontiguousarray(arr[i] if arr.ndim == 3 else arr)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base_dir),
              "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "bias": "none",
              "target_modules": sorted(spec.targets), "fan_in_fan_out": False, "inference_mode": True,
              "init_lora_weights": True, "use_rslora": False, "use_dora": False, "modules_to_save": None}
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m jaxppo.export", description=__doc__)
    p.add_argument("--ckpt", required=True, help="a checkpoint step directory, RUN/checkpoints/<step>")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--peft", action="store_true",
                   help="LoRA runs: also write the adapter in PEFT's format to OUT/adapter")
    args = p.parse_args(argv)
    try:
        out = export(args.ckpt, args.out, args.dtype, args.peft)
    except JaxppoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {args.ckpt} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
