"""`python -m jaxppo.compare logits`: runs both frameworks and reports parity as JSON."""

import json

from jaxppo.compare import main


def test_compare_logits_json_line(tiny_qwen, capsys):
    assert main(["--model", str(tiny_qwen), "--batch", "3", "--seq", "12", "--seed", "7"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    for key in ("max_abs_logit_diff", "max_rel_logit_diff", "max_abs_logprob_diff"):
        assert key in report
    assert report["max_abs_logit_diff"] <= 1e-4 and report["max_abs_logprob_diff"] <= 1e-4
    assert report["valid_tokens"] < 3 * 12  # the batch really was padded


def test_compare_explicit_subcommand_bf16(tiny_qwen, capsys):
    assert main(["logits", "--model", str(tiny_qwen), "--dtype", "bfloat16", "--batch", "2", "--seq", "8"]) == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["dtype"] == "bfloat16" and 0 < report["max_abs_logprob_diff"] < 0.5
