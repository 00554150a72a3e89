"""Orbax checkpoints of a whole run: actor / critic parameters and optimizer states, KL controller,
sampler position, RNG, step. Orbax writes each step into a temporary directory and renames it when
complete, so a kill during a save leaves the previous checkpoint usable and `latest_step` never
returns a half-written one.

Nothing is lost to a bad checkpoint: resume walks back from the newest step to the newest one that restores,
warning for each it skips (its files are left as they are); a checkpoint whose arrays do not have the shapes of
the run's model is refused with the parameter named (a run directory reused with another model), never
restored into the wrong shapes; and a save replaces the steps at or after it left from before a resume (an
abandoned trajectory, or a checkpoint that did not restore), so rotation never keeps them over a good one."""

from __future__ import annotations

import dataclasses
import errno
import logging
import warnings
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxppo.errors import CheckpointError

log = logging.getLogger(__name__)


def abstract_like(tree: Any) -> Any:
    """ShapeDtypeStructs carrying each array's sharding: restore lands directly in that sharding."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


class RunCheckpointer:
    def __init__(self, directory: str | Path, max_to_keep: int = 2):
        self.directory = Path(directory).absolute()
        try:
            self.manager = ocp.CheckpointManager(
                self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))
        except OSError as e:
            raise CheckpointError(f"{self.directory}: cannot create the checkpoint directory "
                                  f"({e.strerror or e})") from None

    def all_steps(self) -> list[int]:
        self.manager.reload()
        return sorted(self.manager.all_steps())

    def save(self, step: int, states: dict[str, Any], meta: dict[str, Any]) -> None:
        """Write `step`; the steps at or after it (left from before a resume) are deleted first, with a warning.
        A full disk or an unwritable directory raises CheckpointError naming both (the previous step is intact)."""
        for old in [s for s in self.all_steps() if s >= step]:
            log.warning("checkpoint %s/%d is replaced: the run resumed from an earlier step", self.directory, old)
            self.manager.delete(old)
        args = {k: ocp.args.StandardSave(v) for k, v in states.items()}
        args["meta"] = ocp.args.JsonSave(meta)
        absl_log = logging.getLogger("absl")
        level = absl_log.level
        absl_log.setLevel(logging.CRITICAL)  # a failed write is logged by each of orbax's threads, with tracebacks
        _drop_closed_loop_noise()
        try:
            self.manager.save(step, args=ocp.args.Composite(**args), force=True)
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - orbax / tensorstore wrap the OS error in their own types
            cause = os_cause(e)
            if cause is None:
                raise
            # the run ends here: orbax's other writers and threads fail alike and report it as they finish, and a
            # write left pending may surface at exit as a coroutine "never awaited" (seen once in CI after the error
            # line, which the user should read last)
            logging.getLogger("asyncio").setLevel(logging.CRITICAL)
            warnings.filterwarnings("ignore", message=r"coroutine .* was never awaited", category=RuntimeWarning)
            level = logging.CRITICAL
            newest = self.latest_step()
            have = f"the newest complete checkpoint is step {newest}" if newest is not None else "no checkpoint yet"
            raise CheckpointError(f"{self.directory}/{step}: the checkpoint could not be written ({cause}; {have}): "
                                  "free space there, or point trainer.default_local_dir at a larger disk, and run "
                                  "the same command again") from None
        finally:
            absl_log.setLevel(level)

    def latest_step(self) -> int | None:
        self.manager.reload()
        return self.manager.latest_step()

    def check_shapes(self, step: int, like: dict[str, Any]) -> None:
        """Raise CheckpointError naming the first arrays whose shapes in checkpoint `step` differ from `like`'s; a
        checkpoint whose metadata cannot be read raises what orbax raised (the caller treats it as unreadable)."""
        for name, tree in like.items():
            mismatch = shape_mismatches(stored_tree(self.directory / str(step) / name), tree)
            if mismatch:
                raise CheckpointError(f"{self.directory}/{step}: {name} {mismatch}: this run directory's checkpoints "
                                      "were written with another model or other adapters (model.path, model.tiny_*, "
                                      "*.lora_rank, *.target_modules); use another trainer.default_local_dir, or "
                                      "the run's own settings")

    def restore(self, step: int, like: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """States shaped and sharded like `like` (current states), and the JSON metadata."""
        self.check_shapes(step, like)
        args = {k: ocp.args.StandardRestore(abstract_like(v)) for k, v in like.items()}
        args["meta"] = ocp.args.JsonRestore()
        out = self.manager.restore(step, args=ocp.args.Composite(**args))
        return {k: out[k] for k in like}, dict(out["meta"])

    def restore_newest(self, like: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]] | None:
        """The newest checkpoint that restores: (step, states, meta), walking back past those that do not (each
        skipped with a warning, its files left in place); None when there is none. Raises CheckpointError when
        checkpoints exist but none restores, or when one has another model's shapes."""
        steps = self.all_steps()
        skipped = []
        for step in reversed(steps):
            try:
                states, meta = self.restore(step, like)
            except CheckpointError:
                raise
            except Exception as e:  # noqa: BLE001 - whatever orbax raises for missing or truncated files
                why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                log.warning("checkpoint %s/%d does not restore (%s); trying the one before it", self.directory,
                            step, why[:300])
                skipped.append(f"{step} ({why[:120]})")
                continue
            if skipped:
                log.warning("resuming from step %d; skipped %s (they are replaced by the next saves)", step,
                            ", ".join(s.split(" ")[0] for s in skipped))
            return step, states, meta
        if skipped:
            raise CheckpointError(f"{self.directory}: no checkpoint restores: {'; '.join(skipped)}. Move the "
                                  "directory away to start over, or set trainer.resume_mode to another checkpoint")
        return None

    def close(self) -> None:
        self.manager.close()


