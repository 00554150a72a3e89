"""A user's reward function from a Python file, verl's way: `custom_reward_function.path` (a `.py` file) and
`custom_reward_function.name` (default `compute_score`), called as
`compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...)` and returning a number or
a dict with a `score` key (its other numeric keys are logged as `reward/extra/<key>/mean`), with
`custom_reward_function.reward_kwargs` as further keyword arguments (verl's key); an `async def` function is run
to completion per sample.

It is scored like the built-in rules (`jaxppo.rewards.registry.score_batch`: a time limit per sample, a sample
that raises or returns something else scores 0 and is counted, never a crash), in worker processes too: the
function travels there as (path, name) and is imported from the file again."""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
import sys
from pathlib import Path
from typing import Any, Callable

from jaxppo.errors import ConfigError


def load_function(path: str | Path, name: str) -> Callable[..., Any]:
    """The function `name` of the Python file `path`; a ConfigError naming the file and the function when either
    is missing (or the file does not import)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"custom_reward_function.path: {path} does not exist")
    module_name = f"jaxppo_user_reward_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        spec = importlib.util.spec_from_file_location(module_name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"custom_reward_function.path: {path} is not a Python file")
        module = importlib.util.module_from_spec(spec)
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file failed to import
            raise ConfigError(f"custom_reward_function.path: importing {path} failed: {type(e).__name__}: {e}") from e
        sys.modules[module_name] = module
    fn = getattr(module, name, None)
    if not callable(fn):
        known = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ConfigError(f"custom_reward_function.name: {path} has no function {name!r}; it defines {known}")
    return fn


class FileRewardFn:
    """The reward function of a file, picklable as (path, name) for worker processes."""

    takes_data_source = True  # called with verl's keyword arguments (data_source first)

    def __init__(self, path: str | Path, name: str = "compute_score", kwargs: dict | None = None):
        self.path, self.name, self.kwargs = str(Path(path).resolve()), name, dict(kwargs or {})
        self._fn = load_function(self.path, name)

    def __getstate__(self) -> dict:
        return {"path": self.path, "name": self.name, "kwargs": self.kwargs}

    def __setstate__(self, state: dict) -> None:
        self.path, self.name, self.kwargs = state["path"], state["name"], state.get("kwargs", {})
        self._fn = load_function(self.path, self.name)

    def __call__(self, data_source: str, solution_str: str, ground_truth: str, extra_info: dict) -> Any:
        out = self._fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth,
                       extra_info=extra_info, **self.kwargs)
        if inspect.isawaitable(out):  # an `async def compute_score`, as verl's reward loop allows
            out = asyncio.run(_awaited(out))
        return out

    def __repr__(self) -> str:
        return f"FileRewardFn({self.path!r}, {self.name!r})"


def from_config(cfg: Any) -> FileRewardFn | None:
    """The user's function of a Config (`custom_reward_function.path` / `.name`), or None."""
    c = cfg.custom_reward_function
    return FileRewardFn(c.path, c.name, c.reward_kwargs) if c.path else None


async def _awaited(awaitable: Any) -> Any:
    return await awaitable
