"""scripts/preprocess_gsm8k.py: published GSM8K -> verl schema, loadable by jaxppo's loader."""

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from jaxppo.data import PromptSpec, load_prompt_dataset

ROOT = Path(__file__).resolve().parents[1]
ROWS = [
    {"question": "Natalia sold 48 clips in April and half as many in May. How many in total?",
     "answer": "In May she sold 48/2 = <<48/2=24>>24 clips.\nAltogether 48+24 = <<48+24=72>>72.\n#### 72"},
    {"question": "A house costs $1,200 more than a car of $3,000. Total?", "answer": "Sum.\n#### 5,200"},
]


def run(*args):
    return subprocess.run([sys.executable, str(ROOT / "scripts/preprocess_gsm8k.py"), *map(str, args)],
                          capture_output=True, text=True)


def test_jsonl_and_parquet_inputs(tmp_path, tokenizer_dir):
    jl = tmp_path / "train.jsonl"
    jl.write_text("\n".join(json.dumps(r) for r in ROWS))
    pq.write_table(pa.Table.from_pylist(ROWS), tmp_path / "train_in.parquet")
    for src, out in [(jl, tmp_path / "a.parquet"), (tmp_path / "train_in.parquet", tmp_path / "b.parquet")]:
        res = run("--input", src, "--output", out, "--split", "train")
        assert res.returncode == 0, res.stderr
        rows = pq.read_table(out).to_pylist()
        assert rows[0]["reward_model"] == {"style": "rule", "ground_truth": "72"}
        assert rows[1]["reward_model"]["ground_truth"] == "5200"
        assert rows[0]["prompt"][0]["content"].endswith(
            ROWS[0]["question"] + ' Let\'s think step by step and output the final answer after "####".')
        assert rows[0]["data_source"] == "openai/gsm8k" and rows[1]["extra_info"]["index"] == 1
    from jaxppo.data import load_tokenizer

    ds = load_prompt_dataset(str(tmp_path / "a.parquet"), load_tokenizer(tokenizer_dir), PromptSpec())
    assert ds.ground_truth == ["72", "5200"]


def test_bad_answer_row_is_named(tmp_path):
    jl = tmp_path / "bad.jsonl"
    jl.write_text(json.dumps(ROWS[0]) + "\n" + json.dumps({"question": "q", "answer": "no marker"}))
    res = run("--input", jl, "--output", tmp_path / "o.parquet")
    assert res.returncode == 2 and not (tmp_path / "o.parquet").exists()
    assert "bad.jsonl: line 2: answer has no '#### <number>'" in res.stderr, res.stderr  # the line an editor shows
    jl.write_text(json.dumps(ROWS[0]) + "\n\n" + json.dumps({"question": "q"}) + "\n")  # a blank line between
    res = run("--input", jl, "--output", tmp_path / "o.parquet")
    assert res.returncode == 2 and "bad.jsonl: line 3: needs 'question' and 'answer'" in res.stderr, res.stderr
    pq.write_table(pa.Table.from_pylist([ROWS[0], {"question": "q", "answer": "none"}]), tmp_path / "bad.parquet")
    res = run("--input", tmp_path / "bad.parquet", "--output", tmp_path / "o.parquet")
    assert res.returncode == 2 and "bad.parquet: row 1: answer" in res.stderr, res.stderr
