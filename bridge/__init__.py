"""The torch side of jaxppo: weight handover from JAX, rollout engines, and torch references.

Only this package imports torch (and vLLM). It may import jaxppo's public types; jaxppo's core never
imports it.
"""
