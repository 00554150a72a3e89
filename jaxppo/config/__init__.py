"""One typed config tree: frozen dataclasses (`schema`), YAML files and dotted CLI overrides (`loading`), and the
checks that run before anything is built (`checks`).

Leaf names follow verl's where the meaning is the same (docs/verl_keys.md maps them). The tree is never mutated
at run time: sizes derived from it are computed by functions, not written back.
"""

from jaxppo.config.schema import *  # noqa: F401,F403
from jaxppo.config.schema import FSDP_GATHER, GRAD_REDUCE_DTYPES  # noqa: F401
from jaxppo.config.loading import config_dict, load_config, to_yaml  # noqa: F401
from jaxppo.config.checks import (CLOSED_SETS, CUDAGRAPH_MODES, DTYPE_NAMES, LOGGERS, ROLLOUT_ENGINES,  # noqa: F401
                                  _registry_sets, trained_models, uses_critic, validate, validate_paths,
                                  validate_processes)
