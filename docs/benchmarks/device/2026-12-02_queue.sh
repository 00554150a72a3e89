# Device session (one H200): a queue of runs in the background that outlives each 600 s call, so that one warm
# machine runs them back to back (starts of 7B runs take longer than a call); what the calls carry besides the tree
# is built here first (docs/benchmarks/device/kit.sh). Usage, from the repo root there:
#   JAXPPO_COMMIT=<commit> [JOBS=a,b] bash docs/benchmarks/device/2026-12-02_queue.sh start  (launch, returns)
#   bash docs/benchmarks/device/2026-12-02_queue.sh wait <seconds>                    (wait, then copy results)
# Each run is a fresh process (scripts/bench_ppo_step.py or scripts/check_configs.py, committed configs, random
# weights of the shape); its ledger rows go to /tmp/q/results.jsonl, its log to /tmp/q/<name>.log. `wait` copies
# the ledger rows, the queue's summary and the logs (tgz) to $OUT. The machine goes back after 30 s without a call:
# issue the `wait` calls back to back (a call that finds a bare machine says so at once, exit 3), each with a
# limit under the device time left (`status`), though a call cut short still returns what `wait` had copied.
# Seconds per job on a warm machine, roughly: 0.5B 140-210, 1.5B ~300, 7B 450-800 (the first start of a shape is the slowest).
# JOB_TIMEOUT (seconds, default 1500) ends a job that hangs (SIGABRT: its Python threads' stacks land in its log); set
# it at start, e.g. JOB_TIMEOUT=420 for 0.5B jobs (on 2026-12-05 a hung 0.5B job would have held the queue until the
# session's device time ran out).
set -u
Q=/tmp/q
PY=/opt/torch/.venv/bin/python3
mode=${1:?start or wait}

