"""Rollouts with Hugging Face transformers (the embedded default, and a readable reference).

The torch model is built from the checkpoint's config; `update_weights` points each torch parameter
at the DLPack view of the JAX array (`param.data = view`): no copy, the engine computes on the
trainer's (freshly exported) buffers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from bridge.dlpack import to_torch
from jaxppo.data import left_pad
from jaxppo.rollout import Rollouts, Sampling, pack_responses

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine:
    def __init__(self, model_dir: str | Path, *, dtype: str = "float32", device: str = "cpu",
                 eos_token_ids: Sequence[int] = (), pad_token_id: int = 0, **_: Any):
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype]).to(device).eval()
        self.device = torch.device(device)
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        # copy the pushed weights instead of viewing them: set by rollouts one step ahead (jaxppo/ahead.py), which
        # generate while the trainer's update donates the buffers the views would alias
        self.copy_weights = False

    def update_weights(self, named_arrays: Iterable[tuple[str, Any]]) -> None:
        params = dict(self.model.named_parameters())
        seen = set()
        for name, array in named_arrays:
            if name not in params:
                if name == "lm_head.weight" and self.model.config.tie_word_embeddings:
                    continue
                raise KeyError(f"engine has no parameter {name!r}")
            view = to_torch(array)
            p = params[name]
            if view.shape != p.shape or view.dtype != p.dtype:
                raise ValueError(f"{name}: got {tuple(view.shape)} {view.dtype}, engine has {tuple(p.shape)} {p.dtype}")
            p.data = view.clone() if self.copy_weights else view
            seen.add(name)
        missing = set(params) - seen
        if missing:
            raise KeyError(f"update_weights did not provide {sorted(missing)[:5]}")

    def param_pointer(self, name: str) -> int:
        return dict(self.model.named_parameters())[name].data_ptr()

    @torch.no_grad()
    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling) -> Rollouts:
        from transformers import GenerationConfig

        ids, mask = left_pad([np.asarray(p, np.int64) for p in prompt_token_ids], self.pad_token_id)
        greedy = sampling.temperature == 0
        repeat = sampling.n if greedy else 1  # transformers' greedy search returns one sequence per prompt
        ids, mask = np.repeat(ids, repeat, axis=0), np.repeat(mask, repeat, axis=0)
        stop = list(self.eos_token_ids) + list(sampling.stop_token_ids)
        gen = GenerationConfig(
            do_sample=not greedy, temperature=None if greedy else sampling.temperature,
            top_p=None if greedy or sampling.top_p >= 1 else sampling.top_p,
            top_k=None if greedy or sampling.top_k <= 0 else sampling.top_k,
            max_new_tokens=sampling.max_tokens, num_return_sequences=sampling.n // repeat,
            eos_token_id=stop or None, pad_token_id=self.pad_token_id,
            output_logits=True, return_dict_in_generate=True)
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)
        out = self.model.generate(input_ids=torch.as_tensor(ids, device=self.device),
                                  attention_mask=torch.as_tensor(mask, device=self.device), generation_config=gen)
        new = out.sequences[:, ids.shape[1]:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # raw logits of every step
        logits = logits if greedy else self._processed(logits / sampling.temperature, sampling)
        logprobs = torch.log_softmax(logits, -1).gather(-1, new[..., None])[..., 0].numpy()
        stop_set = set(stop)
        samples = []
        for row, lp in zip(new.tolist(), logprobs):
            end = next((j for j, t in enumerate(row) if t in stop_set), None)
            n_tok = len(row) if end is None else end + 1
            samples.append((row[:n_tok], lp[:n_tok], "length" if end is None else "stop"))
        return pack_responses(samples, sampling.max_tokens, self.pad_token_id, sampling.n, sampling.logprobs)

    @staticmethod
    def _processed(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
        """Logits of the distribution sampled from (vLLM's processed_logprobs): top-k / top-p applied."""
        from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

        flat = logits.reshape(-1, logits.shape[-1])
        if sampling.top_k > 0:
            flat = TopKLogitsWarper(sampling.top_k)(None, flat)
        if sampling.top_p < 1:
            flat = TopPLogitsWarper(sampling.top_p)(None, flat)
        return flat.reshape(logits.shape)

    def sleep(self) -> None:  # nothing to release on CPU; weights are the trainer's buffers
        pass

    def wake(self) -> None:
        pass