def stored_tree(item_dir: Path) -> Any:
    """The tree of array metadata (shape, dtype) that orbax stored for one item of a checkpoint; raises what orbax
    raises when it is missing or unreadable."""
    if not item_dir.is_dir():
        raise FileNotFoundError(f"{item_dir} does not exist")
    meta = ocp.StandardCheckpointHandler().metadata(item_dir)
    return getattr(meta, "tree", meta)


# the settings that decide the shapes of the checkpointed states (what a resume's shape check compares): keys, or
# prefixes of keys ending in "_"
STATE_SHAPE_KEYS = ("model.path", "model.tiny_", "actor.lora_rank", "actor.target_modules", "critic.lora_rank",
                    "critic.target_modules", "algorithm.adv_estimator")


def settings_changed(run_dir: Path, cfg: Any) -> list[str]:
    """The settings of STATE_SHAPE_KEYS whose values in `run_dir`'s config.yaml (the run that wrote its checkpoints)
    differ from `cfg`'s, as 'key: was -> now'; [] when the file is missing or unreadable."""
    from flax.traverse_util import flatten_dict

    from jaxppo.config import config_dict, load_config

    try:
        then = config_dict(load_config(Path(run_dir) / "config.yaml"))
    except Exception:  # noqa: BLE001 - a hint only: the caller's error stands without it
        return []
    was, now = flatten_dict(then, sep="."), flatten_dict(config_dict(cfg), sep=".")
    keys = [k for k in now if any(k == s or (s.endswith("_") and k.startswith(s)) for s in STATE_SHAPE_KEYS)]
    return [f"{k}: {was.get(k)!r} -> {now[k]!r}" for k in keys if was.get(k) != now[k]]


def shape_mismatches(stored: Any, like: Any, limit: int = 3) -> str:
    """'' when every array of `like` has its shape in `stored` (orbax's metadata tree); else the first few
    differences, by parameter path."""
    flat_like = {_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(like)[0]}
    flat_stored = {_path(k): v for k, v in jax.tree_util.tree_flatten_with_path(stored)[0]}
    out = []
    for key, x in flat_like.items():
        s = flat_stored.get(key)
        want = tuple(getattr(x, "shape", ()))
        got = None if s is None else tuple(getattr(s, "shape", ()) or ())
        if got is None:
            out.append(f"{key}: missing from the checkpoint (the model has shape {want})")
        elif got != want:
            out.append(f"{key}: shape {got} in the checkpoint, {want} in the model")
    more = f" (and {len(out) - limit} more)" if len(out) > limit else ""
    return "; ".join(out[:limit]) + more