queue() {
  # name | command (run from the repo root): the step benchmarks (10 steps, ledger `ppo_step`), synchronous and
  # one step ahead; then one job per config check (3 steps, ledger `config_check`). JOBS picks and orders them.
  # awake*: synchronous with vLLM kept awake between generations (rollout.free_cache_engine=false): JAX's region
  # is preallocated at start and vLLM's share is the rest, so its sleep frees memory nothing else takes
  local B="$PY scripts/bench_ppo_step.py --ledger $Q/results.jsonl"
  # *_base: the job at an older commit in the same call (the baseline when code under a figure changed): the
  # commit's tree, `git archive --prefix=base/ --add-virtual-file=base/.commit:<commit> <commit> | gzip > .base.tgz`,
  # carried to the machine and unpacked at start into /tmp/base; standalone vLLM is not run again
  # sampling05*: standalone vLLM, the ways of asking for samples side by side on one engine (a seed per request
  # against one seed for the call; log-probs as dicts, flat, none), then one call without log-probs (the loop's way
  # on 7 steps of 8) and one with (every step under a rollout correction) under cProfile: vLLM's host functions by time;
  # sampling05_mml: the two ways the trainer uses, with the trainer's max_model_len (768: max prompt + response)
  # the profiled runs (trainer.profile_tools=[torch]: CUPTI's record of every kernel, the engine's and XLA's, then
  # scripts/trace_summary.py: streams at once, the GPU's share of `gen`), traces kept on the machine, summaries back;
  # prof05_py: cProfile of a synchronous step's thread (trainer.profile_tools=[python]), its text summary back
  # prof05_async_helper / prof05_helpers2: the trainer's trace and each helper engine's of its generations in step
  # 5 (engine<j>_call<n>/torch_trace.json), one step ahead with one helper / synchronous with two
  # sync05_procs2 / sync15_procs2: the committed PPO configs with two vLLM engine processes (rollout.engine_processes=2:
  # each call's prompts split between the trainer's engine and a helper's; bridge/engines/vllm_processes.py);
  # async05_procs2: one step ahead with them (the helper's host work in its own process while XLA trains)
  # async05_helper: one step ahead with the one engine in a helper process (rollout.engine_in_trainer=false: no vLLM
  # work in the trainer's process, the GPU time-sliced between the two); async05_helper_mps: the same under CUDA MPS
  # (the helper's decode kernels beside XLA's, not in turns); sync05_helper: the synchronous step so, for the push
  # through the shared copy and the helper's generation against the in-process engine's (sync05);
  # sync05_helpers2(_mps) / sync05_helpers4: the synchronous step with two / four engines, all helpers (none in the
  # trainer's process)
  # critic05 / critic15: the committed PPO configs with the next batch generated while the critic updates
  # (trainer.rollout_during_critic_update: on-policy, the synchronous step reordered; jaxppo/ahead.py);
  # critic05_helper: the same with the engine in a helper process (rollout.engine_in_trainer=false)
  # *_cudamps: a committed one-step-ahead config with rollout.cuda_mps=true (the run's own MPS daemon, jaxppo/mps.py,
  # started by the benchmark itself as the trainer would: no queue daemon)
  # *_cudamps_low: the same with rollout.cuda_mps_trainer_priority=below_normal (the trainer's process a client of
  # below-normal priority, the helper engine normal: the decode's small kernels ahead of XLA's); mpsprio: whether MPS
  # client priority does that at all, torch only, no kit (docs/benchmarks/device/2026-12-08_mps_priority_probe.py)
  # lora7b_buffers: the 7B LoRA update compiled at 1024 and 2048 tokens (no allocation), every layer unrolled (as
  # committed) then 4 layers per loop iteration: the fixed part of its temporaries (~13 GiB in the H100 plan's
  # probes; on CPU the unrolled update holds a copy of every layer's weights, a loop none) and the largest values
  # of XLA's buffer assignment; lora7b_buffers_dsf: unrolled, with XLA's dynamic-slice fusion (GEMMs reading their
  # operands in place from the stacked weights, off by default), whether that drops the copy (moot: on an H100 the
  # unrolled update held no copy, 0.27 GiB at none against a loop's 1.81, 2026-12-06); lora7b_buffers_cse:
  # unrolled with the layers' remat under prevent_cse=True (on CPU: 5.48 instead of 6.37 GiB per 1024 tokens);
  # (lora7b_cse, run at 45003fe: the 7B LoRA config with model.remat_prevent_cse=true, a key since removed: its
  # plan's probes were those without it.) lora7b_buffers_mb: the buffers job with four micro-batches per mini-batch
  # (the update's scan over them, as in the config's runs; one micro-batch held no copy of the weights on an H100),
  # then with each micro-batch's loss reading the weights through a barrier tied to its micro-batch (--tie: the
  # layers' slices neither shared between micro-batches nor hoisted out of the scan), then with the config's kept
  # logits (actor.logprob_remat=false): which of them holds (or drops) the plan's ~13 GiB at no
  # tokens; lora7b_buffers_tie: its first two compiles only (plain and tied); lora7b_buffers_dump: the plain one at four
  # micro-batches with XLA's scheduled program and buffer assignment of its 1024-token compile kept (/tmp/lbd_dump.tgz,
  # copied to $OUT by the caller); lora7b_ref_base: LoRA's reference log-probs from the base module against the actor's
  # forward with zero adapters (scripts/bench_lora_reference.py, 7B, the config's 256 x 336 tokens; JAX only)
  # lora7b_buffers_mb_fix: four micro-batches again, (1) with a loop of four layers (--unroll 4), (2) under XLA's
  # dynamic slice fusion, (3) with the layers' remat under prevent_cse: which of them drops the 12.15 GiB of layer
  # weight slices the micro-batch loop's body materialises (its dump, one H100, 2026-12-07: each slice shared by the
  # forward's and the backward's gemm; outside the loop the slice is fused into the gemm); ~4 min, no vLLM
  # lora7b_buffers_host: the same four-micro-batch compile with the micro-batch loop on the host
  # (model.micro_batch_loop=host: one program per micro-batch; on CPU its temporaries are one micro-batch's, 1.71 GiB at
  # none against the scan's 3.61 at 0.5B, 2026-12-07; run on an H100 the same day: 0.26 GiB at none against the scan's
  # 12.81); lora7b_bypass_host / lora7b_host: the 7B LoRA configs so (the plan's update budget on an H100 was 2048
  # tokens with the scan's copy of the weights; 7168 with the host loop, 2026-12-07, and the configs set it since);
  # sync05_host / sync15_host / grpo7b_host / ppo7b_offload_host: the full fine-tuning configs with the host loop
  # (whether `host` can be the default: the budget their plans find and the step, beside sync05 / sync15 / grpo7b /
  # ppo7b_offload); ahead05_host / ahead15_host: the one-step-ahead configs so (#32's 0.5B / 1.5B steps are the
  # training phases beside the helper's decode: a larger update budget shortens them)
  # packing05_windows: packed rows cut into attention windows (jaxppo/packing.py, `window`) against rows of one
  # window, cuDNN's packed attention, 0.5B: parity with XLA's dense mask at an 8192-token budget (log-probs, one
  # update's loss and gradient norm), then the update timed at 32768 (medians of 8), each layout
  # head15_chunks / head7b_lora_chunks: the vocabulary head's chunk sizes (actor.logprob_chunk_size: 256, the 7B
  # configs' value, against 1024 / 2048, the 0.5B family's since 76b7486) on one 64-sequence mini-batch of the configs'
  # batch at the plans' update budget on an H100 (7168), update and log-prob pass timed (JAX only, no vLLM): whether
  # the 1.5B gain matches 0.5B's and whether the 7B LoRA configs should follow (docs/benchmarks.md, "The vocabulary
  # head's chunks")
  # lora7b_unroll4 / lora7b_bypass_awake_unroll4 / grpo7b_unroll4: the 7B configs
  # with model.scan_unroll=4 (meant to fit a larger update budget; the loop costs ~8 % at a fixed budget, 1.5B on an
  # H200, 2026-11-30; thought moot when one micro-batch's compile on an H100 held more with the loop than unrolled,
  # 2026-12-06, but at four micro-batches the unrolled update holds a copy of the layers' weights: see
  # lora7b_buffers_mb_fix, which says whether these are worth a run)
  # lora7b_ahead_inproc: the committed 7B LoRA one-step-ahead config with the engine in the trainer's process (one CUDA
  # context: XLA's and vLLM's kernels on streams of one context, not the time slices of two processes that cost the
  # helper config 3.1 s a step at 7B, 2026-12-05); lora7b_bypass_awake: the synchronous 7B LoRA step in bypass mode
  # (10.23 s at aa7b143) with vLLM kept awake (no wake / sleep: 0.2 s a step)
  # async15_helper / lora7b_ahead_helper (and their _mps): one step ahead with the engine in a helper process at
  # 1.5B and on the 7B LoRA config (at 0.5B, 2026-12-05: 2.76 s against 3.68 s synchronous)
  # sync05_noprefix / sync15_noprefix: the committed PPO configs with vLLM's prefix caching off (rollout.enable_prefix_caching)
  # knobs05*: standalone vLLM at the 0.5B config's generation (256 x 256 tokens, no log-probs, the trainer's
  # max_model_len), one engine per process: vLLM's defaults (asynchronous scheduling, prefix caching) against
  # rollout.engine_kwargs.vllm.async_scheduling=false and rollout.enable_prefix_caching=false, alone and together
  # pin05*: knobs05_noprefix (the committed configs' engine) with 12 calls, the process held to 1, 2 or 4 CPUs
  # (--cpus) or free (pin05_all, which also logs lscpu): whether the host-bound generation's two speeds from call to
  # call (1.5B standalone 1.45 / 2.3 s in one process, 2026-12-07) follow where its threads are placed
  # grpo15*: the GRPO 1.5B config (1280 sequences a step) with vLLM's default of 1024 sequences at once, and at 512 /
  # 256 (rollout.max_num_seqs): vLLM captures decode CUDA graphs up to 512 sequences, and at 8f64328 the config's
  # generation took 16.9 s (2 waves of ~1005) against 1.8 s for the 1.5B PPO config's 256
  # engines05*: the 0.5B config's generation (256 x 256 tokens, no log-probs, max_model_len 768, prefix caching and
  # asynchronous scheduling off) split over 1, 2 and 4 vLLM engines, each in its own process
  # (scripts/bench_vllm_engines.py); engines05_async: 2 then 1 engines with vLLM's asynchronous scheduling (its default,
  # the trainer's, and standalone's best at ea0f402); engines05_mps: engines05's runs (synchronous scheduling) under
  # CUDA MPS (the processes' kernels at once, not time-sliced), the daemon started for that job and stopped after it
  local P="$PY scripts/bench_ppo_step.py"
  # *_mps: the job under CUDA MPS, the daemon started for it and stopped after it (its exit status kept); *_mps80:
  # each process's kernels on at most 80 % of the SMs (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, inherited by the helper):
  # under plain MPS at 0.5B (2026-12-05) XLA's kernels took the card and the helper's generation starved (3.3 s)
  local MPS_ON="export CUDA_MPS_PIPE_DIRECTORY=$Q/mps CUDA_MPS_LOG_DIRECTORY=$Q/mps && mkdir -p $Q/mps && nvidia-cuda-mps-control -d &&"
  local MPS_OFF="; rc=\$?; echo quit | nvidia-cuda-mps-control; exit \$rc"
  local PIN="$PY scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 1 --tokens 256 --repeats 12 --ways no_logprobs --max-model-len 768 --no-prefix-caching --ledger $Q/results.jsonl --workdir $Q/w/pin05"  # the pin05* jobs' one command, held to other CPUs
  # the 7B LoRA update's buffers (docs/benchmarks/device/2026-12-06_lora_update_buffers.py) at 1024 and 2048 tokens
  local LB="$PY docs/benchmarks/device/2026-12-06_lora_update_buffers.py --shape qwen2.5-7b --tokens 1024,2048 --seq 512 --lora 64 --chunk 256 --ledger $Q/results.jsonl"
  cat <<EOF
packing05_windows|$PY scripts/bench_packing.py --model qwen2.5-0.5b --seqs 64 --budget 8192 --steps 3 --remat dots_attn --attention cudnn --windows on,off --check --ledger $Q/results.jsonl --json-out $Q/packing05_check.json && $PY scripts/bench_packing.py --model qwen2.5-0.5b --seqs 128 --budget 32768 --steps 8 --remat dots_attn --attention cudnn --windows on,off --ledger $Q/results.jsonl --json-out $Q/packing05_windows.json
head15_chunks|$PY scripts/bench_packing.py --model qwen2.5-1.5b --seqs 64 --dist full --budget 7168 --windows on --chunk 256,1024,2048 --forward --head-remat 0 --remat dots_attn --no-padded --attention cudnn --steps 8 --ledger $Q/results.jsonl --json-out $Q/head15_chunks.json
head7b_lora_chunks|$PY scripts/bench_packing.py --model qwen2.5-7b --lora 64 --loop host --seqs 64 --dist full --budget 7168 --windows on --chunk 256,1024,2048 --forward --head-remat 0 --remat dots_attn --no-padded --attention cudnn --steps 8 --ledger $Q/results.jsonl --json-out $Q/head7b_lora_chunks.json
sync05|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --json-out $Q/sync05.json --workdir $Q/w/sync05
sync05_base|cd /tmp/base && JAXPPO_COMMIT=\$(cat /tmp/base/.commit) $B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/sync05_base.json --workdir $Q/w/sync05_base
critic05|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/critic05.json --workdir $Q/w/critic05 trainer.rollout_during_critic_update=true
critic05_helper|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/critic05_helper.json --workdir $Q/w/critic05_helper trainer.rollout_during_critic_update=true rollout.engine_in_trainer=false
critic15|$B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/critic15.json --workdir $Q/w/critic15 trainer.rollout_during_critic_update=true
async15_helper|$B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/async15_helper.json --workdir $Q/w/async15_helper trainer.async_rollout=true rollout.engine_in_trainer=false
lora7b_ahead_helper|$B --config configs/gsm8k_qwen2.5_7b_lora.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_ahead_helper.json --workdir $Q/w/lora7b_ahead_helper trainer.async_rollout=true rollout.engine_in_trainer=false
async15_helper_mps|$MPS_ON $B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/async15_helper_mps.json --workdir $Q/w/async15_helper_mps trainer.async_rollout=true rollout.engine_in_trainer=false $MPS_OFF
async05_helper_mps80|export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=80 && $MPS_ON $B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/async05_helper_mps80.json --workdir $Q/w/async05_helper_mps80 trainer.async_rollout=true rollout.engine_in_trainer=false $MPS_OFF
async15_helper_mps80|export CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=80 && $MPS_ON $B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/async15_helper_mps80.json --workdir $Q/w/async15_helper_mps80 trainer.async_rollout=true rollout.engine_in_trainer=false $MPS_OFF
lora7b_ahead_helper_mps|$MPS_ON $B --config configs/gsm8k_qwen2.5_7b_lora_ahead.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_ahead_helper_mps.json --workdir $Q/w/lora7b_ahead_helper_mps $MPS_OFF
lora7b_ahead_cudamps|$B --config configs/gsm8k_qwen2.5_7b_lora_ahead.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_ahead_cudamps.json --workdir $Q/w/lora7b_ahead_cudamps rollout.cuda_mps=true
ahead15_cudamps|$B --config configs/gsm8k_qwen2.5_1.5b_ahead.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/ahead15_cudamps.json --workdir $Q/w/ahead15_cudamps rollout.cuda_mps=true
ahead05_cudamps|$B --config configs/gsm8k_qwen2.5_0.5b_ahead.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/ahead05_cudamps.json --workdir $Q/w/ahead05_cudamps rollout.cuda_mps=true
ahead05_cudamps_low|$B --config configs/gsm8k_qwen2.5_0.5b_ahead.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/ahead05_cudamps_low.json --workdir $Q/w/ahead05_cudamps_low rollout.cuda_mps=true rollout.cuda_mps_trainer_priority=below_normal
ahead15_cudamps_low|$B --config configs/gsm8k_qwen2.5_1.5b_ahead.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/ahead15_cudamps_low.json --workdir $Q/w/ahead15_cudamps_low rollout.cuda_mps=true rollout.cuda_mps_trainer_priority=below_normal
mpsprio|$PY docs/benchmarks/device/2026-12-08_mps_priority_probe.py --out $Q/mps_priority.jsonl
lora7b_ahead_inproc|$B --config configs/gsm8k_qwen2.5_7b_lora_ahead.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_ahead_inproc.json --workdir $Q/w/lora7b_ahead_inproc rollout.engine_in_trainer=true
lora7b_bypass_awake|$B --config configs/gsm8k_qwen2.5_7b_lora.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_bypass_awake.json --workdir $Q/w/lora7b_bypass_awake algorithm.rollout_correction.bypass_mode=true rollout.free_cache_engine=false
sync05_noprefix|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --json-out $Q/sync05_noprefix.json --workdir $Q/w/sync05_noprefix rollout.enable_prefix_caching=false
sync15_noprefix|$B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --json-out $Q/sync15_noprefix.json --workdir $Q/w/sync15_noprefix rollout.enable_prefix_caching=false
sync05_procs2|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --json-out $Q/sync05_procs2.json --workdir $Q/w/sync05_procs2 rollout.engine_processes=2
sync15_procs2|$B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --json-out $Q/sync15_procs2.json --workdir $Q/w/sync15_procs2 rollout.engine_processes=2
async05_procs2|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/async05_procs2.json --workdir $Q/w/async05_procs2 trainer.async_rollout=true rollout.engine_in_trainer=true rollout.engine_processes=2
async05_helper|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/async05_helper.json --workdir $Q/w/async05_helper trainer.async_rollout=true rollout.engine_in_trainer=false
async05_helper_mps|export CUDA_MPS_PIPE_DIRECTORY=$Q/mps CUDA_MPS_LOG_DIRECTORY=$Q/mps && mkdir -p $Q/mps && nvidia-cuda-mps-control -d && $B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/async05_helper_mps.json --workdir $Q/w/async05_helper_mps trainer.async_rollout=true rollout.engine_in_trainer=false; rc=\$?; echo quit | nvidia-cuda-mps-control; exit \$rc
sync05_helpers2|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --json-out $Q/sync05_helpers2.json --workdir $Q/w/sync05_helpers2 rollout.engine_processes=2 rollout.engine_in_trainer=false
sync05_helpers4|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --json-out $Q/sync05_helpers4.json --workdir $Q/w/sync05_helpers4 rollout.engine_processes=4 rollout.engine_in_trainer=false
sync05_helpers2_mps|$MPS_ON $B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --json-out $Q/sync05_helpers2_mps.json --workdir $Q/w/sync05_helpers2_mps rollout.engine_processes=2 rollout.engine_in_trainer=false $MPS_OFF
sync05_helper|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --json-out $Q/sync05_helper.json --workdir $Q/w/sync05_helper rollout.engine_in_trainer=false
async05|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/async05.json --workdir $Q/w/async05 trainer.async_rollout=true rollout.engine_in_trainer=true
awake05|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --json-out $Q/awake05.json --workdir $Q/w/awake05 rollout.free_cache_engine=false
sync15|$B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --json-out $Q/sync15.json --workdir $Q/w/sync15
sync15_base|cd /tmp/base && JAXPPO_COMMIT=\$(cat /tmp/base/.commit) $B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/sync15_base.json --workdir $Q/w/sync15_base
async15|$B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/async15.json --workdir $Q/w/async15 trainer.async_rollout=true rollout.engine_in_trainer=true
awake15|$B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --json-out $Q/awake15.json --workdir $Q/w/awake15 rollout.free_cache_engine=false
ppo7b_offload|$B --config configs/gsm8k_qwen2.5_7b_offload.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/ppo7b_offload.json --workdir $Q/w/ppo7b
grpo7b|$B --config configs/gsm8k_grpo_qwen2.5_7b.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/grpo7b.json --workdir $Q/w/grpo7b
lora7b_buffers|$LB --out /tmp/lora7b_buffers && rm -rf /tmp/lora7b_buffers && $LB --out /tmp/lora7b_buffers --unroll 4
lora7b_buffers_dsf|XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true $LB --out /tmp/lora7b_buffers_dsf
lora7b_buffers_cse|$LB --out /tmp/lora7b_buffers_cse --prevent-cse
lora7b_buffers_mb|$LB --out /tmp/lora7b_buffers_mb --micro-batches 4 && rm -rf /tmp/lora7b_buffers_mb && $LB --out /tmp/lora7b_buffers_mb --micro-batches 4 --tie && rm -rf /tmp/lora7b_buffers_mb && $LB --out /tmp/lora7b_buffers_mb --micro-batches 4 --keep-logits
lora7b_buffers_tie|$LB --out /tmp/lora7b_buffers_mb --micro-batches 4 && rm -rf /tmp/lora7b_buffers_mb && $LB --out /tmp/lora7b_buffers_mb --micro-batches 4 --tie
lora7b_ref_base|$PY scripts/bench_lora_reference.py --shape qwen2.5-7b --ledger $Q/results.jsonl
lora7b_buffers_dump|$LB --out /tmp/lbd --micro-batches 4 && cd /tmp/lbd/dump && m=\$(ls *after_optimizations.txt | sort | head -1) && m=\${m%%.*} && tar czf /tmp/lbd_dump.tgz \$m.*after_optimizations.txt \$m.*buffer-assignment.txt \$m.*memory-usage-report.txt && ls -la /tmp/lbd_dump.tgz
lora7b_buffers_mb_fix|$LB --out /tmp/lbf --micro-batches 4 --unroll 4 && rm -rf /tmp/lbf && XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true $LB --out /tmp/lbf --micro-batches 4 && rm -rf /tmp/lbf && $LB --out /tmp/lbf --micro-batches 4 --prevent-cse
lora7b_buffers_host|$LB --out /tmp/lbh --micro-batches 4 --loop host
lora7b_bypass_host|$B --config configs/gsm8k_qwen2.5_7b_lora_bypass.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_bypass_host.json --workdir $Q/w/lora7b_bypass_host model.micro_batch_loop=host
lora7b_host|$B --config configs/gsm8k_qwen2.5_7b_lora.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_host.json --workdir $Q/w/lora7b_host model.micro_batch_loop=host
sync05_host|$B --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/sync05_host.json --workdir $Q/w/sync05_host model.micro_batch_loop=host
sync15_host|$B --config configs/gsm8k_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/sync15_host.json --workdir $Q/w/sync15_host model.micro_batch_loop=host
grpo7b_host|$B --config configs/gsm8k_grpo_qwen2.5_7b.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/grpo7b_host.json --workdir $Q/w/grpo7b_host model.micro_batch_loop=host
ppo7b_offload_host|$B --config configs/gsm8k_qwen2.5_7b_offload.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/ppo7b_offload_host.json --workdir $Q/w/ppo7b_offload_host model.micro_batch_loop=host
ahead05_host|$B --config configs/gsm8k_qwen2.5_0.5b_ahead.yaml --shape qwen2.5-0.5b --steps 10 --no-standalone --json-out $Q/ahead05_host.json --workdir $Q/w/ahead05_host model.micro_batch_loop=host
ahead15_host|$B --config configs/gsm8k_qwen2.5_1.5b_ahead.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/ahead15_host.json --workdir $Q/w/ahead15_host model.micro_batch_loop=host
lora7b_unroll4|$B --config configs/gsm8k_qwen2.5_7b_lora.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_unroll4.json --workdir $Q/w/lora7b_unroll4 model.scan_unroll=4
lora7b_bypass_awake_unroll4|$B --config configs/gsm8k_qwen2.5_7b_lora.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_bypass_awake_unroll4.json --workdir $Q/w/lora7b_bypass_awake_unroll4 algorithm.rollout_correction.bypass_mode=true rollout.free_cache_engine=false model.scan_unroll=4
grpo7b_unroll4|$B --config configs/gsm8k_grpo_qwen2.5_7b.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/grpo7b_unroll4.json --workdir $Q/w/grpo7b_unroll4 model.scan_unroll=4
lora7b|$B --config configs/gsm8k_qwen2.5_7b_lora.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b.json --workdir $Q/w/lora7b
grpo15|$B --config configs/gsm8k_grpo_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/grpo15.json --workdir $Q/w/grpo15
grpo15_seqs512|$B --config configs/gsm8k_grpo_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/grpo15_seqs512.json --workdir $Q/w/grpo15_seqs512 rollout.max_num_seqs=512
grpo15_seqs256|$B --config configs/gsm8k_grpo_qwen2.5_1.5b.yaml --shape qwen2.5-1.5b --steps 10 --no-standalone --json-out $Q/grpo15_seqs256.json --workdir $Q/w/grpo15_seqs256 rollout.max_num_seqs=256
lora7b_bypass|$B --config configs/gsm8k_qwen2.5_7b_lora.yaml --shape qwen2.5-7b --steps 10 --no-standalone --json-out $Q/lora7b_bypass.json --workdir $Q/w/lora7b_bypass algorithm.rollout_correction.bypass_mode=true
prof05_async|$P --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 6 --no-standalone --no-ledger --json-out $Q/prof05_async.json --workdir $Q/w/prof05_async trainer.async_rollout=true rollout.engine_in_trainer=true trainer.profile_steps=[5] trainer.profile_tools=[torch] trainer.profile_dir=$Q/w/prof_async && $PY scripts/trace_summary.py $Q/w/prof_async --top 25 --json-out $Q/prof05_async_summary.json
prof05_sync|$P --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 6 --no-standalone --no-ledger --json-out $Q/prof05_sync.json --workdir $Q/w/prof05_sync trainer.profile_steps=[5] trainer.profile_tools=[torch] trainer.profile_dir=$Q/w/prof_sync && $PY scripts/trace_summary.py $Q/w/prof_sync --top 25 --json-out $Q/prof05_sync_summary.json
prof05_async_helper|$P --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 6 --no-standalone --no-ledger --json-out $Q/prof05_async_helper.json --workdir $Q/w/prof05_async_helper trainer.async_rollout=true rollout.engine_in_trainer=false trainer.profile_steps=[5] trainer.profile_tools=[torch] trainer.profile_dir=$Q/w/prof_async_helper && $PY scripts/trace_summary.py $Q/w/prof_async_helper --top 25 --json-out $Q/prof05_async_helper_summary.json
prof05_helpers2|$P --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 6 --no-standalone --no-ledger --json-out $Q/prof05_helpers2.json --workdir $Q/w/prof05_helpers2 rollout.engine_processes=2 rollout.engine_in_trainer=false trainer.profile_steps=[5] trainer.profile_tools=[torch] trainer.profile_dir=$Q/w/prof_helpers2 && $PY scripts/trace_summary.py $Q/w/prof_helpers2 --top 25 --json-out $Q/prof05_helpers2_summary.json
prof05_py|$P --config configs/gsm8k_qwen2.5_0.5b.yaml --shape qwen2.5-0.5b --steps 6 --no-standalone --no-ledger --json-out $Q/prof05_py.json --workdir $Q/w/prof05_py trainer.profile_steps=[5] trainer.profile_tools=[python] trainer.profile_dir=$Q/w/prof_py && cp $Q/w/prof_py/step_5/python_profile.txt $Q/prof05_py_profile.txt
sampling05|$PY scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 1 --tokens 256 --repeats 8 --profile-way no_logprobs,one_seed_flat --ledger $Q/results.jsonl --json-out $Q/sampling05.json --workdir $Q/w/sampling05
sampling05_mml|$PY scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 1 --tokens 256 --repeats 8 --ways no_logprobs,one_seed_flat --max-model-len 768 --ledger $Q/results.jsonl --json-out $Q/sampling05_mml.json --workdir $Q/w/sampling05_mml
knobs05_default|$PY scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 1 --tokens 256 --repeats 8 --ways no_logprobs --max-model-len 768 --ledger $Q/results.jsonl --json-out $Q/knobs05_default.json --workdir $Q/w/knobs
knobs05_sync|$PY scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 1 --tokens 256 --repeats 8 --ways no_logprobs --max-model-len 768 --engine-kwargs '{"async_scheduling": false}' --ledger $Q/results.jsonl --json-out $Q/knobs05_sync.json --workdir $Q/w/knobs
knobs05_noprefix|$PY scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 1 --tokens 256 --repeats 8 --ways no_logprobs --max-model-len 768 --no-prefix-caching --ledger $Q/results.jsonl --json-out $Q/knobs05_noprefix.json --workdir $Q/w/knobs
knobs05_sync_noprefix|$PY scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 1 --tokens 256 --repeats 8 --ways no_logprobs --max-model-len 768 --no-prefix-caching --engine-kwargs '{"async_scheduling": false}' --ledger $Q/results.jsonl --json-out $Q/knobs05_sync_noprefix.json --workdir $Q/w/knobs
pin05_all|lscpu; lscpu -e; $PIN --json-out $Q/pin05_all.json
pin05_1|$PIN --cpus 3 --json-out $Q/pin05_1.json
pin05_2|$PIN --cpus 2,3 --json-out $Q/pin05_2.json
pin05_4|$PIN --cpus 0-3 --json-out $Q/pin05_4.json
engines05|$PY scripts/bench_vllm_engines.py --shape qwen2.5-0.5b --prompts 256 --tokens 256 --engines 1,2,4 --max-model-len 768 --no-prefix-caching --engine-kwargs '{"async_scheduling": false}' --ledger $Q/results.jsonl --json-out $Q/engines05.json --workdir $Q/w/engines05
engines05_async|$PY scripts/bench_vllm_engines.py --shape qwen2.5-0.5b --prompts 256 --tokens 256 --engines 2,1 --max-model-len 768 --no-prefix-caching --ledger $Q/results.jsonl --json-out $Q/engines05_async.json --workdir $Q/w/engines05
engines05_mps|export CUDA_MPS_PIPE_DIRECTORY=$Q/mps CUDA_MPS_LOG_DIRECTORY=$Q/mps && mkdir -p $Q/mps && nvidia-cuda-mps-control -d && $PY scripts/bench_vllm_engines.py --shape qwen2.5-0.5b --prompts 256 --tokens 256 --engines 1,2,4 --max-model-len 768 --no-prefix-caching --engine-kwargs '{"async_scheduling": false}' --ledger $Q/results.jsonl --json-out $Q/engines05_mps.json --workdir $Q/w/engines05; rc=\$?; echo quit | nvidia-cuda-mps-control; exit \$rc
sampling05_n5|$PY scripts/bench_vllm_sampling.py --shape qwen2.5-0.5b --prompts 256 --n 5 --tokens 256 --repeats 4 --profile-way no_logprobs --ledger $Q/results.jsonl --json-out $Q/sampling05_n5.json --workdir $Q/w/sampling05_n5
EOF
  # one job per config check (scripts/check_configs.py's names): check_<name> (3 steps, the `config_check` row), and
  # check10_<name> (10 steps: the `config_check` row and the run's own `ppo_step` row from one start)
  # (scripts/check_configs.py's list, so that a check added there is a job here)
  for c in $($PY scripts/check_configs.py --list | cut -d' ' -f1); do
    echo "check_$c|$PY scripts/check_configs.py --only $c --steps 3 --timeout 900 --ledger $Q/results.jsonl --workdir $Q/cc"
    echo "check10_$c|$PY scripts/check_configs.py --only $c --steps 10 --step-rows --timeout 1500 --ledger $Q/results.jsonl --workdir $Q/cc"
    # the same from the baseline tree (.base.tgz; the queue's *_base jobs above): another commit's code on one machine
    echo "check10_${c}_base|cd /tmp/base && JAXPPO_COMMIT=\$(cat /tmp/base/.commit) $PY scripts/check_configs.py --only $c --steps 10 --step-rows --timeout 1500 --ledger $Q/results.jsonl --workdir $Q/cc_base"
  done
}

