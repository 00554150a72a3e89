"""Token-budget packing: packed and padded computation agree (log-probs, entropies, values, losses,
gradients, updated parameters), attention never crosses a segment, and the number of compiled programs
stays within the bucket bound over many random batches.

Tolerance: fp32, the same as the mesh-invariance tests (reductions run in a different order when the
sequences sit in different rows): 2e-5 on per-token outputs, 1e-5 relative on losses and grad norms."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxppo.accumulate import micro_batch_count
from jaxppo.config import ActorConfig, CriticConfig, OptimConfig
from jaxppo.engine import ActorEngine, CriticEngine
from jaxppo.models import load_model
from jaxppo.packing import bucket, first_fit_decreasing, max_programs, pack, row_lengths
from jaxppo.sharding import make_mesh

P, R = 12, 10
OPTIM = OptimConfig(lr=1e-2, weight_decay=0.01, grad_clip=1.0, eps=1e-3)  # eps: see tests/engine_case.py


def random_batch(vocab: int, b: int, seed: int, min_resp: int = 1) -> dict[str, np.ndarray]:
    """Left-padded prompts of 1..P tokens, right-padded responses of min_resp..R (some of length 1)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, vocab, (b, P + R)).astype(np.int32)
    plen = rng.integers(1, P + 1, b)
    rlen = rng.integers(min_resp, R + 1, b)
    rlen[: max(1, b // 8)] = 1
    mask = np.zeros((b, P + R), np.int32)
    for i in range(b):
        mask[i, P - plen[i]:P] = 1
        mask[i, P:P + rlen[i]] = 1
    rmask = mask[:, P:].astype(np.float32)
    return dict(input_ids=ids * mask, attention_mask=mask,
                positions=np.maximum(np.cumsum(mask, 1) - 1, 0).astype(np.int32), response_mask=rmask,
                old_logprobs=(rng.normal(size=(b, R)) * 0.1 - 4.6).astype(np.float32) * rmask,
                ref_logprobs=(rng.normal(size=(b, R)) * 0.1 - 4.6).astype(np.float32) * rmask,
                advantages=rng.normal(size=(b, R)).astype(np.float32) * rmask,
                values=rng.normal(size=(b, R)).astype(np.float32) * rmask,
                returns=rng.normal(size=(b, R)).astype(np.float32) * rmask)


def engines(ckpt, mesh, mode="token-mean"):
    acfg = ActorConfig(ppo_micro_batch_size_per_device=2, log_prob_micro_batch_size_per_device=2, logprob_chunk_size=4,
                       loss_agg_mode=mode, use_kl_loss=True, entropy_coeff=0.01, optim=OPTIM)
    ccfg = CriticConfig(ppo_micro_batch_size_per_device=2, log_prob_micro_batch_size_per_device=2, loss_agg_mode=mode,
                        optim=OPTIM)
    # the window (longest sequence) is what the trainer sets: packed rows are longer, so it is active there
    module, params, cfg = load_model(ckpt, mesh=mesh, dtype=jnp.float32, attention_window=P + R)
    cmodule, cparams, _ = load_model(ckpt, "value", mesh=mesh, dtype=jnp.float32, rng=jax.random.PRNGKey(1),
                                     attention_window=P + R)
    return (ActorEngine(module, mesh, acfg, R), params), (CriticEngine(cmodule, mesh, ccfg, R), cparams), cfg


@pytest.fixture(scope="module", params=[{"data": 1}, {"data": 2, "fsdp": 2}], ids=["1dev", "data2-fsdp2"])
def setup(request, tiny_qwen):
    shape = request.param
    n = int(np.prod(list(shape.values())))
    mesh = make_mesh(shape, devices=jax.devices()[:n])
    return engines(tiny_qwen, mesh), mesh


def test_first_fit_decreasing_fills_rows_within_budget():
    lengths = np.array([7, 3, 5, 2, 2, 9, 1, 4])
    bins = first_fit_decreasing(lengths, 10)
    assert sorted(i for b in bins for i in b) == list(range(8))
    assert all(lengths[b].sum() <= 10 for b in bins)
    assert len(bins) == int(np.ceil(lengths.sum() / 10))  # optimal here: 33 tokens in 4 rows


def test_forward_passes_match_padded(setup):
    ((actor, params), (critic, cparams), cfg), mesh = setup
    batch = random_batch(cfg.vocab_size, 16, seed=0)
    lp_pad, ent_pad = (np.asarray(x) for x in actor.logprobs(params, actor.shard_batch(batch), with_entropy=True))
    v_pad = np.asarray(critic.values(cparams, critic.shard_batch(batch)))
    packed = pack(batch, R, budget=24, shards=actor.batch_shards)
    assert packed.arrays["input_ids"].shape[-1] == 24 and packed.useful_tokens == batch["attention_mask"].sum()
    dev = actor.shard_packed(packed)
    lp, ent = (packed.unpack(np.asarray(x), 16) for x in actor.logprobs(params, dev, with_entropy=True))
    v = packed.unpack(np.asarray(critic.values(cparams, dev)), 16)
    m = batch["response_mask"] > 0
    np.testing.assert_allclose(lp[m], lp_pad[m], atol=2e-5)
    np.testing.assert_allclose(ent[m], ent_pad[m], atol=2e-5)
    np.testing.assert_allclose(v[m], v_pad[m], atol=2e-5)


# the three normalisers packing must count per segment or per batch (tokens; sequences, with each one's own token
# count; a constant); seq-mean-token-sum is seq-mean-token-mean's sequence count without the per-sequence one
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_updates_match_padded(tiny_qwen, mode):
    padded_against_packed(tiny_qwen, mode, {"data": 2})


@pytest.mark.parametrize("shape", [{"data": 1}, {"data": 2}], ids=["1dev", "data2"])
def test_packed_micro_batches_summed_by_the_host_match_the_padded_scan(tiny_qwen, shape):
    """model.micro_batch_loop=host on packed micro-batches (one program per micro-batch, indexed from the packed
    mini-batch) gives the padded scan's update, on one device and where each device sums its own rows."""
    padded_against_packed(tiny_qwen, "seq-mean-token-mean", shape, packed_loop="host")


def padded_against_packed(tiny_qwen, mode, shape, packed_loop="scan"):
    n = int(np.prod(list(shape.values())))
    mesh = make_mesh(shape, devices=jax.devices()[:n])
    (actor, params), (critic, cparams), cfg = engines(tiny_qwen, mesh, mode)
    batch = random_batch(cfg.vocab_size, 16, seed=1)
    out = {}
    for name in ("padded", "packed"):
        if name == "packed":
            actor.micro_batch_loop = critic.micro_batch_loop = packed_loop
            actor._update_jit = critic._update_jit = None  # built again with the loop asked for
        a_state = actor.init_state(jax.tree.map(jnp.copy, params))  # updates donate their state
        c_state = critic.init_state(jax.tree.map(jnp.copy, cparams))
        if name == "padded":
            a_state, am = actor.update(a_state, actor.shard_batch(batch))
            c_state, cm = critic.update(c_state, critic.shard_batch(batch))
        else:
            dev = actor.shard_packed(pack(batch, R, budget=24, shards=actor.batch_shards))
            assert micro_batch_count(actor, dev) > 1  # the loop really runs
            a_state, am = actor.update(a_state, dev)
            c_state, cm = critic.update(c_state, dev)
        out[name] = (jax.device_get(am), jax.device_get(cm), jax.device_get(a_state.params),
                     jax.device_get(c_state.params))
    (am0, cm0, ap0, cp0), (am1, cm1, ap1, cp1) = out["padded"], out["packed"]
    for k in ("pg_loss", "ppo_kl", "entropy", "kl_loss", "grad_norm", "pg_clipfrac"):
        np.testing.assert_allclose(am1[k], am0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for k in ("vf_loss", "grad_norm", "vpred_mean"):
        np.testing.assert_allclose(cm1[k], cm0[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert am0["grad_norm"] > 0
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=5e-5), ap1, ap0)
    jax.tree.map(lambda x, y: np.testing.assert_allclose(x, y, atol=5e-5), cp1, cp0)


def test_no_attention_across_segments(setup):
    ((actor, params), _, cfg), mesh = setup
    batch = random_batch(cfg.vocab_size, 16, seed=2)
    packed = pack(batch, R, budget=40, shards=actor.batch_shards)
    assert (packed.arrays["attention_mask"].max(-1) > 1).any()  # rows really hold several sequences
    base = packed.unpack(np.asarray(actor.logprobs(params, actor.shard_packed(packed))[0]), 16)
    victim = packed.members[0][0]  # first sequence of the first row: its tokens change
    poked = dict(batch, input_ids=batch["input_ids"].copy())
    valid = np.nonzero(batch["attention_mask"][victim])[0]
    poked["input_ids"][victim, valid] = (poked["input_ids"][victim, valid] + 7) % cfg.vocab_size
    packed2 = pack(poked, R, budget=40, shards=actor.batch_shards)
    assert packed2.members == packed.members  # same layout: same neighbours
    after = packed2.unpack(np.asarray(actor.logprobs(params, actor.shard_packed(packed2))[0]), 16)
    m = batch["response_mask"] > 0
    others = np.arange(16) != victim
    np.testing.assert_allclose(after[others][m[others]], base[others][m[others]], atol=1e-6)
    assert np.abs(after[victim] - base[victim])[m[victim]].max() > 1e-3  # the poked one did change


def test_compiled_programs_stay_within_buckets(tiny_qwen):
    mesh = make_mesh({"data": 2}, devices=jax.devices()[:2])
    (actor, params), _, cfg = engines(tiny_qwen, mesh)
    budget, b = 48, 16
    bound = max_programs(b, budget, shards=2)
    for seed in range(50):
        batch = random_batch(cfg.vocab_size, b, seed=100 + seed)
        jax.block_until_ready(actor.logprobs(params, actor.shard_packed(pack(batch, R, budget, shards=2))))
    assert 1 < len(actor.compiled_shapes) <= bound, (actor.compiled_shapes, bound)
    assert actor.compiles() == len(actor.compiled_shapes)  # jit really compiled once per bucket, no more


def test_row_length_computes_fewest_tokens():
    """The row length is one of the budget's steps, holds the longest sequence, and never computes more
    tokens than full-budget rows; on some batches strictly fewer."""
    budget, better = 48, 0
    for seed in range(30):
        batch = random_batch(101, 16, seed=seed)
        packed, full = pack(batch, R, budget, shards=2), pack(batch, R, budget, shards=2, row_len=budget)
        n, _, row, _ = packed.shape_key
        longest = int((batch["attention_mask"] > 0).sum(1).max())
        assert row in row_lengths(budget) and longest <= row <= budget
        assert packed.arrays["input_ids"].shape[2] == row and full.shape_key[2] == budget
        computed, computed_full = n * 2 * row, full.shape_key[0] * 2 * budget
        assert packed.useful_tokens == full.useful_tokens <= computed <= computed_full
        better += computed < computed_full
    assert better > 0


def test_known_shapes_are_reused_when_nearly_as_cheap():
    """Batches of slightly different sizes reuse a shape packed before (no new program) as long as it computes
    at most REUSE_SLACK more tokens than the best layout; without `known`, they spread over more shapes."""
    from jaxppo.packing import REUSE_SLACK

    budget = 48
    fresh, known = set(), set()
    for seed in range(40):
        batch = random_batch(101, 16, seed=seed)
        best = pack(batch, R, budget, shards=2)
        fresh.add(best.shape_key)
        reused = pack(batch, R, budget, shards=2, known=known)
        known.add(reused.shape_key)
        n0, s0, w0, r0 = best.shape_key
        n1, s1, w1, r1 = reused.shape_key
        assert reused.useful_tokens == best.useful_tokens  # the same sequences, just other row counts / lengths
        assert n1 * w1 <= (1 + REUSE_SLACK) * n0 * w0 + 1e-9
        # unpacking what the rows would compute gives back the padded layout exactly
        x = np.arange(np.prod(reused.arrays["gather_idx"].shape), dtype=np.float32).reshape(
            reused.arrays["gather_idx"].shape)
        assert (reused.unpack(x, 16)[batch["response_mask"] > 0] >= 0).all()
    assert len(known) < len(fresh), (len(known), len(fresh))


def test_sequence_longer_than_budget_is_a_clear_error(tiny_qwen):
    batch = random_batch(101, 4, seed=3)
    with pytest.raises(ValueError, match=r"sequence \d+ has \d+ tokens, more than actor.ppo_max_token_len"):
        pack(batch, R, budget=4, shards=1)


@pytest.mark.slow
def test_trainer_step_packed_equals_padded(tmp_path):
    """The same first PPO step (same rollouts) padded and packed: same losses, KL, grad norms."""
    from tests.test_operability import make_trainer
    from tests.train_helpers import read_metrics

    packed_kw = ["actor.use_dynamic_bsz=true", "critic.use_dynamic_bsz=true",
                 "actor.ppo_max_token_len_per_device=128", "actor.log_prob_max_token_len_per_device=256",
                 "critic.ppo_max_token_len_per_device=128", "critic.forward_max_token_len_per_device=256"]
    runs = {}
    for name, extra in (("padded", []), ("packed", packed_kw)):
        tr = make_trainer(tmp_path / name, "trainer.total_training_steps=2", "trainer.logger=[jsonl]", *extra)
        tr.fit()
        runs[name] = read_metrics(tmp_path / name / "run")
    a, b = runs["padded"][1], runs["packed"][1]
    assert b["perf/compiles"] >= 1
    for k in ("critic/score/mean", "actor/pg_loss", "actor/ppo_kl", "actor/entropy", "actor/grad_norm",
              "critic/vf_loss", "critic/grad_norm", "critic/values/mean", "rollout/logprob_diff_mean"):
        assert b[k] == pytest.approx(a[k], rel=1e-4, abs=1e-6), k


def test_response_tokens_spread_over_rows():
    """The slots (vocabulary-projection width) are the most response tokens any row holds: spreading the
    sequences by response tokens never needs more slots than first-fit decreasing, fewer on some batches,
    and keeps every row within its length."""
    from jaxppo.packing import _layout, bucket

    fewer = 0
    for seed in range(30):
        batch = random_batch(101, 32, seed=seed)
        lengths = (batch["attention_mask"] > 0).sum(1)
        rlen = (batch["response_mask"] > 0).sum(1)
        packed = pack(batch, R, budget=64, shards=2)
        n, slots, row, _ = packed.shape_key
        bins, _, _ = _layout(lengths, 64, 2, 1, None)
        ffd_slots = bucket(max(int(rlen[m].sum()) for m in bins))
        per_row = packed.arrays["response_mask"].reshape(n * 2, slots).sum(-1)
        assert slots == bucket(int(per_row.max())) <= ffd_slots
        assert (packed.arrays["attention_mask"] > 0).reshape(n * 2, row).sum(-1).max() <= row
        assert sorted(i for m in packed.members for i in m) == list(range(32))
        fewer += slots < ffd_slots
    assert fewer > 0


def test_rows_hold_no_more_than_the_planned_shape():
    """With the plan's shape as caps, a batch of many short sequences (more runs and slots per row than the plan
    compiled for) gets more rows instead: every row within the caps' slots, length and runs, every sequence
    packed once, and the planned shape itself reused when it costs little more; without caps the same batches
    exceed the caps (so the test can fail)."""
    from jaxppo.packing import Caps

    budget, shards = 48, 2
    caps = Caps(slots=12, row_len=42, runs=4)  # a plan's worst case: 3 sequences of up to 14 tokens per row
    planned = (3, caps.slots, caps.row_len, caps.runs)
    exceeded = 0
    for seed in range(30):
        batch = random_batch(101, 16, seed=seed)  # prompts of 1..12, responses of 1..10 tokens: up to 20 per row
        free = pack(batch, R, budget, shards)
        held = pack(batch, R, budget, shards, known={planned}, caps=caps)
        n, slots, row, runs = held.shape_key
        assert slots <= caps.slots and row <= caps.row_len and runs <= caps.runs, held.shape_key
        members = sorted(i for m in held.members for i in m)
        assert members == list(range(16))
        lengths = (batch["attention_mask"] > 0).sum(1)
        assert all(lengths[m].sum() <= row and len(m) <= runs for m in held.members)
        _, fs, fr, fruns = free.shape_key
        exceeded += fs > caps.slots or fr > caps.row_len or fruns > caps.runs
        x = np.arange(np.prod(held.arrays["gather_idx"].shape), dtype=np.float32).reshape(
            held.arrays["gather_idx"].shape)
        assert (held.unpack(x, 16)[batch["response_mask"] > 0] >= 0).all()  # every response token has a slot
    assert exceeded > 10, exceeded


def test_row_allowance_is_the_most_a_row_can_hold():
    """The plan's slots per row: the most response tokens any set of sequences (prompt >= the shortest, response
    1..R) fitting a row of that length holds, found by brute force; its runs: the sequences of half-length
    responses at the shortest prompt."""
    from jaxppo.plan_search import row_allowance

    for row_len in range(1, 80, 3):
        for shortest in (1, 2, 5):
            for resp in (1, 4, 7):
                for seqs in (1, 3, 50):
                    best = max((min(k * resp, row_len - k * shortest) for k in range(1, seqs + 1)
                                if k * (shortest + 1) <= row_len), default=1)
                    slots, runs = row_allowance(row_len, shortest, resp, seqs)
                    assert slots == max(best, 1), (row_len, shortest, resp, seqs, slots, best)
                    assert runs == max(min(seqs, row_len // (shortest + max(resp // 2, 1))), 1)


@pytest.mark.parametrize("budget, planned_rows", [(12288, (3, 6144, 7680)), (9216, (4, 5120, 5760))])
def test_full_length_responses_pack_into_the_planned_shape(budget, planned_rows):
    """What the H200 showed (9be2f87, the 7B LoRA recipe's 64 x 4 sequences, prompts of 77-83 tokens, 256-token
    responses; budgets 12288 and 9216, the 7B's and Qwen3-8B's): the plan's worst case packs into rows shorter than
    the budget, and a batch of full-length responses at the data's prompts must pack into the very shape the plan
    compiled, or the run compiles another update in its first step. Sizing the slots by the budget planned 3 x
    10240 (4 x 7168) and the run packed 3 x 6144 (4 x 4096)."""
    from types import SimpleNamespace

    from jaxppo.packing import Caps
    from jaxppo.plan_search import _abstract_packed, _fake_batch

    P_, R_, seqs, shortest, longest = 512, 256, 64, 77, 83
    engine = SimpleNamespace(batch_shards=1, response_length=R_, mesh=make_mesh(devices=jax.devices()[:1]))
    _, planned = _abstract_packed(engine, _fake_batch(seqs, P_, R_, longest), budget, "x", shortest)
    assert planned[:3] == planned_rows, planned
    rng = np.random.default_rng(0)
    for _ in range(5):
        batch = _fake_batch(seqs, P_, R_, longest)
        for i, n in enumerate(rng.integers(shortest, longest + 1, seqs)):
            batch["attention_mask"][i, :P_ - n] = 0
        got = pack(batch, R_, budget, 1, "x", known={planned}, caps=Caps.of(planned))
        assert got.shape_key == planned, (got.shape_key, planned)


@pytest.mark.parametrize("budget", [32768, 12288])
def test_rows_of_windows_pack_within_the_planned_shape_whatever_the_responses(budget):
    """Rows cut into attention windows (the engine's `attention_window`): the plan gives each window the runs of the
    shortest prompt (`window_allowance`), so batches at the data's prompts pack into the planned shape itself with
    full-length responses, and with responses of any length, short ones included, into no larger a shape in any
    dimension, the runs of a window included (a row of windows caps none of its sequences)."""
    from types import SimpleNamespace

    from jaxppo.packing import Caps
    from jaxppo.plan_search import _abstract_packed, _fake_batch

    P_, R_, seqs, shortest, longest = 512, 256, 64, 77, 83  # the prompts of test_full_length_responses_...
    engine = SimpleNamespace(batch_shards=1, response_length=R_, mesh=make_mesh(devices=jax.devices()[:1]),
                             attention_window=P_ + R_)
    abstract, planned = _abstract_packed(engine, _fake_batch(seqs, P_, R_, longest), budget, "x", shortest)
    assert abstract["segment_starts"].shape[2] > 1, abstract["segment_starts"].shape  # windows
    rng = np.random.default_rng(0)
    for short in (False, True) * 4:
        batch = _fake_batch(seqs, P_, R_, longest)
        responses = rng.integers(1, 8 if rng.random() < 0.5 else R_ + 1, seqs) if short else [R_] * seqs
        for i, (n, r) in enumerate(zip(rng.integers(shortest, longest + 1, seqs), responses)):
            batch["attention_mask"][i, :P_ - n] = 0
            batch["attention_mask"][i, P_ + r:] = 0
            batch["response_mask"][i, r:] = 0
        got = pack(batch, R_, budget, 1, "x", known={planned}, caps=Caps.of(planned), window=P_ + R_)
        if short:
            assert all(g <= q for g, q in zip(got.shape_key[1:], planned[1:])), (got.shape_key, planned)
        else:
            assert got.shape_key == planned, (got.shape_key, planned)


def test_a_sequence_the_planned_shape_cannot_hold_packs_without_caps():
    from jaxppo.packing import Caps

    batch = random_batch(101, 8, seed=1)
    longest = int((batch["attention_mask"] > 0).sum(1).max())
    held = pack(batch, R, 48, 2, caps=Caps(slots=R, row_len=longest - 1, runs=4))
    assert held.shape_key[2] >= longest


def test_a_known_slot_count_up_to_a_quarter_row_more_is_reused():
    """A compiled shape with the same micro-batches and row length is reused for fewer response tokens when its
    slots exceed the batch's by at most a quarter of the row (their vocabulary projection is a small part of the
    row's work, a compile is not); beyond that the batch gets its own bucket."""
    batch = random_batch(101, 16, seed=5)
    best = pack(batch, R, 48, shards=2)
    n, slots, row, runs = best.shape_key
    most = int(best.arrays["response_mask"].sum(-1).max())  # the most response tokens a row holds
    near = (n, most + row // 4, row, runs)
    far = (n, max(most + row // 4, bucket(most) + bucket(most) // 4) + 1, row, runs)
    assert near[1] > 1.25 * bucket(most)  # beyond the buckets' own slack: the row's quarter decides
    assert pack(batch, R, 48, shards=2, known={near}).shape_key == near
    assert pack(batch, R, 48, shards=2, known={far}).shape_key == best.shape_key
