"""GSM8K as published (jsonl or parquet with `question` and `answer`, answers ending in `#### N`) ->
verl's parquet schema, with verl's instruction appended, so checkpoints trained on either compare.

    python scripts/preprocess_gsm8k.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet --split train
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def extract_answer(answer: str, where: str) -> str:
    m = re.search(r"#### (\-?[0-9\.\,]+)", answer)
    if m is None:
        raise ValueError(f"{where}: answer has no '#### <number>' ending: {answer[-80:]!r}")
    return m.group(1).replace(",", "")


def read_rows(path: Path) -> tuple[list[dict], list[str]]:
    """The rows, and where each is in the file as an editor shows it: `line N` (JSONL, from 1), `row N` (parquet,
    from 0, as pyarrow and pandas count)."""
    if path.suffix == ".jsonl":
        rows, where = [], []
        for i, line in enumerate(path.read_text().splitlines()):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}: line {i + 1} is not JSON ({e})") from None
                if not isinstance(rows[-1], dict):
                    raise ValueError(f"{path}: line {i + 1} is not a JSON object")
                where.append(f"line {i + 1}")
        return rows, where
    if path.suffix == ".parquet":
        rows = pq.read_table(path).to_pylist()
        return rows, [f"row {i}" for i in range(len(rows))]
    raise ValueError(f"{path}: expected .jsonl or .parquet")


def convert(rows: list[dict], split: str, source: str, where: list[str]) -> list[dict]:
    """The rows in verl's schema; `where`: each row's place in the file (`read_rows`), for the errors."""
    out = []
    for i, row in enumerate(rows):
        where_i = f"{source}: {where[i]}"
        if "question" not in row or "answer" not in row:
            raise ValueError(f"{where_i}: needs 'question' and 'answer' (has {sorted(row)})")
        out.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": row["question"] + " " + INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": extract_answer(row["answer"], where_i)},
            "extra_info": {"split": split, "index": i, "answer": row["answer"], "question": row["question"]},
        })
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", required=True, type=Path, help=".jsonl or .parquet with question/answer")
    p.add_argument("--output", required=True, type=Path)
    p.add_argument("--split", default="train")
    args = p.parse_args(argv)
    try:
        rows, where = read_rows(args.input)
        rows = convert(rows, args.split, str(args.input), where)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    args.output.parent.mkdir(parents=True, exist_ok=True)
    # written beside the output and renamed over it: an interrupted run leaves the file that was there, whole
    part = args.output.with_name(f".{args.output.name}.part")
    pq.write_table(pa.Table.from_pylist(rows), part)
    part.replace(args.output)
    print(f"wrote {len(rows)} rows to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
