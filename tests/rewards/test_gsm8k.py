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


@pytest.mark.parametrize("answer,truth", [
    ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}"),  # the same number, written two ways
    ("\\frac{1}{2}", "0.5"),
    ("\\dfrac{3}{4}", "\\frac{3}{4}"),
    ("(1,2]", "(1, 2]"),  # an interval
    ("\\{2, 1\\}", "\\{1,2\\}"),  # a set, order free
    ("2\\pi", "\\pi \\cdot 2"),
    ("x^2+2x+1", "(x+1)^2"),
])
def test_boxed_math_accepts_equivalent_latex(answer, truth):
    assert boxed_score(f"The answer is $\\boxed{{{answer}}}$.", truth) == 1.0


@pytest.mark.parametrize("answer,truth", [("\\sqrt{3}/2", "\\frac{\\sqrt{2}}{2}"), ("[1,2]", "(1, 2]"),
                                          ("\\{1, 3\\}", "\\{1,2\\}"), ("x^2+1", "(x+1)^2"), ("", "1")])
def test_boxed_math_rejects_different_answers(answer, truth):
    assert boxed_score(f"$\\boxed{{{answer}}}$", truth) == 0.0


def test_boxed_math_under_the_reward_time_limit():
    """math-verify's own timers are off; the registry's per-sample limit still holds (SIGALRM not replaced)."""
    from jaxppo.rewards import score_batch
    from tests.rewards import flaky_rewards  # noqa: F401  (registers test/hangs)

    res = score_batch(["lighteval/MATH", "test/hangs", "lighteval/MATH"], ["\\boxed{\\frac{1}{2}}", "", "\\boxed{(1,2]}"],
                      ["0.5", "", "(1, 2]"], timeout_s=0.5)
    assert res.scores.tolist() == [1.0, 0.0, 1.0] and res.num_timeouts == 1