chosen() {  # the queue's runs named in $JOBS (comma-separated, in that order), or all of them
  if [ -z "${JOBS:-}" ]; then queue; return; fi
  for j in ${JOBS//,/ }; do queue | grep "^$j|"; done
}

run_queue() {
  chosen | while IFS='|' read -r name cmd; do
    # a job that needs vLLM waits for the kit (its last part may arrive after the queue started: on 2026-12-06 a
    # config check queued after a 54 s JAX-only job started before it and ended at once, no module named vllm)
    case "$name" in *buffers*|mpsprio) ;; *)
      n=0; while [ ! -f /tmp/site/.kit-ready ] && [ $n -lt 120 ]; do sleep 5; n=$((n + 1)); done ;;
    esac
    echo "$(date +%T) start $name" >> $Q/summary.log
    t0=$(date +%s)
    # a job past JOB_TIMEOUT gets SIGABRT (its process group): Python's faulthandler (PYTHONFAULTHANDLER, set at
    # start) writes every thread's stack into the job's log, and the queue goes on to the next job
    timeout -s ABRT --kill-after=30 "${JOB_TIMEOUT:-1500}" bash -c "$cmd" > $Q/$name.log 2>&1
    rc=$?
    echo "$(date +%T) end $name rc=$rc $(( $(date +%s) - t0 )) s" >> $Q/summary.log
  done
  touch $Q/done
}

