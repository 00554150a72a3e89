"""LoRA: adapters on the Flax models, frozen base, merged push, PEFT parity, export and a real run.

References: float64 numpy for the merge, transformers + peft for the model and the PPO update, the base
model itself for step 0."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import traverse_util

from jaxppo.models import load_model
from jaxppo.models.hf_io import export_hf_arrays
from jaxppo.models.lora import PROJECTIONS, LoRAWeights, LoraSpec, adapter_params, is_adapter, parse_targets, split
from tests.bridge import engine_checks
from tests.bridge.test_push import destination, fused_reference

pytest.importorskip("peft")


def flat(tree) -> dict:
    return traverse_util.flatten_dict(tree)


def test_adapters_start_as_peft_does_and_step_zero_is_the_base_exactly(tiny_qwen):
    """A random (kaiming-uniform, bound 1/sqrt(in)), B zero; log-probs of the LoRA model bit-equal the base's."""
    spec = LoraSpec(8, 16.0)
    module, params, cfg = load_model(tiny_qwen, dtype=jnp.float32, lora=spec, rng=jax.random.PRNGKey(3))
    base_module, base, _ = load_model(tiny_qwen, dtype=jnp.float32)
    adapters, frozen = split(params, is_adapter)
    assert flat(frozen).keys() == flat(base).keys()
    for path, x in flat(adapters).items():
        x = np.asarray(x)
        assert x.dtype == np.float32
        if path[-1] == "lora_B":
            assert not x.any()
        else:  # [layers, r, in]
            bound = 1 / np.sqrt(x.shape[-1])
            assert 0 < np.abs(x).max() <= bound and np.abs(x).max() > 0.8 * bound and x.std() > 0.4 * bound
    n_adapters = sum(int(np.prod(x.shape)) for x in flat(adapters).values())
    assert n_adapters == adapter_params(cfg, spec)
    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, cfg.vocab_size, (3, 12)))
    pos = jnp.broadcast_to(jnp.arange(12), (3, 12))
    mask = jnp.ones((3, 12), jnp.int32)
    ours = module.apply({"params": params}, ids, pos, mask, method="forward_logits")
    plain = base_module.apply({"params": base}, ids, pos, mask, method="forward_logits")
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain))


def test_targets_and_logical_axes(tiny_qwen):
    """`all-linear` is the seven decoder projections; a list puts adapters on those only; adapters are sharded by
    the same rules table as the weight they adapt (their `in` / `out` axis like the weight's)."""
    from jaxppo import sharding as shd
    from jaxppo.models import abstract_params, build_model, load_config

    assert parse_targets("all-linear") == ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                           "down_proj")
    with pytest.raises(ValueError, match="unknown \\['lm_head'\\]"):
        parse_targets("q_proj,lm_head")
    cfg, _ = load_config(tiny_qwen)
    spec = LoraSpec(4, 8.0, ("q_proj", "down_proj"))
    boxed = abstract_params(build_model(cfg, lora=spec))
    names = {p[-2] for p in flat(boxed) if is_adapter(p)}
    assert names == {"q_proj", "down_proj"}
    mesh = shd.make_mesh({"fsdp": 2, "tensor": 2}, devices=jax.devices()[:4])
    specs = flat(shd.param_shardings(boxed, mesh))
    for proj in ("self_attn", "q_proj"), ("mlp", "down_proj"):
        w = specs[("model", "layers", *proj, "weight")].spec
        a = specs[("model", "layers", *proj, "lora_A")].spec
        b = specs[("model", "layers", *proj, "lora_B")].spec
        assert a[-1] == w[-1] and b[-2] == w[-2] and a[-2] is None and b[-1] is None, (proj, w, a, b)
        assert any(x is not None for x in w)  # the rules really shard this weight on this mesh


