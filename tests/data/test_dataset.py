"""verl-format parquet datasets: loading, chat template, padding, truncation, sampler, bad input."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jaxppo.data import PromptSpec, ResumableSampler, left_pad, load_prompt_dataset
from jaxppo.data.synthetic import ArithmeticTask, make_rows, write_dataset
from jaxppo.errors import DataError
from jaxppo.rewards import score_batch

INSTR = 'Let\'s think step by step and output the final answer after "####".'


def gsm8k_rows(n, start=0):
    return [{
        "data_source": "openai/gsm8k",
        "prompt": [{"role": "user", "content": f"Question {start + i}: what is {i} plus {i}? {INSTR}"}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
        "extra_info": {"split": "train", "index": start + i},
    } for i in range(n)]


def write(rows, path):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def test_verl_gsm8k_parquet_loads_with_chat_template(tokenizer, tmp_path):
    f1 = write(gsm8k_rows(5), tmp_path / "a.parquet")
    f2 = write(gsm8k_rows(3, start=5), tmp_path / "b.parquet")
    ds = load_prompt_dataset([f1, f2], tokenizer, PromptSpec(max_prompt_length=256))
    assert len(ds) == 8 and ds.ground_truth[6] == "2" and ds.data_source[0] == "openai/gsm8k"
    assert ds.extra_info[7]["index"] == 7
    text = tokenizer.decode(ds.input_ids[3])
    assert text == f"<|im_start|>user\nQuestion 3: what is 3 plus 3? {INSTR}<|im_end|>\n<|im_start|>assistant\n"
    ids, mask = left_pad([ds.input_ids[i] for i in range(8)], tokenizer.pad_token_id)
    lengths = [len(x) for x in ds.input_ids]
    assert ids.shape == (8, max(lengths)) and (mask.sum(1) == lengths).all()
    for row, n in enumerate(lengths):  # right-aligned: pads first, then the prompt
        assert (mask[row, : ids.shape[1] - n] == 0).all() and (ids[row, : ids.shape[1] - n] == tokenizer.pad_token_id).all()
        np.testing.assert_array_equal(ids[row, ids.shape[1] - n:], ds.input_ids[row])


def test_raw_prompt_column(tokenizer, tmp_path):
    rows = [{"data_source": "x", "question": "1 + 1 =", "reward_model": {"style": "rule", "ground_truth": "2"}}]
    ds = load_prompt_dataset(write(rows, tmp_path / "r.parquet"), tokenizer,
                             PromptSpec(prompt_key="question", prompt_format="raw"))
    assert tokenizer.decode(ds.input_ids[0]) == "1 + 1 ="


def test_long_prompts_filter_truncate_error(tokenizer, tmp_path):
    rows = gsm8k_rows(4)
    rows[2]["prompt"][0]["content"] = "very long " * 50
    f = write(rows, tmp_path / "long.parquet")
    limit = max(len(x) for x in load_prompt_dataset(f, tokenizer, PromptSpec(max_prompt_length=10**6)).input_ids) - 1
    short = PromptSpec(max_prompt_length=60)
    full = load_prompt_dataset(f, tokenizer, PromptSpec(max_prompt_length=10**6))
    assert len(full.input_ids[2]) > 60 >= max(len(full.input_ids[i]) for i in (0, 1, 3)), limit
    filtered = load_prompt_dataset(f, tokenizer, short)
    assert len(filtered) == 3 and filtered.num_filtered == 1 and filtered.ground_truth == ["0", "2", "6"]
    trunc = load_prompt_dataset(f, tokenizer, PromptSpec(max_prompt_length=60, truncation="truncate_left"))
    assert trunc.num_truncated == 1 and len(trunc.input_ids[2]) == 60
    np.testing.assert_array_equal(trunc.input_ids[2], full.input_ids[2][-60:])
    with pytest.raises(DataError, match=r"long\.parquet: row 2: prompt has \d+ tokens > max_prompt_length=60"):
        load_prompt_dataset(f, tokenizer, PromptSpec(max_prompt_length=60, truncation="error"))


def test_sampler_is_deterministic_and_resumes_across_epochs():
    a, b = ResumableSampler(10, 3, seed=7), ResumableSampler(10, 3, seed=7)
    seq_a = [a.next_batch().tolist() for _ in range(7)]
    assert seq_a == [b.next_batch().tolist() for _ in range(7)]
    assert seq_a[0] != ResumableSampler(10, 3, seed=8).next_batch().tolist()
    # 3 batches per epoch (last row dropped); each epoch a permutation without repeats
    assert len(set(sum(seq_a[:3], []))) == 9 and seq_a[:3] != seq_a[3:6]
    for stop in (2, 3, 4):  # stop mid-epoch, exactly at the boundary, and after it
        s = ResumableSampler(10, 3, seed=7)
        for _ in range(stop):
            s.next_batch()
        resumed = ResumableSampler(10, 3, seed=7)
        resumed.load_state(s.state())
        assert [resumed.next_batch().tolist() for _ in range(7 - stop)] == seq_a[stop:]


def test_synthetic_rows_pass_loader_and_reward(tokenizer, tmp_path):
    task = ArithmeticTask(num_operands=3, max_digits=2, operators="+-*")
    train, test = write_dataset(tmp_path, task, train_size=40, val_size=8, seed=3)
    ds = load_prompt_dataset([train], tokenizer, PromptSpec(max_prompt_length=512))
    assert len(ds) == 40 and len(load_prompt_dataset(test, tokenizer)) == 8
    answers = [e["answer"] for e in ds.extra_info]
    good = score_batch(ds.data_source, answers, ds.ground_truth)
    assert good.scores.tolist() == [1.0] * 40 and good.num_errors == 0
    wrong = score_batch(ds.data_source, [a + "1" for a in answers], ds.ground_truth)
    assert wrong.scores.sum() == 0
    rows = make_rows(200, task, seed=3, split="train")
    for r in rows:  # the worked solution is arithmetic that checks out
        *_, last = r["extra_info"]["answer"].split("#### ")
        assert last == r["reward_model"]["ground_truth"]


# ---------------------------------------------------------------- bad input


def test_missing_file(tokenizer, tmp_path):
    with pytest.raises(DataError, match=r"nope\.parquet: dataset file not found"):
        load_prompt_dataset(str(tmp_path / "nope.parquet"), tokenizer)


def test_corrupt_parquet(tokenizer, tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 garbage")
    with pytest.raises(DataError, match=r"bad\.parquet: not a readable parquet file"):
        load_prompt_dataset(str(tmp_path / "bad.parquet"), tokenizer)


def test_missing_column(tokenizer, tmp_path):
    rows = [{k: v for k, v in r.items() if k != "reward_model"} for r in gsm8k_rows(2)]
    with pytest.raises(DataError, match=r"m\.parquet: missing column 'reward_model'"):
        load_prompt_dataset(write(rows, tmp_path / "m.parquet"), tokenizer)


def test_wrong_column_type(tokenizer, tmp_path):
    rows = gsm8k_rows(2)
    for r in rows:
        r["prompt"] = r["prompt"][0]["content"]  # a string where messages are expected
    with pytest.raises(DataError, match=r"w\.parquet: column 'prompt' has type string, expected list<struct"):
        load_prompt_dataset(write(rows, tmp_path / "w.parquet"), tokenizer)


def test_empty_dataset(tokenizer, tmp_path):
    schema = pa.Table.from_pylist(gsm8k_rows(1)).schema
    pq.write_table(schema.empty_table(), tmp_path / "e.parquet")
    with pytest.raises(DataError, match=r"e\.parquet: dataset is empty"):
        load_prompt_dataset(str(tmp_path / "e.parquet"), tokenizer)


def test_missing_ground_truth_names_row(tokenizer, tmp_path):
    rows = gsm8k_rows(4)
    rows[2]["reward_model"]["ground_truth"] = None
    with pytest.raises(DataError, match=r"g\.parquet: row 2: missing reward_model\.ground_truth"):
        load_prompt_dataset(write(rows, tmp_path / "g.parquet"), tokenizer)
