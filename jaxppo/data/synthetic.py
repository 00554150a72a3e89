"""Synthetic arithmetic word problems in verl's GSM8K schema, and a tiny BPE tokenizer for them.

The embedded default trains on this task: it runs anywhere (no downloads), its difficulty is set by
knobs (operand count, digit count, operators), and it goes through the same loader and reward code
as GSM8K (`data_source` "synthetic/arithmetic", answers after "####").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

DATA_SOURCE = "synthetic/arithmetic"
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
NAMES = ("Tom", "Ann", "Bob", "Eve", "Sam", "Liz")
ITEMS = ("apples", "pens", "coins", "books", "cards", "shells")
OP_TEXT = {"+": "Then they get {b} more.", "-": "Then they give away {b}.", "*": "Then the number grows {b} times."}


@dataclasses.dataclass(frozen=True)
class ArithmeticTask:
    """Difficulty knobs of the generated problems."""

    num_operands: int = 2  # numbers in a problem (>= 2)
    max_digits: int = 1  # operands have 1..max_digits digits
    operators: str = "+-"  # drawn from + - *
    allow_negative: bool = False  # when False, subtractions never go below zero
    instruction: bool = True  # append the GSM8K instruction, as verl's preprocessing does


def make_problem(rng: np.random.Generator, task: ArithmeticTask) -> tuple[str, str, int]:
    """(question, worked solution ending in '#### N', answer)."""
    hi = 10 ** task.max_digits
    name, item = NAMES[rng.integers(len(NAMES))], ITEMS[rng.integers(len(ITEMS))]
    total = int(rng.integers(1, hi))
    sentences = [f"{name} has {total} {item}."]
    steps = []
    for _ in range(task.num_operands - 1):
        op = task.operators[rng.integers(len(task.operators))]
        b = int(rng.integers(1, hi))
        if op == "-" and not task.allow_negative and b > total:
            b = int(rng.integers(0, total + 1))
        new = total + b if op == "+" else total - b if op == "-" else total * b
        sentences.append(OP_TEXT[op].format(b=b))
        steps.append(f"{total} {op} {b} = {new}.")
        total = new
    question = " ".join(sentences + [f"How many {item} does {name} have?"])
    if task.instruction:
        question += " " + INSTRUCTION
    return question, " ".join(steps + [f"#### {total}"]), total


def make_rows(n: int, task: ArithmeticTask, seed: int, split: str) -> list[dict]:
    """`n` rows in verl's schema; `extra_info.answer` holds the worked solution (for a warm start)."""
    rng = np.random.default_rng([seed, 0 if split == "train" else 1])
    rows = []
    for i in range(n):
        q, solution, answer = make_problem(rng, task)
        rows.append({
            "data_source": DATA_SOURCE,
            "prompt": [{"role": "user", "content": q}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(answer)},
            "extra_info": {"split": split, "index": i, "answer": solution},
        })
    return rows


def write_parquet(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_dataset(out_dir: str | Path, task: ArithmeticTask = ArithmeticTask(), *, train_size: int = 2000,
                  val_size: int = 200, seed: int = 0) -> tuple[Path, Path]:
    """train.parquet and test.parquet under `out_dir`."""
    out_dir = Path(out_dir)
    return (write_parquet(make_rows(train_size, task, seed, "train"), out_dir / "train.parquet"),
            write_parquet(make_rows(val_size, task, seed, "test"), out_dir / "test.parquet"))


def build_tokenizer(out_dir: str | Path, task: ArithmeticTask = ArithmeticTask(), vocab_size: int = 384,
                    seed: int = 0) -> Path:
    """Train a byte-level BPE tokenizer (digits split one by one, as Qwen's are) on generated problems and
    save it as a Hugging Face tokenizer directory with a chat template; `AutoTokenizer` loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    rng = np.random.default_rng([seed, 2])
    corpus = []
    for _ in range(3000):
        q, sol, _ = make_problem(rng, task)
        corpus.append(f"<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n{sol}<|im_end|>\n")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHAT_TEMPLATE, clean_up_tokenization_spaces=False)
    fast.save_pretrained(str(out_dir))
    return Path(out_dir)
