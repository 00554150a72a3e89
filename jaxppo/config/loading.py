"""Loading a config: defaults <- YAML file (after the files its `defaults:` list names) <- dotted `key=value`
overrides (OmegaConf structured configs), typed into the frozen dataclass tree of `jaxppo.config.schema`; and
writing it back as YAML."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import logging
from pathlib import Path
from typing import Any

from jaxppo.config.schema import Config
from jaxppo.errors import ConfigError


@functools.cache
def _fields() -> tuple[tuple[str, Any], ...]:
    """Every key of the config tree, dotted, with its type (the schema is fixed: walked once)."""
    import typing

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            name = prefix + f.name
            yield name, hints[f.name]
            if dataclasses.is_dataclass(hints[f.name]):
                yield from walk(hints[f.name], name + ".")

    return tuple(walk(Config, ""))


def _key_list() -> list[str]:
    return [name for name, _ in _fields()]


@functools.cache
def _text_keys() -> frozenset[str]:
    """The keys whose values are text (str or Optional[str])."""
    import typing

    return frozenset(name for name, t in _fields() if t is str or t == typing.Optional[str])


@functools.cache
def _list_keys() -> dict[str, Any]:
    """The keys whose values are lists, with their element type (`data.train_files`: str)."""
    import typing

    return {name: typing.get_args(t)[0] for name, t in _fields() if typing.get_origin(t) is list}


# keys naming files or directories: a leading `~` is the user's home, as in a shell (verl's own defaults are written
# `~/data/rlhf/gsm8k/train.parquet`). Not `trainer.compilation_cache_dir`, whose default is written with `~` and
# expanded where it is used (jaxppo/start.py), so that a run's config.yaml stays the same on every machine.
PATH_KEYS = ("data.train_files", "data.val_files", "data.tokenizer", "model.path", "model.critic_path",
             "model.reward_model_path", "custom_reward_function.path", "trainer.default_local_dir",
             "trainer.profile_dir", "trainer.resume_mode")


def _typed_by_yaml(raw: str) -> bool:
    """A text key's value that keeps YAML's reading: null, a quoted value, an interpolation."""
    return raw in ("null", "~") or raw[:1] in ("'", '"') or "${" in raw


def _override_layer(overrides: list[str]):
    """The dotted overrides as one layer, in order (a later one wins). A text key's value is taken as written: YAML
    would read `rollout_rs_threshold=0.5_2` (verl's lower_upper form) as the number 0.52 and `1_3` as 13, since
    YAML 1.1 takes '_' for a digit separator; null, quoted values and interpolations keep YAML's reading."""
    from omegaconf import OmegaConf

    text, lists = _text_keys(), _list_keys()
    layer = OmegaConf.create()
    for item in overrides:
        key, raw = item.split("=", 1)
        if key in text and not _typed_by_yaml(raw):
            OmegaConf.update(layer, key, raw, force_add=True)
        elif key in lists and _bare(raw):  # one value for a list key, as verl takes `data.train_files=PATH`
            if lists[key] is str:
                OmegaConf.update(layer, key, [raw] if raw else [], force_add=True)
            else:
                layer = OmegaConf.merge(layer, OmegaConf.from_dotlist([f"{key}=[{raw}]"]))
        else:
            layer = OmegaConf.merge(layer, OmegaConf.from_dotlist([item]))
    return layer


def _bare(raw: str) -> bool:
    """A list key's value written as one item (not `[...]`, null or an interpolation)."""
    return not raw.strip().startswith("[") and not _typed_by_yaml(raw.strip())


def _file_text_as_written(layer, path: Path) -> None:
    """A text key's value in a YAML file as written (`rollout_rs_threshold: 0.5_2` is not 0.52; see
    `_override_layer`): read again with YAML's loader that types nothing. A list key given one item
    (`train_files: ~/data/gsm8k/train.parquet`, as verl's YAML writes it) becomes a list of that item."""
    import yaml
    from omegaconf import OmegaConf

    raw = yaml.load(path.read_text(), Loader=yaml.BaseLoader)
    text, lists = _text_keys(), _list_keys()

    def walk(node, prefix):
        if not isinstance(node, dict):
            return
        for k, v in node.items():
            key = prefix + str(k)
            if isinstance(v, dict):
                walk(v, key + ".")
            elif key in text and isinstance(v, str) and v != "" and not _typed_by_yaml(v):
                OmegaConf.update(layer, key, v, force_add=True)
            elif key in lists and isinstance(v, str) and _bare(v):
                one = v if lists[key] is str else OmegaConf.select(layer, key)
                OmegaConf.update(layer, key, [one] if v != "" else [], force_add=True)

    walk(raw, "")


def _suggest(key: str) -> str:
    keys = _key_list()
    close = difflib.get_close_matches(key, keys, n=3, cutoff=0.5)
    leaf = key.rsplit(".", 1)[-1]
    close += [k for k in keys if k.rsplit(".", 1)[-1] == leaf and k not in close]
    return f"; did you mean {', '.join(close[:3])}?" if close else ""


def _to_dataclass(cls, data: Any):
    import typing

    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in data:
            continue
        value = data[f.name]
        if dataclasses.is_dataclass(hints[f.name]):
            value = _to_dataclass(hints[f.name], value)
        elif isinstance(value, list) and typing.get_origin(hints[f.name]) is tuple:
            value = tuple(value)
        kwargs[f.name] = value
    return cls(**kwargs)


def _writable(node) -> None:
    """Frozen dataclasses make omegaconf 2.3 nodes read-only one by one, and merging into them fails;
    clear the flag everywhere (the dataclass built from the merge is frozen again)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    OmegaConf.set_readonly(node, None)
    if isinstance(node, DictConfig):
        for k in node.keys():
            child = node._get_node(k)
            if isinstance(child, (DictConfig, ListConfig)):
                _writable(child)


def _yaml_problem(e: Exception) -> str:
    """One line: what the YAML parser objected to, and where ("line 3, column 1")."""
    mark = getattr(e, "problem_mark", None) or getattr(e, "context_mark", None)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"{what} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else what


def _log_ignored(message: str) -> None:
    import logging

    logging.getLogger("jaxppo.config").info(message)


def _file_layers(p: Path, including: tuple[Path, ...]) -> list[tuple[str, Any]]:
    """A YAML file's layers, each with the file it came from: those of the files its `defaults:` list names
    (Hydra's key; each a path relative to the file, `.yaml` optional), in order, then the file's own keys, which
    win. `including`: the files on the way here (a file that includes itself is refused)."""
    from omegaconf import DictConfig, ListConfig, OmegaConf

    import yaml

    where = str(p)
    try:
        loaded = OmegaConf.load(p)
    except yaml.YAMLError as e:
        raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(e)}") from None
    if not isinstance(loaded, DictConfig):
        raise ConfigError(f"{p}: the top level must be a mapping of sections (data:, model:, ...), "
                          f"not a {type(loaded).__name__}")
    names = loaded.pop("defaults", [])
    if isinstance(names, str):
        names = [names]
    if not isinstance(names, (list, ListConfig)) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(f"{where}: `defaults` must list config files (paths relative to this file), "
                          f"got {OmegaConf.to_container(names) if isinstance(names, ListConfig) else names!r}")
    layers = []
    for name in names:
        d = p.parent / name
        if not d.is_file() and d.suffix != ".yaml":
            d = d.with_name(d.name + ".yaml")
        if not d.is_file():
            raise ConfigError(f"{where}: `defaults` names {name!r}, and there is no {d}")
        chain = including + (p.resolve(),)
        if d.resolve() in chain:
            raise ConfigError(f"{where}: `defaults` names {name!r}, which includes {p.name} again: "
                              + " -> ".join(c.name for c in chain + (d.resolve(),)))
        layers += _file_layers(d, chain)
    _file_text_as_written(loaded, p)
    return layers + [(where, loaded)]


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults <- YAML file (after those its `defaults:` list names) <- dotted `key=value` overrides, type-checked;
    errors are `ConfigError`, naming the file (or the overrides) the offending layer came from."""
    from omegaconf import OmegaConf
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

    import yaml

    merged = OmegaConf.structured(Config)
    _writable(merged)
    where = str(path) if path is not None else "config"
    try:
        layers = []
        if path is not None:
            p = Path(path)
            if p.is_dir():
                raise ConfigError(f"{p}: a directory, not a config file (--config takes a YAML file)")
            if not p.is_file():
                raise ConfigError(f"{p}: config file not found")
            layers += _file_layers(p, ())
        for item in overrides:
            if "=" not in item:
                raise ConfigError(f"override {item!r} is not key=value")
        from jaxppo.config.verl_keys import translate

        overrides = translate(overrides, warn=_log_ignored)
        where = "the command line's overrides"
        if overrides:
            layers.append((where, _override_layer(list(overrides))))
        for where, layer in layers:
            merged = OmegaConf.merge(merged, layer)
    except yaml.YAMLError as e:  # syntax errors, and tags safe YAML refuses (!!python/object ...)
        raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(e)}") from None
    except (ConfigKeyError, AttributeError) as e:
        key = getattr(e, "full_key", None) or str(e)
        raise ConfigError(f"{where}: unknown config key {key!r}{_suggest(str(key))}") from None
    except ValidationError as e:
        if not e.full_key:  # a section given a value ("data: 3")
            raise ConfigError(f"{where}: {str(e).splitlines()[0].replace('Merge error: ', '')}") from None
        raise ConfigError(f"{where}: config key {e.full_key!r}: {str(e.msg).splitlines()[0]}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {str(e).splitlines()[0]}") from None
    cfg = _implied(_to_dataclass(Config, _home_expanded(OmegaConf.to_container(merged, resolve=True))))
    from jaxppo.config.checks import validate

    validate(cfg)
    return cfg


def _home_expanded(tree: dict[str, Any]) -> dict[str, Any]:
    """`PATH_KEYS`' values with a leading `~` expanded to the user's home (in place; returned)."""
    import os

    def expand(v):
        return os.path.expanduser(v) if isinstance(v, str) and v.startswith("~") else v

    for key in PATH_KEYS:
        section, leaf = key.rsplit(".", 1)
        node = tree
        for part in section.split("."):
            node = node[part]
        v = node[leaf]
        node[leaf] = [expand(x) for x in v] if isinstance(v, list) else expand(v)
    return tree


def _implied(cfg: Config) -> Config:
    """Settings one key implies when the user set none of their own. Rollouts one step ahead
    (`trainer.async_rollout`) with vLLM run the engine in a helper process (`rollout.engine_in_trainer` null: false
    there, true elsewhere): in the trainer's process the generation in the background makes almost no progress
    while JAX trains (0.5B on one H200: 3.68 s a step against 3.61 s synchronous, 2026-12-02; with the helper
    2.76 s against 3.68 s synchronous in one call; docs/benchmarks.md). They are also one step off-policy, so
    without a correction of the user's they take the policy that sampled as the old policy (verl's bypass mode,
    `algorithm.rollout_correction.bypass_mode`: the PPO ratio and its clip against the rollout's log-probs, and no
    recomputation of them), or where the policy loss is not PPO's own (bypass mode replaces it) verl's token-level
    truncated importance weights (`rollout_is=token`, threshold 2.0).
    Bypass mode learned closer to the synchronous step on the embedded default, seeds 0-2
    (docs/benchmarks/learning/cpu_async_vs_sync_2026-12-02)."""
    r = cfg.rollout
    if r.engine_in_trainer is None:
        helper = cfg.trainer.async_rollout and r.engine == "vllm"
        if helper:
            logging.getLogger("jaxppo").info("trainer.async_rollout: the vLLM engine runs in a helper process "
                                             "(rollout.engine_in_trainer=false; set it true to keep it in this one)")
        cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(r, engine_in_trainer=not helper))
    a = cfg.algorithm
    rc = a.rollout_correction
    if cfg.trainer.async_rollout and rc.rollout_is is None and rc.rollout_rs is None and not rc.bypass_mode \
            and cfg.actor.tis_threshold is None:
        if cfg.actor.policy_loss.loss_mode == "vanilla":
            logging.getLogger("jaxppo").info("trainer.async_rollout: the one-step-off batches are trained with "
                                             "algorithm.rollout_correction.bypass_mode=true (the old policy is the "
                                             "one that sampled)")
            rc = dataclasses.replace(rc, bypass_mode=True)
        else:
            logging.getLogger("jaxppo").info("trainer.async_rollout: the one-step-off batches are corrected with "
                                             "algorithm.rollout_correction.rollout_is=token (threshold %s)",
                                             rc.rollout_is_threshold)
            rc = dataclasses.replace(rc, rollout_is="token")
        cfg = dataclasses.replace(cfg, algorithm=dataclasses.replace(a, rollout_correction=rc))
    return cfg


def to_yaml(cfg: Config) -> str:
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_dict(cfg: Config) -> dict[str, Any]:
    """The resolved config as a plain tree of dicts and lists (what W&B records for a run)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.structured(cfg), resolve=True)
