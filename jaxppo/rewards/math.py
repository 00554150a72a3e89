"""Answer comparison for integers, decimals and fractions, and a \\boxed{} math reward."""

from __future__ import annotations

import re
from fractions import Fraction

_NUMBER = re.compile(r"^\s*\$?\s*(-?)\s*(\d+(?:\.\d*)?|\.\d+)\s*$")
_FRACTION = re.compile(r"^\s*(-?)\s*\\?(?:d?frac)?\{?\s*(-?\d+)\s*\}?\s*(?:/|\}\s*\{)\s*(\d+)\s*\}?\s*$")


def parse_number(text: str) -> Fraction | None:
    """'1,234', '-3.50', '$7', '3/4', '\\frac{3}{4}' -> exact Fraction; None when not a number."""
    s = str(text).replace(",", "").replace("\\!", "").strip().rstrip(".")
    m = _NUMBER.match(s)
    if m:
        return Fraction(m.group(1) + m.group(2))
    m = _FRACTION.match(s)
    if m and int(m.group(3)) != 0:
        sign = -1 if m.group(1) else 1
        return sign * Fraction(int(m.group(2)), int(m.group(3)))
    return None


def math_equal(answer: str, ground_truth: str, rel_tol: float = 1e-9) -> bool:
    """Numeric equality when both parse as numbers (exact for fractions); else normalised string equality."""
    a, b = parse_number(answer), parse_number(ground_truth)
    if a is not None and b is not None:
        if a == b:
            return True
        return abs(float(a) - float(b)) <= rel_tol * max(1.0, abs(float(b)))
    norm = lambda s: re.sub(r"\s+", "", str(s)).strip("$").rstrip(".")
    return norm(answer) == norm(ground_truth)


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (balanced braces)."""
    start = text.rfind("\\boxed")
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        return None
    depth, j = 0, i
    while j < len(text):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1:j]
        j += 1
    return None


def compute_score(solution_str: str, ground_truth: str, **_) -> float:
    """1.0 when the last \\boxed{} answer equals the ground truth, else 0.0."""
    answer = last_boxed(solution_str)
    return 1.0 if answer is not None and math_equal(answer, ground_truth) else 0.0
