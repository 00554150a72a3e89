"""The \\boxed{} math reward: the last boxed answer against the ground truth, checked by `math-verify` (the
parser / verifier verl, TRL and open-r1 use: LaTeX and plain expressions, fractions, roots, intervals, sets,
equivalent forms), with exact integers / decimals / fractions compared directly first (no parser needed).

math-verify's own timers are off (they would replace the caller's SIGALRM timer): the per-sample time limit
of `jaxppo.rewards.registry.score_batch` bounds it, like every reward function."""

from __future__ import annotations

import logging
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


def verify_latex(answer: str, ground_truth: str) -> bool:
    """Mathematical equivalence of two LaTeX / plain answers by math-verify (False when either does not parse)."""
    from math_verify import parse, verify

    logging.getLogger("math_verify").setLevel(logging.ERROR)  # "timeout disabled" notices: the caller times it
    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=None)
    pred = parse(f"\\boxed{{{answer}}}", parsing_timeout=None)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def compute_score(solution_str: str, ground_truth: str, **_) -> float:
    """1.0 when the last \\boxed{} answer equals the ground truth (as numbers, else by math-verify), else 0.0."""
    answer = last_boxed(solution_str)
    if answer is None:
        return 0.0
    a, b = parse_number(answer), parse_number(ground_truth)
    if a is not None and b is not None:  # plain numbers: exact, no parser
        return 1.0 if math_equal(answer, ground_truth) else 0.0
    return 1.0 if math_equal(answer, ground_truth) or verify_latex(answer, ground_truth) else 0.0