def test_merged_push_is_float64_exact_and_one_layer_at_a_time(tmp_path):
    """LoRAWeights: every adapted tensor is W + (alpha / r) B A (float64 reference), the rest the base's; pushed
    into vLLM's fused layout by DirectCopy.push_items with at most one merged layer alive at a time."""
    from bridge.push import DirectCopy
    from tests.helpers import make_hf_checkpoint

    model_dir = make_hf_checkpoint(tmp_path / "m", "qwen2", num_hidden_layers=4)
    module, full, base, adapters, scale = engine_checks.lora_case(model_dir)
    weights = LoRAWeights(base, adapters, scale, jnp.float32)
    got = {n: np.asarray(a, np.float64) for n, a in weights}
    plain = {n: np.asarray(a, np.float64) for n, a in export_hf_arrays(base, jnp.float32)}
    ad = {n: np.asarray(a, np.float64) for n, a in export_hf_arrays(adapters, jnp.float32)}
    assert got.keys() == plain.keys()
    adapted = 0
    for name, w in plain.items():
        stem = name.removesuffix(".weight")
        if f"{stem}.lora_A" in ad:
            want = w + scale * ad[f"{stem}.lora_B"] @ ad[f"{stem}.lora_A"]
            adapted += 1
        else:
            want = w
        np.testing.assert_allclose(got[name], want, rtol=1e-6, atol=1e-6, err_msg=name)
    assert adapted == 4 * 7

    ref = fused_reference({n: a.astype(np.float32) for n, a in got.items()})
    dst = destination(ref, torch.float32)
    plan = DirectCopy(dst, weights.shapes())
    layer_bytes = max(int(np.prod(a.shape)) * 4 for n, a in got.items() if ".layers." in n)

    def held() -> int:  # bytes of the distinct device buffers alive (an Array and its views counted once)
        return sum({s.data.unsafe_buffer_pointer(): s.data.nbytes for a in jax.live_arrays()
                    for s in a.addressable_shards}.values())

    baseline = held()
    extra = []

    def watched():
        for item in weights.items():
            extra.append(held() - baseline)
            yield item
            del item

    assert plan.push_items(weights.params, watched()) == len(got)
    for name, want in ref.items():
        np.testing.assert_allclose(dst[name].numpy(), want, rtol=0, atol=0, err_msg=name)
    stacked_bytes = 4 * layer_bytes  # a whole stacked projection of this 4-layer model
    assert 0 < max(extra) <= layer_bytes < stacked_bytes, (max(extra), layer_bytes)


def run_compare(model, capsys, *overrides) -> dict:
    from jaxppo.compare import main

    assert main(["ppo-step", "--model", str(model), "--batch", "32", "--seed", "3", "actor.optim.lr=1e-3",
                 "critic.optim.lr=1e-3", *overrides]) == 0
    return {r["quantity"]: r for r in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]}


@pytest.mark.parametrize("extra", [[], ["critic.lora_rank=4", "critic.lora_alpha=8", "actor.target_modules=q_proj,"
                                        "v_proj,down_proj", "actor.use_kl_loss=true", "actor.kl_loss_coef=0.1",
                                        "actor.kl_loss_type=full"]])
def test_compare_ppo_step_matches_torch_with_peft(extra, tiny_qwen, capsys):
    """`compare ppo-step actor.lora_rank=8 actor.lora_alpha=16` against transformers + peft from the same adapter
    initialisation: log-probs, losses, gradient norms, gradients and the adapters' updates within 1e-4."""
    rows = run_compare(tiny_qwen, capsys, "actor.lora_rank=8", "actor.lora_alpha=16", *extra)
    assert rows["actor/pg_clipfrac[1]"]["torch"] >= 0 and rows["actor/ppo_kl[1]"]["torch"] != 0  # moved
    bad = {q: r["rel_diff"] for q, r in rows.items() if r["rel_diff"] > 1e-4}  # param_update included
    assert not bad, bad
    for name in ("old_logprobs", "actor/pg_loss[1]", "actor/grad_norm[1]", "actor/gradient[1]", "actor/param_update",
                 "critic/param_update"):
        assert name in rows and rows[name]["torch"] != 0, name
    if extra:  # the reference is the base (adapters off): the KL loss is positive once the adapters moved
        assert rows["actor/kl_loss[1]"]["torch"] > 0 and rows["ref_logprobs"]["rel_diff"] <= 1e-4


def test_compare_refuses_a_reference_under_lora(tiny_qwen, capsys):
    from jaxppo.compare import main

    assert main(["ppo-step", "--model", str(tiny_qwen), "--ref", str(tiny_qwen), "--batch", "32", "actor.lora_rank=8",
                 "actor.use_kl_loss=true"]) == 2
    assert "the reference policy is the base model" in capsys.readouterr().err