def _path(keys: tuple) -> str:
    """A tree path as 'params/model/norm/weight', whether its nodes are dicts, dataclasses or sequences (a train
    state is a dataclass in memory and a dict in orbax's metadata)."""
    parts = []
    for k in keys:
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return "/".join(parts)


def _drop_closed_loop_noise() -> None:
    """After a failed write, tensorstore's pending callbacks reach orbax's closed event loops and Python reports
    each as an unraisable "Event loop is closed" traceback; they say nothing the error does not."""
    import sys

    previous = sys.unraisablehook
    if getattr(previous, "jaxppo_filter", False):
        return

    def hook(u):
        if isinstance(u.exc_value, RuntimeError) and "Event loop is closed" in str(u.exc_value):
            return
        previous(u)

    hook.jaxppo_filter = True
    sys.unraisablehook = hook


def os_cause(e: BaseException) -> str | None:
    """The operating-system reason behind a failed write, wherever orbax or tensorstore wrapped it (a full disk, a
    file size limit, permissions, a read-only file system), as one phrase; None when there is none."""
    reasons = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
               errno.EFBIG: "file too large for the file system or the process's limit",
               errno.EACCES: "permission denied", errno.EROFS: "read-only file system"}
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in reasons:
            return reasons[e.errno]
        text = str(e).lower()
        for code, phrase in reasons.items():
            if errno.errorcode[code].lower() in text or phrase.split(" for ")[0] in text or \
                    (code == errno.ENOSPC and "no space left" in text):
                return phrase
        e = e.__cause__ or e.__context__
    return None


def restore_from(path: str | Path, like: dict[str, Any]) -> tuple[int, dict[str, Any], dict[str, Any]]:
    """Restore from an explicit checkpoint directory: `<root>/<step>`, or `<root>` (its newest step that restores)."""
    path = Path(path).absolute()
    if path.name.isdigit() and path.is_dir():
        root, step = path.parent, int(path.name)
    else:
        root, step = path, None
    ck = RunCheckpointer(root)
    try:
        if step is None:
            found = ck.restore_newest(like)
            if found is None:
                raise CheckpointError(f"{path}: no complete checkpoint")
            return found
        try:
            states, meta = ck.restore(step, like)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - missing or truncated files
            raise CheckpointError(f"{path}: the checkpoint does not restore ({type(e).__name__}: "
                                  f"{str(e).splitlines()[0][:200] if str(e) else ''}); give trainer.resume_mode "
                                  "another step, or its checkpoints directory to take the newest that restores") \
                from None
        return step, states, meta
    finally:
        ck.close()


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
    if not (ckpt / "actor").is_dir():
        raise CheckpointError(f"{ckpt}: no actor state in this checkpoint")
    try:
        stored = stored_tree(ckpt / "actor")
    except Exception as e:  # noqa: BLE001 - missing metadata files
        raise CheckpointError(f"{ckpt}: the checkpoint's metadata does not read ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
    mismatch = shape_mismatches(stored.get("params", {}) if isinstance(stored, dict) else {}, target)
    if mismatch:
        raise CheckpointError(f"{ckpt}: actor {mismatch}: the run's config.yaml ({model_dir}) does not describe "
                              "the model this checkpoint holds")
    try:
        restored = mngr.restore(int(ckpt.name), args=ocp.args.Composite(actor=ocp.args.PyTreeRestore(
            item={"params": target}, partial_restore=True)))
    except Exception as e:  # noqa: BLE001 - missing or truncated array files
        raise CheckpointError(f"{ckpt}: the checkpoint does not restore ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None
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
