"""Orbax checkpoints of a whole run: actor / critic parameters and optimizer states, KL controller,
sampler position, RNG, step. Orbax writes each step into a temporary directory and renames it when
complete, so a kill during a save leaves the previous checkpoint usable and `latest_step` never
returns a half-written one."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs carrying each array's sharding: restore lands directly in that sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class RunCheckpointer:
    def __init__(self, directory: str | Path, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

    def save(self, step: int, states: dict[str, Any], meta: dict[str, Any]) -> None:
        args = {k: ocp.args.StandardSave(v) for k, v in states.items()}
        args["meta"] = ocp.args.JsonSave(meta)
        self.manager.save(step, args=ocp.args.Composite(**args), force=True)
        self.manager.wait_until_finished()

    def latest_step(self) -> int | None:
        self.manager.reload()
        return self.manager.latest_step()

    def restore(self, step: int, like: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """States shaped and sharded like `like` (current states), and the JSON metadata."""
        args = {k: ocp.args.StandardRestore(abstract_like(v)) for k, v in like.items()}
        args["meta"] = ocp.args.JsonRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**args))
        return {k: out[k] for k in like}, dict(out["meta"])

    def close(self) -> None:
        self.manager.close()


def restore_from(path: str | Path, like: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Restore from an explicit checkpoint directory: `<root>/<step>` or `<root>` (its newest step)."""
    path = Path(path).absolute()
    if path.name.isdigit() and path.is_dir():
        root, step = path.parent, int(path.name)
    else:
        root, step = path, None
    ck = RunCheckpointer(root)
    step = ck.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"{path}: no complete checkpoint")
    states, meta = ck.restore(step, like)
    ck.close()
    return step, states, meta


def find_checkpoint(run_dir: str | Path, resume_mode: str) -> Path | None:
    """The checkpoint step directory a run would resume from: `resume_mode`'s path (a step directory, or a
    checkpoints root: its newest step), with `auto` the run directory's newest; None when there is none or
    `resume_mode=disable`."""
    if resume_mode == "disable":
        return None
    path = Path(run_dir) / "checkpoints" if resume_mode == "auto" else Path(resume_mode)
    if path.name.isdigit() and path.is_dir():
        return path.absolute()
    if not path.is_dir():
        return None
    ck = RunCheckpointer(path)
    step = ck.latest_step()
    ck.close()
    return None if step is None else (path / str(step)).absolute()


@dataclasses.dataclass
class RestoredActor:
    """The actor of a checkpoint, for inference and export: its run's config and directories, the model's config,
    float32 parameters (under LoRA the adapters merged into the base: W + (alpha / r) B A) and the adapters."""

    cfg: Any
    run_dir: Path
    model_dir: Path  # the run's model.path (or the embedded default's init_model)
    base_dir: Path  # what the parameters start from: the warm-start model under LoRA if the run had one
    model_cfg: Any
    params: Any
    adapters: Any = None  # LoRA runs: the checkpoint's adapters (float32)


def restore_actor(ckpt: str | Path, mesh: jax.sharding.Mesh | None = None) -> RestoredActor:
    """The actor's parameters of a checkpoint step directory (RUN/checkpoints/<step>), optimizer state skipped,
    restored onto `mesh` (in the rules table's shardings) or the first device."""
    import flax.linen as nn
    import jax.numpy as jnp

    from jaxppo.config import load_config
    from jaxppo.errors import CheckpointError
    from jaxppo.models import abstract_params, build_model, load_config as load_model_config, load_model
    from jaxppo.models.lora import is_adapter, merged_params, spec_from, split
    from jaxppo.setup import DTYPES
    from jaxppo.sharding import param_shardings

    ckpt = Path(ckpt).absolute()
    if not ckpt.is_dir() or not ckpt.name.isdigit():
        raise CheckpointError(f"{ckpt}: expected a checkpoint step directory (RUN/checkpoints/<step>)")
    run_dir = ckpt.parent.parent
    if not (run_dir / "config.yaml").is_file():
        raise CheckpointError(f"{run_dir}: no config.yaml next to the checkpoints (not a jaxppo run directory)")
    cfg = load_config(run_dir / "config.yaml")
    model_dir = Path(cfg.model.path) if cfg.model.path else run_dir / "init_model"
    spec = spec_from(cfg.actor)
    mcfg, _ = load_model_config(model_dir)
    # the parameter tree's shapes only (nothing read from model_dir's weights): the checkpoint has the values
    param_dtype = DTYPES[cfg.model.dtype if spec.rank else cfg.model.param_dtype]
    boxed = abstract_params(build_model(mcfg, param_dtype=param_dtype, lora=spec))
    shapes = nn.unbox(boxed)
    shardings = (param_shardings(boxed, mesh) if mesh is not None else
                 jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), shapes))
    if spec.rank:  # the checkpoint's actor params are the adapters
        shapes, shardings = split(shapes, is_adapter)[0], split(shardings, is_adapter)[0]
    target = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
    mngr = ocp.CheckpointManager(ckpt.parent)
    meta = mngr.item_metadata(int(ckpt.name))
    if meta is None or "actor" not in meta:
        raise CheckpointError(f"{ckpt}: no actor state in this checkpoint")
    restored = mngr.restore(int(ckpt.name), args=ocp.args.Composite(actor=ocp.args.PyTreeRestore(
        item={"params": target}, partial_restore=True)))
    params = restored["actor"]["params"]
    mngr.close()
    if not spec.rank:
        return RestoredActor(cfg, run_dir, model_dir, model_dir, mcfg, params)
    base_dir = run_dir / "warm_model" if (run_dir / "warm_model" / "config.json").is_file() else model_dir
    if cfg.model.random_init and base_dir == model_dir:
        raise CheckpointError(f"{run_dir}: model.random_init=true: the LoRA base was never written to disk, so "
                              "the adapters cannot be merged into it")
    _, base, _ = load_model(base_dir, mesh=mesh, dtype=jnp.float32, param_dtype=jnp.float32)
    merged = merged_params(base, params, spec.scale, jnp.float32)
    return RestoredActor(cfg, run_dir, model_dir, base_dir, mcfg, merged, params)