def test_state_holds_adapters_only_with_the_base_frozen_in_the_compute_dtype(tiny_qwen):
    """The train state: adapters + AdamW moments (3 x 4 bytes per adapter parameter); the base lives in
    `engine.frozen` in the compute dtype; what jaxppo.memory predicts per component is what is held."""
    from jaxppo.config import load_config
    from jaxppo.engine import ActorEngine
    from jaxppo.memory import state_bytes
    from jaxppo.models import load_config as load_model_config
    from jaxppo.sharding import make_mesh

    cfg = load_config(None, ["actor.lora_rank=8", "actor.use_kl_loss=true", "model.dtype=bfloat16"])
    mcfg, _ = load_model_config(tiny_qwen)
    spec = LoraSpec(8, 16.0)
    module, params, _ = load_model(tiny_qwen, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, lora=spec)
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    actor = ActorEngine(module, mesh, cfg.actor, 8, trainable=is_adapter)
    state = actor.init_state(params)
    nbytes = lambda tree: sum(x.nbytes for x in jax.tree.leaves(tree) if hasattr(x, "nbytes") and x.ndim)  # noqa
    assert all(is_adapter(p) for p in flat(state.params))
    assert {x.dtype for x in jax.tree.leaves(actor.frozen)} == {jnp.dtype(jnp.bfloat16)}
    want = state_bytes(cfg, mcfg, None, 1)
    assert "reference (compute dtype)" not in want  # the reference is the base, no copy
    assert nbytes(state.params) + nbytes(state.opt_state) == want["actor adapters (fp32 + AdamW)"]
    assert nbytes(actor.frozen) == want["actor base (frozen, compute dtype)"]


def test_the_reference_under_lora_is_the_base_module_without_the_adapters_matmuls(tiny_qwen):
    """LoRA's reference policy is the base: `ref_logprobs` runs the module without adapters on the frozen weights,
    giving the log-probs of the actor's forward with the adapters zeroed, with none of the adapters' matmuls in
    its program; and its own program, compiled once."""
    from jaxppo.config import load_config
    from jaxppo.engine import ActorEngine
    from jaxppo.models.lora import zeros_like_adapters
    from jaxppo.sharding import make_mesh
    from scripts.bench_update import synthetic_batch

    cfg = load_config(None, ["actor.lora_rank=8"])
    module, params, mcfg = load_model(tiny_qwen, dtype=jnp.float32, param_dtype=jnp.float32, lora=LoraSpec(8, 16.0))
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    actor = ActorEngine(module, mesh, cfg.actor, 8, trainable=is_adapter)
    state = actor.init_state(params)
    # adapters that move the policy, so that the actor's log-probs differ from the reference's
    trained = jax.tree.map(lambda a: a + 0.05, state.params)
    zeros = zeros_like_adapters(state.params)
    batch = actor.shard_batch(synthetic_batch(mcfg, 8, 16, 8))
    ref = np.asarray(actor.ref_logprobs(zeros, batch))
    with_zero_adapters = np.asarray(actor.logprobs(zeros, batch)[0])
    np.testing.assert_allclose(ref, with_zero_adapters, rtol=0, atol=2e-6)
    assert np.abs(np.asarray(actor.logprobs(trained, batch)[0]) - ref).max() > 1e-3
    assert np.asarray(actor.ref_logprobs(trained, batch)).tolist() == ref.tolist()  # the adapters are not read

    def dots(program, *static):
        with actor._ctx():
            return program.jitted.lower(zeros, actor.frozen, batch, *static).as_text().count("dot_general")

    # the layers' loop body: the actor's forward (no entropy, no truncation) has each projection's base matmul and
    # two for its adapter, the base program the base matmuls alone
    with_adapters = dots(actor.forward_program(zeros), False, None)
    assert with_adapters - dots(actor.base_program()) == 2 * len(PROJECTIONS)
    assert actor.base_program().compiles() == 1 and actor.base_program() in actor.programs()