collect() {
  cp $Q/summary.log $Q/results.jsonl $OUT/ 2>/dev/null
  tar czf $OUT/logs_partial.tgz -C $Q --exclude=w --exclude="cc/*/*" . 2>/dev/null && mv $OUT/logs_partial.tgz $OUT/logs.tgz
  cat $Q/summary.log
  for f in $Q/*.log; do
    echo "== $f"; grep -v -E "INFO vllm|WARNING vllm|^\{\"step\"" "$f" | tail -12
  done
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
}

if [ "$mode" = start ]; then
  : "${JAXPPO_COMMIT:?set JAXPPO_COMMIT to the commit under test}"
  rm -rf $Q && mkdir -p $Q/w && touch $Q/summary.log
  mkdir -p /tmp/whl && $PY -m pip install -q --no-index --no-deps --upgrade --target /tmp/whl .whl/*.whl
  if [ -f .base.tgz ]; then  # a baseline tree for the *_base jobs
    rm -rf /tmp/base && tar xzf .base.tgz -C /tmp
    echo "baseline tree: $(cat /tmp/base/.commit)"
  fi
  export JAXPPO_COMMIT PYTHONPATH=/tmp/site:/tmp/whl:. PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 NCCL_NVLS_ENABLE=0 \
    VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_ENABLE_V1_MULTIPROCESSING=0
  nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
  export -f run_queue queue chosen
  export Q PY JOBS JOB_TIMEOUT
  setsid bash -c run_queue > $Q/queue.out 2>&1 < /dev/null &
  echo "queue started: $(chosen | cut -d'|' -f1 | tr '\n' ' ')"
else
  limit=${2:-560}
  # a machine that went back between calls comes back bare: say so at once instead of waiting on nothing
  [ -e $Q/summary.log ] || { echo "no queue on this machine (started bare?): start it again"; exit 3; }
  t0=$(date +%s)
  # the results so far go to $OUT every 30 s as well: a call cut off (its limit, or the device time left
  # running out) still brings back what it had there, not nothing
  n=0
  while [ ! -e $Q/done ] && [ $(( $(date +%s) - t0 )) -lt "$limit" ]; do
    sleep 5; n=$((n + 1))
    [ $((n % 6)) -eq 1 ] && collect > /dev/null 2>&1
  done
  collect
fi
