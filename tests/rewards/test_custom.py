"""A user's reward function from a file (verl's `custom_reward_function`): called with verl's arguments, dict
results with extras, the same containment as the built-in rules, in worker processes too."""

import numpy as np
import pytest

from jaxppo.errors import ConfigError
from jaxppo.rewards import score_batch
from jaxppo.rewards.custom import FileRewardFn
from tests.train_helpers import FAST, ROOT, read_metrics, run_train

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


@pytest.mark.slow
def test_training_with_the_users_function(tmp_path):
    run = tmp_path / "run"
    run_train(run, *FAST, "trainer.total_training_steps=2", "trainer.test_freq=2",
              f"custom_reward_function.path={USER}", "custom_reward_function.name=compute_score")
    m = read_metrics(run)
    for step in (1, 2):
        assert m[step]["reward/extra/length/mean"] > 0 and 0 <= m[step]["reward/extra/formatted/mean"] <= 1
        # every score the function can give is 0, 0.1 or 1: so is the batch mean's support
        assert 0 <= m[step]["critic/score/mean"] <= 1
    assert "val/score" in m[2]