@pytest.mark.parametrize("tied", [False, True])
def test_the_frozen_head_costs_no_weight_gradient_under_lora(tiny_qwen, tmp_path, tied):
    """`head_logits`' backward computes the [vocab, d] gradient of the head's master weights; under LoRA the head is
    frozen (outside the differentiated parameters), so that GEMM must leave the compiled update: at 7B it would be
    a vocabulary head's worth of FLOPs per token (152k x 3584) for a gradient thrown away. Full fine-tuning keeps
    it, which shows the count below sees it."""
    from jaxppo.accumulate import minibatch_gradients
    from jaxppo.config import load_config
    from jaxppo.engine import ActorEngine
    from jaxppo.sharding import make_mesh
    from scripts.bench_update import synthetic_batch
    from tests.helpers import make_hf_checkpoint

    path = make_hf_checkpoint(tmp_path, "qwen2", tie=True) if tied else tiny_qwen
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])

    def head_gradient_dots(lora: bool) -> int:
        cfg = load_config(None, ["actor.lora_rank=8"] if lora else [])
        module, params, mcfg = load_model(path, dtype=jnp.float32, param_dtype=jnp.float32,
                                          lora=LoraSpec(8 if lora else 0, 16.0))
        actor = ActorEngine(module, mesh, cfg.actor, 8, trainable=is_adapter if lora else None)
        state = actor.init_state(params)
        batch = actor.shard_batch(synthetic_batch(mcfg, 8, 16, 8))
        actor._remember_specs(state.params)
        fn = jax.jit(lambda p, b, e: minibatch_gradients(actor, actor._loss, p, b, e)[0])
        with actor._ctx():
            hlo = fn.lower(state.params, batch, actor._extra(None)).compile().as_text()
        v, d = mcfg.vocab_size, mcfg.hidden_size
        return sum(1 for line in hlo.splitlines() if " dot(" in line and f"f32[{v},{d}]" in line.split("=")[1][:40])

    assert head_gradient_dots(lora=False) >= 1
    assert head_gradient_dots(lora=True) == 0


# ------------------------------------------------------------------ a real run of the embedded default

LORA = ["actor.lora_rank=16", "actor.lora_alpha=32", "actor.optim.lr=3e-3"]


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """The embedded default with LoRA for 10 steps, killed (SIGKILL) two steps after its step-5 checkpoint and
    resumed by the same command: (run dir, the resumed process's output, the killed process's records: a resumed
    run drops the lines past its checkpoint and writes those steps again)."""
    import signal

    from tests.train_helpers import (all_records, logged_step, run_train, seed_warm_start, shared_tmp, start_train,
                                     wait_until)

    run = tmp_path_factory.mktemp("lora") / "run"
    common = [*LORA, "trainer.total_training_steps=10", "trainer.test_freq=10", "trainer.save_freq=5",
              "trainer.logger=[jsonl]"]
    seed_warm_start(run, shared_tmp(tmp_path_factory), *common)  # the default's warm start (full fine-tuning)
    proc = start_train(run, *common, optimized=True)  # compiled as the learning runs are (tests/train_helpers.py)
    wait_until(lambda: (run / "checkpoints" / "5").is_dir() and logged_step(run, 7), proc, "step 7", 900)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed = all_records(run, killed=True)  # a SIGKILL may cut the line it interrupts
    res = run_train(run, *common, timeout=900, optimized=True)
    return run, res.stdout + res.stderr, killed


@pytest.mark.slow
def test_lora_default_learns_and_resumes_exactly_after_a_kill(lora_run):
    from tests.train_helpers import all_records, assert_resumed_at_checkpoint, assert_same_step

    run, output, killed = lora_run
    resumed = assert_resumed_at_checkpoint(run, output)
    assert resumed == 5
    records = all_records(run)
    assert [r["step"] for r in records] == sorted({r["step"] for r in records})  # each step once
    by_step = {r["step"]: r for r in records}
    replayed = [r for r in killed if r["step"] > resumed]
    assert replayed, "the killed process logged no step after its checkpoint"
    for old in replayed:  # the resumed process repeats those steps exactly
        assert_same_step(old, by_step[old["step"]], old["step"])
    val = {r["step"]: r["val/score"] for r in records if "val/score" in r}
    # seen at step 0 -> 10: 0.27 -> 0.45 (AMD EPYC with AVX-512, the 80-step run of docs/benchmarks/learning/
    # cpu_lora_2026-12-01), 0.352 -> 0.422 (AMD EPYC without AVX-512, 2026-12-03: XLA's CPU numerics differ between
    # the two, the warm start with them). Greedy validation of adapters that did not train would not move at all.
    assert val[0] > 0.1 and val[10] >= val[0] + 0.05, val
    ckpt = run / "checkpoints" / "10" / "actor"
    size = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file())
    full = 3 * sum(f.stat().st_size for f in (run / "init_model").glob("*.safetensors"))  # fp32 weights + 2 moments
    assert size < 0.5 * full, (size, full)  # adapters + their moments, not the model


