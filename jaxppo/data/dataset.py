"""Prompt datasets in verl's parquet schema, tokenised once at load.

Schema (one row per prompt):
  data_source   string                           selects the reward function
  prompt        list<struct<role, content>>      chat messages (or a plain string with prompt_format="raw")
  ability       string                           optional
  reward_model  struct<style, ground_truth>      ground_truth is required
  extra_info    struct                           optional, passed through to reward functions
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from jaxppo.errors import DataError

log = logging.getLogger(__name__)

TRUNCATION_MODES = ("filter", "truncate_left", "error")


@dataclasses.dataclass(frozen=True)
class PromptSpec:
    """How prompts are read and tokenised (a part of the `data` config)."""

    prompt_key: str = "prompt"  # the column holding the prompt
    prompt_format: str = "chat"  # chat: list of messages + the tokenizer's chat template | raw: a text column
    max_prompt_length: int = 512  # in tokens, after the chat template
    truncation: str = "filter"  # filter | truncate_left | error, for prompts longer than max_prompt_length


@dataclasses.dataclass
class PromptDataset:
    """Tokenised prompts with what the reward functions need. Indexable by row."""

    input_ids: list[np.ndarray]
    data_source: list[str]
    ground_truth: list[str]
    extra_info: list[dict[str, Any]]
    files: list[str]
    num_filtered: int = 0  # prompts dropped for being too long
    num_truncated: int = 0  # prompts cut on the left

    def __len__(self) -> int:
        return len(self.input_ids)


def _read_table(path: Path) -> pa.Table:
    if not path.is_file():
        raise DataError(f"{path}: dataset file not found")
    try:
        return pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as e:
        raise DataError(f"{path}: not a readable parquet file ({e})") from None


def _check_column(table: pa.Table, path: Path, name: str, ok: bool, expected: str) -> None:
    if name not in table.column_names:
        raise DataError(f"{path}: missing column {name!r} (columns: {table.column_names})")
    if not ok:
        raise DataError(f"{path}: column {name!r} has type {table.schema.field(name).type}, expected {expected}")


def _validate(table: pa.Table, path: Path, spec: PromptSpec) -> None:
    t = {f.name: f.type for f in table.schema}
    _check_column(table, path, "data_source", pa.types.is_string(t.get("data_source", pa.null()))
                  or pa.types.is_large_string(t.get("data_source", pa.null())), "string")
    ptype = t.get(spec.prompt_key, pa.null())
    if spec.prompt_format == "chat":
        ok = (pa.types.is_list(ptype) or pa.types.is_large_list(ptype)) and pa.types.is_struct(ptype.value_type) \
            and {"role", "content"} <= {f.name for f in ptype.value_type}
        _check_column(table, path, spec.prompt_key, ok, "list<struct<role: string, content: string>>")
    else:
        _check_column(table, path, spec.prompt_key, pa.types.is_string(ptype) or pa.types.is_large_string(ptype),
                      "string (prompt_format=raw)")
    rtype = t.get("reward_model", pa.null())
    _check_column(table, path, "reward_model",
                  pa.types.is_struct(rtype) and "ground_truth" in {f.name for f in rtype},
                  "struct<style: string, ground_truth: ...>")


def _render(tokenizer, prompt: Any, spec: PromptSpec, where: str) -> list[int]:
    if spec.prompt_format == "raw":
        return list(tokenizer(prompt, add_special_tokens=False)["input_ids"])
    if not prompt:
        raise DataError(f"{where}: empty prompt message list")
    if getattr(tokenizer, "chat_template", None) is None:
        raise DataError(f"{where}: the tokenizer has no chat template; set data.prompt_format=raw for text prompts")
    text = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def load_prompt_dataset(files: str | Sequence[str], tokenizer, spec: PromptSpec = PromptSpec()) -> PromptDataset:
    """Read one or more parquet files in verl's schema and tokenise every prompt.

    Errors (`DataError`) name the file and the column or row at fault. Prompts longer than
    `max_prompt_length` are filtered, left-truncated or rejected per `spec.truncation`; the counts are
    kept on the dataset and logged.
    """
    if spec.truncation not in TRUNCATION_MODES:
        raise DataError(f"data.truncation {spec.truncation!r} unknown; known: {list(TRUNCATION_MODES)}")
    files = [files] if isinstance(files, (str, Path)) else list(files)
    if not files:
        raise DataError("no dataset files given")
    out = PromptDataset([], [], [], [], [str(f) for f in files])
    for f in files:
        path = Path(f)
        table = _read_table(path)
        _validate(table, path, spec)
        cols = table.select([c for c in ("data_source", spec.prompt_key, "reward_model", "extra_info")
                             if c in table.column_names]).to_pylist()
        for row, rec in enumerate(cols):
            where = f"{path}: row {row}"
            gt = (rec.get("reward_model") or {}).get("ground_truth")
            if gt is None or (isinstance(gt, str) and not gt.strip()):
                raise DataError(f"{where}: missing reward_model.ground_truth")
            if rec.get("data_source") is None:
                raise DataError(f"{where}: missing data_source")
            prompt = rec.get(spec.prompt_key)
            if prompt is None:
                raise DataError(f"{where}: missing {spec.prompt_key!r}")
            ids = _render(tokenizer, prompt, spec, where)
            if len(ids) > spec.max_prompt_length:
                if spec.truncation == "error":
                    raise DataError(f"{where}: prompt has {len(ids)} tokens > max_prompt_length={spec.max_prompt_length}")
                if spec.truncation == "filter":
                    out.num_filtered += 1
                    continue
                ids = ids[-spec.max_prompt_length:]
                out.num_truncated += 1
            out.input_ids.append(np.asarray(ids, np.int32))
            out.data_source.append(rec["data_source"])
            out.ground_truth.append(str(gt))
            out.extra_info.append(dict(rec.get("extra_info") or {}))
    if len(out) == 0:
        raise DataError(f"{', '.join(out.files)}: dataset is empty"
                        + (f" ({out.num_filtered} prompts longer than max_prompt_length="
                           f"{spec.max_prompt_length} were filtered)" if out.num_filtered else ""))
    if out.num_filtered or out.num_truncated:
        log.warning("%s: %d prompts over max_prompt_length=%d filtered, %d left-truncated", ", ".join(out.files),
                    out.num_filtered, spec.max_prompt_length, out.num_truncated)
    return out


def left_pad(seqs: Sequence[np.ndarray], pad_id: int, length: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stack sequences right-aligned: ids [n, length] padded on the left with `pad_id`, and the mask."""
    length = max(len(s) for s in seqs) if length is None else length
    ids = np.full((len(seqs), length), pad_id, np.int32)
    mask = np.zeros((len(seqs), length), np.int32)
    for i, s in enumerate(seqs):
        if len(s) > length:
            raise ValueError(f"sequence {i} has {len(s)} tokens > pad length {length}")
        if len(s):
            ids[i, length - len(s):] = s
            mask[i, length - len(s):] = 1
    return ids, mask
