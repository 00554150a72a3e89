"""Imported once by the test workers' fork server (tests/train_helpers.py `_forked`): the modules a run of
`python -m jaxppo.train` imports, so that each run the tests start forks from a process that has them. Nothing here
starts JAX's backend, torch's thread pools or a rollout engine: a forked run sets its own environment (XLA_FLAGS,
devices) before any of that happens, as a fresh process would."""

import bridge.engines  # noqa: F401
import bridge.engines.hf  # noqa: F401
import jaxppo.start  # noqa: F401
import jaxppo.train  # noqa: F401
import jaxppo.trainer  # noqa: F401
import jaxppo.validation  # noqa: F401
import jaxppo.warmstart  # noqa: F401
import transformers.models.llama.modeling_llama  # noqa: F401
import transformers.models.qwen2.modeling_qwen2  # noqa: F401
import transformers.models.qwen3.modeling_qwen3  # noqa: F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

import gc  # noqa: E402

# what the imports built is never garbage: each forked run's full collections skip it (they scanned it three times a
# run, ~0.35 s each: 1.05 s of a 15 s run's collections against 0.30 s frozen, 2026-12-06), and the collector does
# not write to (and so copy) the pages the runs share with the server
gc.freeze()