@pytest.mark.slow
def test_export_merges_and_writes_a_peft_adapter(lora_run, tmp_path):
    """`python -m jaxppo.export --peft`: the merged model and PEFT's adapter give the same logits (<= 1e-4)."""
    import peft
    from transformers import AutoModelForCausalLM

    from jaxppo.export import main as export_main

    run = lora_run[0]
    assert export_main(["--ckpt", str(run / "checkpoints" / "10"), "--out", str(tmp_path / "hf"), "--peft"]) == 0
    config = json.loads((tmp_path / "hf" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["lora_alpha"] == 32 and config["base_model_name_or_path"].endswith("warm_model")
    base = AutoModelForCausalLM.from_pretrained(run / "warm_model", dtype=torch.float32)
    with_adapter = peft.PeftModel.from_pretrained(base, tmp_path / "hf" / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    ids = torch.as_tensor(np.random.default_rng(0).integers(0, merged.config.vocab_size, (2, 16)))
    with torch.no_grad():
        a, b = with_adapter(ids).logits, merged(ids).logits
        with with_adapter.disable_adapter():
            c = with_adapter(ids).logits
    assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    assert (a - c).abs().max() > 1e-2  # the adapters were trained (the export is not the base)


def test_the_exact_kl_to_the_base_under_lora_needs_no_reference_arrays(tiny_qwen):
    """actor.kl_loss_type=full under LoRA: the run's reference is {} (nothing held); the update runs the base module
    on the frozen weights as the reference, whose per-token KL equals that to the adapters zeroed through the adapted
    module (the definition) within float32 rounding; the KL is 0 at the base itself and positive once the adapters
    have moved. (The float64 comparison with torch, tests/test_compare_float64.py, checks the update under it.)"""
    from jaxppo.config import load_config
    from jaxppo.engine import ActorEngine, response_head
    from jaxppo.models.lora import merge, zeros_like_adapters
    from jaxppo.sharding import make_mesh
    from scripts.bench_update import synthetic_batch

    cfg = load_config(None, ["actor.lora_rank=8", "actor.use_kl_loss=true", "actor.kl_loss_type=full",
                             "actor.kl_loss_coef=0.1", "actor.ppo_micro_batch_size_per_device=4"])
    module, params, mcfg = load_model(tiny_qwen, dtype=jnp.float32, param_dtype=jnp.float32, lora=LoraSpec(8, 16.0))
    mesh = make_mesh({"data": 1}, devices=jax.devices()[:1])
    actor = ActorEngine(module, mesh, cfg.actor, 8, trainable=is_adapter)
    batch = actor.shard_batch(synthetic_batch(mcfg, 8, 16, 8))
    kl = {}
    for moved in (False, True):
        state = actor.init_state(jax.tree.map(jnp.copy, params))
        if moved:  # adapters away from the base (lora_B starts at zero)
            state = state.replace(params=jax.tree.map(lambda a: a + 0.05, state.params))
        policy = merge(state.params, actor.frozen)
        head = dict(response_length=8, chunk_size=4, with_entropy=False)
        base = response_head(module, policy, batch, ref_params=actor.frozen, ref_module=actor.base_module, **head)
        zeroed = response_head(module, policy, batch, ref_params=merge(zeros_like_adapters(state.params), actor.frozen),
                               **head)
        np.testing.assert_allclose(np.asarray(base["kl_full"]), np.asarray(zeroed["kl_full"]), atol=1e-6)
        _, m = actor.update(state, batch, {})
        kl[moved] = float(m["kl_loss"])
    assert abs(kl[False]) < 1e-6 and kl[True] > 1e-4, kl