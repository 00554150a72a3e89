"""A user's reward file, as verl's `custom_reward_function.path` points to (used by the tests)."""

import time


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right `#### <n>` answer, 0.1 for any `####` line, else 0; the response length as an extra."""
    answer = solution_str.split("####")[-1].strip() if "####" in solution_str else None
    score = 1.0 if answer == ground_truth else (0.1 if answer is not None else 0.0)
    return {"score": score, "length": float(len(solution_str)), "formatted": answer is not None}


def plain(data_source, solution_str, ground_truth, extra_info=None):
    return 2.0 if data_source == "test/double" else 1.0


def raises(data_source, solution_str, ground_truth, extra_info=None):
    raise RuntimeError("the user's bug")


def hangs(data_source, solution_str, ground_truth, extra_info=None):
    while True:
        time.sleep(0.01)


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"accuracy": 1.0}


def digest(data_source, solution_str, ground_truth, extra_info=None):
    """Scores the text itself: 0 or 1 by its CRC's parity (a group of samples mostly disagrees), and the CRC
    modulo 1000 as an extra, so that any change of a response changes the mean (tests of what was generated)."""
    import zlib

    crc = zlib.crc32(solution_str.encode())
    return {"score": float(crc % 2), "digest": float(crc % 1000)}


def scaled(data_source, solution_str, ground_truth, extra_info=None, scale=1.0, bonus=0.0):
    """verl's reward_kwargs arrive as keyword arguments."""
    return scale * (1.0 if solution_str == ground_truth else 0.0) + bonus


async def async_score(data_source, solution_str, ground_truth, extra_info=None):
    """An async compute_score, as verl's reward loop allows."""
    import asyncio

    await asyncio.sleep(0)
    return 1.0 if solution_str == ground_truth else 0.25
