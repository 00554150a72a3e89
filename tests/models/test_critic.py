"""The critic: a value head on the backbone, from a token-classification checkpoint or an actor."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bridge.reference import hf_logits, load_hf_model
from jaxppo.models import load_model, save_hf_checkpoint
from tests.helpers import left_padded_batch, make_hf_checkpoint


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama"])
def test_value_model_matches_hf_token_classification(family, tmp_path):
    path = make_hf_checkpoint(tmp_path / family, family, head="score")
    module, params, cfg = load_model(path, head="value")
    ids, mask, pos = left_padded_batch(np.random.default_rng(0), 3, 16, cfg.vocab_size)
    ours = np.asarray(module.apply({"params": params}, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    theirs = hf_logits(load_hf_model(path), ids, mask, pos)[..., 0]
    valid = mask.astype(bool)
    assert np.abs(theirs[valid]).max() > 0.1
    assert np.abs(ours - theirs)[valid].max() <= 1e-4


def test_critic_from_actor_gets_new_head_and_actor_backbone(tiny_qwen, tmp_path):
    module, params, cfg = load_model(tiny_qwen, head="value", rng=jax.random.PRNGKey(3))
    _, actor, _ = load_model(tiny_qwen)
    jax.tree.map(np.testing.assert_array_equal, params["model"], actor["model"])
    w, b = np.asarray(params["score"]["weight"]), np.asarray(params["score"]["bias"])
    assert w.shape == (1, cfg.hidden_size) and 0.01 < w.std() < 0.04 and np.all(b == 0)
    # saved in HF's token-classification layout, it loads in transformers with the same values
    out = save_hf_checkpoint(params, cfg, tmp_path / "critic", head="score")
    ids, mask, pos = left_padded_batch(np.random.default_rng(1), 2, 10, cfg.vocab_size)
    ours = np.asarray(module.apply({"params": params}, jnp.asarray(ids), jnp.asarray(pos), jnp.asarray(mask)))
    theirs = hf_logits(load_hf_model(out), ids, mask, pos)[..., 0]
    assert np.abs(ours - theirs)[mask.astype(bool)].max() <= 1e-4


def test_num_params_matches_transformers(tmp_path):
    for family, kw in [("qwen2", {}), ("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen2", {"tie": True}),
                       ("qwen3", {}), ("qwen3", {"attention_bias": True, "tie": True})]:
        path = make_hf_checkpoint(tmp_path / f"{family}{len(kw)}", family, **kw)
        _, params, cfg = load_model(path)
        hf = sum(p.numel() for p in load_hf_model(path).parameters())
        ours = sum(x.size for x in jax.tree.leaves(params))
        assert cfg.num_params() == ours == hf
