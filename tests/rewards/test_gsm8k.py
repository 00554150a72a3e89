"""GSM8K rule reward (verl's signature) and the math answer comparison."""

import pytest

from jaxppo.rewards import gsm8k
from jaxppo.rewards.math import compute_score as boxed_score
from jaxppo.rewards.math import math_equal, parse_number


@pytest.mark.parametrize("text, gt, expected", [
    ("so 3 + 4 = 7 #### 7", "7", 1.0),                       # correct
    ("#### 8", "7", 0.0),                                     # wrong
    ("the answer is 7", "7", 0.0),                            # missing ####
    ("#### 5 then I fixed it #### 7", "7", 1.0),              # several: the last wins
    ("#### 7 no wait #### 5", "7", 0.0),
    ("#### 1,234", "1234", 1.0),                              # commas removed
    ("#### $1,234", "1234", 1.0),                             # $ removed
    ("#### -12", "-12", 1.0),                                 # negative
    ("#### 3.50", "3.5", 1.0),                                # decimal, numeric comparison
    ("#### 18.", "18", 1.0),                                  # trailing period of a sentence
])
def test_strict(text, gt, expected):
    assert gsm8k.compute_score(text, gt) == expected


def test_strict_only_sees_last_300_characters():
    text = "#### 42 " + "x" * 300
    assert gsm8k.compute_score(text, "42") == 0.0
    assert gsm8k.compute_score(text, "42", method="flexible") == 0.0
    assert gsm8k.compute_score("x" * 300 + " #### 42", "42") == 1.0


def test_flexible_takes_last_number():
    assert gsm8k.compute_score("I think it is 5, no, 7.", "7", method="flexible") == 1.0
    assert gsm8k.compute_score("I think it is 5, no, 7.", "5", method="flexible") == 0.0
    assert gsm8k.compute_score("no numbers here", "5", method="flexible") == 0.0


def test_score_and_format_score():
    assert gsm8k.compute_score("#### 7", "7", score=2.0) == 2.0
    assert gsm8k.compute_score("#### 6", "7", format_score=0.1) == 0.1
    assert gsm8k.compute_score("7", "7", format_score=0.1) == 0.0


def test_math_equal_integers_decimals_fractions():
    assert math_equal("3/4", "0.75") and math_equal("\\frac{3}{4}", "0.75") and math_equal("-1/2", "-0.5")
    assert math_equal("1,000", "1000") and math_equal("$5", "5.00") and not math_equal("1/3", "0.33")
    assert not math_equal("2", "3") and math_equal("x+1", "x + 1")
    assert parse_number("abc") is None and parse_number("1/0") is None


def test_boxed():
    assert boxed_score("so \\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert boxed_score("\\boxed{1} then \\boxed{2}", "2") == 1.0
    assert boxed_score("no box 2", "2") == 0.0
