"""DAPO's math rule (verl 0.9.1 routes the data sources `math_dapo`, `math`, `math_dapo_reasoning` and `aime*` to
it): the last "Answer: ..." line of the response's final 300 characters, normalised as Minerva normalises final
answers (Lewkowycz et al. 2022, appendix D: units and filler words dropped, TeX shorthand expanded), equal to the
normalised ground truth as text; without such a line, the last \\boxed{} of the final 100 characters, compared
exactly. Scores +1 / -1 (DAPO's reward), `acc` 1 / 0 and `pred` the normalised answer ("[INVALID]" when there is
none). tests/ppo/test_verl_oracle.py checks it against verl's `math_dapo.compute_score`."""

from __future__ import annotations

import re

from jaxppo.rewards.math import last_boxed

INVALID = "[INVALID]"
_ANSWER = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")
# Minerva's normalisation: these replacements, in order, then these strings removed, in order
_REPLACE = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), (r"\ ", ""), (" ", ""), ("mbox", "text"),
            (",\\text{and}", ","), ("\\text{and}", ","), ("\\text{m}", "\\text{}"))
_REMOVE = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
           "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges",
           "students", "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
           "\\text{}^3", "\\text{\n}", "\\text{}", r"\mathrm{th}", r"^\circ", r"^{\circ}", r"\;", r",\!", "{,}", '"',
           "\\dots")


def normalize(answer: str) -> str:
    """A final answer in Minerva's normal form: the part after the last '=', replacements and removals, the math
    between the first pair of $ kept, \\text / \\textbf / \\overline / \\boxed unwrapped, \\fracab -> \\frac{a}{b},
    \\sqrta -> \\sqrt{a}, an integer's thousands separators dropped."""
    s = answer.split("=")[-1]
    for old, new in _REPLACE:
        s = s.replace(old, new)
    for gone in _REMOVE:
        s = s.replace(gone, "")
    s = re.sub(r"(.*?)(\$)(.*?)(\$)(.*)", "$\\3$", s)
    for macro in ("text", "textbf", "overline"):
        s = re.sub(r"(\\" + macro + r"\{)(.*?)(\})", "\\2", s)
    s = re.sub(r"(\\boxed\{)(.*)(\})", "\\2", s)
    s = re.sub(r"(frac)([^{])(.)", "frac{\\2}{\\3}", s)
    s = re.sub(r"(sqrt)([^{])", "sqrt{\\2}", s)
    s = s.replace("$", "")
    if s.replace(",", "").isdigit():
        s = s.replace(",", "")
    return s.strip()


def _boxed_exact(tail: str) -> str | None:
    """The content of the last complete \\boxed{...} of `tail`, as written."""
    start = tail.rfind("\\boxed{")
    return None if start < 0 else last_boxed(tail[start:])


def judge(solution_str: str, ground_truth: str) -> tuple[bool, str]:
    """(correct, the answer taken): the "Answer:" line first, the \\boxed{} fallback when there is none."""
    tail = solution_str[-300:]  # the longest answer in MATH-500 has 159 characters
    found = _ANSWER.findall(tail)
    pred = normalize(found[-1] if found else INVALID)
    if pred != INVALID:
        return pred == normalize(ground_truth), pred
    boxed = _boxed_exact(tail[-100:])
    if boxed is not None:
        return boxed == ground_truth, boxed
    return pred == normalize(ground_truth), pred


def compute_score(solution_str: str, ground_truth: str, **_) -> dict:
    correct, pred = judge(solution_str, ground_truth)
    return {"score": 1.0 if correct else -1.0, "acc": float(correct), "pred": pred}
