"""jaxppo: PPO for language models in JAX/Flax, with rollouts from a torch engine (vLLM / transformers).

`import jaxppo` never imports torch; the torch side lives in the `bridge` package.
"""

__version__ = "0.1.0"
