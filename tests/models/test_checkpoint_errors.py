"""Bad checkpoints give one clear message naming the file / tensor, never a traceback soup."""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxppo.compare import main as compare_main
from jaxppo.errors import CheckpointError
from jaxppo.models import load_model


@pytest.fixture
def ckpt(tiny_qwen, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_qwen, dst)
    return dst


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(tmp_path)


def test_unsupported_architecture_names_it_and_lists_supported(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["MistralForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"MistralForCausalLM.*supported: .*LlamaForCausalLM.*Qwen2ForCausalLM"):
        load_model(ckpt)


def test_shape_mismatch_names_the_tensor(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    tensors[name] = np.zeros((7, 3), np.float32)
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*shape \[7, 3\]"):
        load_model(ckpt)


def test_missing_tensor_names_it(ckpt):
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.0.self_attn.k_proj.bias"]
    save_file(tensors, ckpt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.self_attn\.k_proj\.bias.*missing"):
        load_model(ckpt)


def test_corrupt_safetensors_names_the_file(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(ckpt)


def test_compare_cli_reports_error_without_traceback(tmp_path, capsys):
    assert compare_main(["--model", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "no config.json" in err and "Traceback" not in err


@pytest.mark.parametrize("family", ["qwen3", "qwen2", "llama"])
def test_a_config_without_head_dim_gets_the_head_dim_transformers_gives_it(family):
    """Qwen3's config.json may omit head_dim: transformers' Qwen3Config then uses 128 (not hidden / heads); Qwen2's
    and Llama's use hidden / heads. jaxppo reads the same number as transformers does."""
    import transformers

    from jaxppo.models.config import config_from_hf_dict

    cls = {"qwen3": transformers.Qwen3Config, "qwen2": transformers.Qwen2Config,
           "llama": transformers.LlamaConfig}[family]
    hf = cls(vocab_size=64, hidden_size=512, intermediate_size=64, num_hidden_layers=1, num_attention_heads=8,
             num_key_value_heads=8)
    raw = hf.to_dict()
    raw.pop("head_dim", None)
    reread = cls(**raw)  # what transformers makes of that config.json
    want = getattr(reread, "head_dim", None) or 512 // 8
    cfg, _ = config_from_hf_dict(raw)
    assert cfg.head_dim == want
    assert (want == 128) == (family == "qwen3")
