"""Flax parameter tree -> Hugging Face names and layouts.

jaxppo stores every parameter in Hugging Face's layout (projection weights [out, in], as
torch.nn.Linear) under Hugging Face's names, with decoder layers stacked on a leading axis for
`nn.scan`. So the mapping is a rename plus a layer index and never a transpose: handing a layer's
weight to torch is a slice (and a cast to the engine dtype), both of which make a fresh buffer on
device anyway. XLA contracts [out, in] kernels at the same speed as [in, out] (it picks the dot
dimension numbers), so the training step pays nothing for this choice.
"""

from jaxppo.models.hf_io import hf_name, is_stacked, iter_hf_names

__all__ = ["hf_name", "is_stacked", "iter_hf_names"]
