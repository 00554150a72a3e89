"""Orbax checkpoints of a whole run: actor / critic parameters and optimizer states, KL controller,
sampler position, RNG, step. Orbax writes each step into a temporary directory and renames it when
complete, so a kill during a save leaves the previous checkpoint usable and `latest_step` never
returns a half-written one."""

from __future__ import annotations

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
