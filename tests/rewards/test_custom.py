"""A user's reward function from a file (verl's `custom_reward_function`): called with verl's arguments, dict
results with extras, the same containment as the built-in rules, in worker processes too."""

import numpy as np
import pytest

from jaxppo.errors import ConfigError
from jaxppo.rewards import score_batch
from jaxppo.rewards.custom import FileRewardFn
from tests.train_helpers import ROOT

USER = ROOT / "tests" / "rewards" / "user_reward.py"


def test_dict_results_give_the_score_and_extras():
    res = score_batch(["a", "b", "c"], ["x #### 4", "x #### 5", "no answer"], ["4", "4", "4"],
                      reward_fn=FileRewardFn(USER))
    assert res.scores.tolist() == pytest.approx([1.0, 0.1, 0.0])
    assert res.extras["length"].tolist() == [8.0, 8.0, 9.0] and res.extras["formatted"].tolist() == [1.0, 1.0, 0.0]
    assert res.num_errors == 0


def test_data_source_reaches_the_function_and_failures_are_contained():
    assert score_batch(["test/double", "x"], ["", ""], ["", ""], reward_fn=FileRewardFn(USER, "plain")).scores.tolist() \
        == [2.0, 1.0]
    for name, errors, timeouts in (("raises", 2, 0), ("no_score", 2, 0), ("hangs", 0, 2)):
        res = score_batch(["x", "y"], ["a", "b"], ["1", "1"], reward_fn=FileRewardFn(USER, name), timeout_s=0.2)
        assert res.scores.tolist() == [0.0, 0.0] and (res.num_errors, res.num_timeouts) == (errors, timeouts), name


def test_worker_processes_import_the_file_again():
    sols = [f"#### {i}" for i in range(6)]
    serial = score_batch(["s"] * 6, sols, ["2"] * 6, reward_fn=FileRewardFn(USER))
    workers = score_batch(["s"] * 6, sols, ["2"] * 6, reward_fn=FileRewardFn(USER), num_workers=2)
    assert workers.scores.tolist() == serial.scores.tolist() == pytest.approx([0.1, 0.1, 1.0, 0.1, 0.1, 0.1])
    np.testing.assert_array_equal(workers.extras["length"], serial.extras["length"])


def test_a_missing_file_or_function_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        FileRewardFn(tmp_path / "nope.py")
    with pytest.raises(ConfigError, match="has no function 'nope'; it defines .*compute_score"):
        FileRewardFn(USER, "nope")
    bad = tmp_path / "bad.py"
    bad.write_text("import no_such_module_anywhere\n")
    with pytest.raises(ConfigError, match="importing .* failed: ModuleNotFoundError"):
        FileRewardFn(bad)


# training with a user's function through `python -m jaxppo.train`: tests/test_validation.py (its val_only test
# trains with `digest` from this file first)


def test_reward_kwargs_reach_the_function_and_an_async_function_is_awaited():
    fn = FileRewardFn(USER, "scaled", {"scale": 3.0, "bonus": 0.5})
    for workers in (0, 2):  # in worker processes the kwargs travel with the function
        res = score_batch(["s", "s"], ["7", "8"], ["7", "7"], reward_fn=fn, num_workers=workers)
        assert res.scores.tolist() == [3.5, 0.5] and res.num_errors == 0
    res = score_batch(["s", "s"], ["7", "8"], ["7", "7"], reward_fn=FileRewardFn(USER, "async_score"))
    assert res.scores.tolist() == [1.0, 0.25] and res.num_errors == 0  # a coroutine used to score 0
