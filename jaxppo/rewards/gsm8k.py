"""GSM8K rule reward, with verl's signature so users' reward code ports unchanged.

strict:   the last `#### <number>` in the last 300 characters (the model must follow the format)
flexible: the last number anywhere in the last 300 characters
Commas and `$` are removed. Unlike verl's exact string match, the comparison is numeric
(`math_equal`): "18", "18.0" and "18.00" are the same answer.
"""

from __future__ import annotations

import re

from jaxppo.rewards.math import math_equal

SOLUTION_CLIP_CHARS = 300
_STRICT = re.compile(r"#### \$?(-?[0-9.,$]+)")
_FLEXIBLE = re.compile(r"(-?[0-9.,]+)")


def extract_solution(solution_str: str, method: str = "strict") -> str | None:
    if method not in ("strict", "flexible"):
        raise ValueError(f"method must be 'strict' or 'flexible', got {method!r}")
    text = solution_str[-SOLUTION_CLIP_CHARS:]
    if method == "strict":
        found = _STRICT.findall(text)
        if not found:
            return None
        answer = found[-1].replace(",", "").replace("$", "")
        return answer.rstrip(".") or None
    for candidate in reversed(_FLEXIBLE.findall(text)):
        candidate = candidate.replace(",", "").rstrip(".")
        if candidate not in ("", "-"):
            return candidate
    return None


def compute_score(solution_str: str, ground_truth: str, method: str = "strict", format_score: float = 0.0,
                  score: float = 1.0) -> float:
    """`score` for the right answer, `format_score` for a well-formed wrong one, 0 when none is found."""
    answer = extract_solution(solution_str, method)
    if answer is None:
        return 0.0
    return score if math_equal(answer, ground_truth) else format_score
