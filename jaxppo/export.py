"""`python -m jaxppo.export --ckpt RUN/checkpoints/STEP --out DIR`: the actor of a jaxppo checkpoint as a
Hugging Face model directory (safetensors + config.json + tokenizer) that transformers and vLLM load. `--ckpt` may
also name a run directory or its checkpoints directory: its newest checkpoint that restores is exported (a newer one
that does not, cut by a kill or a full disk, is skipped with a warning naming it), as `trainer.resume_mode=auto`
would resume.

Under LoRA (`actor.lora_rank` > 0) the checkpoint holds the adapters only; the export merges them into the
run's base (its warm-start model if it had one, else `model.path`): W + (alpha / r) B A in float32. `--peft`
also writes the adapter in PEFT's format to DIR/adapter (`adapter_config.json` + `adapter_model.safetensors`),
which `peft.PeftModel.from_pretrained(<the base>, DIR/adapter)` loads; its `base_model_name_or_path` names the
base directory.

Nothing of yours is lost: `--out` must be a new or empty directory, or one holding an earlier export (its
`jaxppo_export.json` lists what it wrote); anything else is refused (exit 2, nothing touched) unless `--force`
is given, which writes the export's files into it and keeps the rest. The export is written to a temporary
directory beside `--out` and moved into place file by file, so an interrupted export leaves the directory as it
was or with whole files; files and directories get the permissions a normal save would (the umask's).

Exit codes: 0 exported; 2 a bad checkpoint (missing, corrupt, or another model's shapes) or `--out`."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from jaxppo.errors import JaxppoError


class ExportError(JaxppoError):
    """`--out` is not a place the export may write to."""


MARKER = "jaxppo_export.json"  # written into every export: where it came from and the files it wrote


def check_out(out: Path, force: bool) -> None:
    """Refuse an `--out` that the export could damage (ExportError: exit 2), before anything is read or written."""
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out}: a file is there, not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file() and not force:
        raise ExportError(f"--out {out}: the directory is not empty and holds no earlier export (no {MARKER}); "
                          "choose a new or empty directory, or pass --force to write the export's files into it "
                          "(files of the same names are replaced, the others kept)")


def step_dirs(ckpt: str | Path) -> list[Path]:
    """The checkpoint step directories `--ckpt` names, newest first: itself (RUN/checkpoints/<step>), or the steps of
    a run directory (one with config.yaml) or of a checkpoints directory."""
    from jaxppo.checkpoint import RunCheckpointer
    from jaxppo.errors import CheckpointError

    path = Path(ckpt).absolute()
    if path.name.isdigit():
        return [path]
    root = path / "checkpoints" if (path / "config.yaml").is_file() else path
    steps: list[int] = []
    if root.is_dir():  # the steps as the trainer's checkpointer sees them (a resume takes the same ones)
        ck = RunCheckpointer(root)
        steps = ck.all_steps()[::-1]
        ck.close()
    if not steps:
        raise CheckpointError(f"{path}: no checkpoint here; --ckpt takes RUN/checkpoints/<step>, a run directory or "
                              "its checkpoints directory")
    return [root / str(s) for s in steps]


def restore_newest(ckpt: str | Path):
    """(step directory, RestoredActor): the newest of `step_dirs(ckpt)` that restores; a newer one that does not is
    named on stderr. Raises the newest one's CheckpointError when none restores."""
    from jaxppo.checkpoint import restore_actor
    from jaxppo.errors import CheckpointError

    candidates = step_dirs(ckpt)
    first = None
    for step_dir in candidates:
        try:
            return step_dir, restore_actor(step_dir)
        except CheckpointError as e:
            if len(candidates) == 1:
                raise
            first = first or e
            print(f"warning: {e}; trying an older checkpoint", file=sys.stderr)
    raise CheckpointError(f"no checkpoint under {Path(ckpt).absolute()} restores; the newest: {first}")


def export(ckpt: str | Path, out: str | Path, dtype: str | None = None, peft: bool = False,
           force: bool = False) -> Path:
    import tempfile

    import jax.numpy as jnp

    from jaxppo.errors import CheckpointError
    from jaxppo.models import save_hf_checkpoint
    from jaxppo.models.lora import spec_from

    out = Path(out).absolute()
    check_out(out, force)
    ckpt, actor = restore_newest(ckpt)
    if peft and actor.adapters is None:
        raise CheckpointError(f"{actor.run_dir}: --peft needs a LoRA run (actor.lora_rank > 0); this run trained the "
                              "whole model")
    dt = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[dtype or "float32"]
    out.parent.mkdir(parents=True, exist_ok=True)
    staging_root = Path(tempfile.mkdtemp(prefix=f".{out.name}.export.", dir=out.parent))
    try:
        staging = save_hf_checkpoint(actor.params, actor.model_cfg, staging_root / "model", dtype=dt)
        cfg, run_dir = actor.cfg, actor.run_dir
        tok_dir = Path(cfg.data.tokenizer) if cfg.data.tokenizer else (actor.model_dir if cfg.model.path
                                                                       else run_dir / "tokenizer")
        for f in tok_dir.glob("*"):
            if f.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
                shutil.copy(f, staging / f.name)
        if peft:
            write_peft_adapter(actor.adapters, spec_from(cfg.actor), actor.model_cfg.num_hidden_layers,
                               actor.base_dir.absolute(), staging / "adapter")
        written = sorted(p.name for p in staging.iterdir()) + [MARKER]
        (staging / MARKER).write_text(json.dumps({"checkpoint": str(Path(ckpt).absolute()),
                                                  "dtype": dtype or "float32", "files": written}, indent=2) + "\n")
        _move_into_place(staging, out)
    finally:
        shutil.rmtree(staging_root, ignore_errors=True)
    return out


def _move_into_place(staging: Path, out: Path) -> None:
    """A new or empty `out`: the staging directory renamed to it. Otherwise each staged entry renamed over its
    namesake, then the files an earlier export listed and this one did not write removed (old shards)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        if out.exists():
            out.rmdir()
        os.replace(staging, out)
        return
    before = []
    if (out / MARKER).is_file():
        try:
            before = json.loads((out / MARKER).read_text()).get("files", [])
        except (ValueError, AttributeError):
            before = []
    new = {p.name for p in staging.iterdir()}
    for entry in sorted(staging.iterdir(), key=lambda p: p.name == MARKER):  # the marker last
        target = out / entry.name
        if entry.is_dir() and target.is_dir():
            shutil.rmtree(target)
        os.replace(entry, target)
    for name in before:
        stale = out / name
        if name not in new and "/" not in name and stale.exists():
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()


def write_peft_adapter(adapters, spec, num_layers: int, base_dir: Path, out: Path) -> Path:
    """The adapters in PEFT's on-disk format: tensors `base_model.model.<HF weight name>.lora_{A,B}.weight`
    (float32) and a LoRA `adapter_config.json` (no dropout, no bias, targets by projection name)."""
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
    p.add_argument("--ckpt", required=True, help="a checkpoint step directory, RUN/checkpoints/<step>; or a run "
                   "directory or its checkpoints directory: the newest checkpoint there that restores")
    p.add_argument("--out", required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--peft", action="store_true",
                   help="LoRA runs: also write the adapter in PEFT's format to OUT/adapter")
    p.add_argument("--force", action="store_true",
                   help="write into a non-empty OUT that holds no earlier export (same-named files replaced)")
    args = p.parse_args(argv)
    try:
        out = export(args.ckpt, args.out, args.dtype, args.peft, args.force)
    except JaxppoError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {json.loads((out / MARKER).read_text())['checkpoint']} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
