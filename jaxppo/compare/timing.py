"""`compare ppo-step --time`: the median wall time of each phase in each framework, same call."""

from __future__ import annotations

import time

import numpy as np

from jaxppo.compare.models import actor_part, critic_part


def _median_time(fn, repeats: int, sync) -> float:
    fn()
    sync()  # warm-up (compiles)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def time_phases(args, actor, critic, a_state, c_state, sharded, jax_batches, adv_fn, rewards, rmask, J, T, t_actor,
                t_critic, a_opt, c_opt, tb, torch_batches, t_rewards, cfg, R, temp, autocast, a_lr, c_lr) -> dict:
    """Median wall time of each phase, each framework, same call. Updates run on the evolving states."""
    import jax
    import jax.numpy as jnp
    import torch

    from bridge import reference as ref_torch

    state = {"a": a_state, "c": c_state}
    out = {"jax": {}, "torch": {}}
    last = {}

    def jsync():
        jax.block_until_ready(last.get("x"))

    def upd(kind):
        engine, select = (actor, actor_part) if kind == "a" else (critic, critic_part)
        for part in jax_batches():
            state[kind], last["x"] = engine.update(state[kind], engine.shard_batch(select(part)))

    jx = {"old_log_prob": lambda: last.__setitem__("x", actor.logprobs(state["a"].params, sharded)),
          "values": lambda: last.__setitem__("x", critic.values(state["c"].params, sharded)),
          "adv": lambda: last.__setitem__("x", adv_fn(jnp.asarray(rewards), jnp.asarray(rmask),
                                                      jnp.asarray(J["values"]))),
          "update_critic": lambda: upd("c"), "update_actor": lambda: upd("a")}
    for name, fn in jx.items():
        out["jax"][name] = _median_time(fn, args.repeats, jsync)

    cuda = tb["input_ids"].is_cuda
    tsync = torch.cuda.synchronize if cuda else (lambda: None)

    def t_no_grad(fn):
        def run():
            with torch.no_grad():
                fn()
        return run

    tx = {"old_log_prob": t_no_grad(lambda: ref_torch.response_logprobs(t_actor, tb, R, temp, autocast)),
          "values": t_no_grad(lambda: ref_torch.response_values(t_critic, tb, R, autocast)),
          "adv": t_no_grad(lambda: ref_torch.gae(t_rewards, T["values"], tb["response_mask"], cfg.algorithm.gamma,
                                                 cfg.algorithm.lam)),
          "update_critic": lambda: [ref_torch.critic_update(t_critic, c_opt, p, cfg.critic, R, float(c_lr(0)),
                                                            args.micro_batches, autocast) for p in torch_batches()],
          "update_actor": lambda: [ref_torch.actor_update(t_actor, a_opt, p, cfg.actor, R, float(a_lr(0)),
                                                          args.micro_batches, temp, autocast) for p in torch_batches()]}
    for name, fn in tx.items():
        out["torch"][name] = _median_time(fn, args.repeats, tsync)
    out["speedup"] = {k: out["torch"][k] / out["jax"][k] for k in out["jax"]}
    return out
