"""scripts/plot_metrics.py turns a run's JSONL into a PNG with one panel per quantity."""

import json

from scripts.plot_metrics import load, plot


def test_plot_from_jsonl(tmp_path):
    f = tmp_path / "metrics.jsonl"
    lines = [{"step": 0, "val/score": 0.1}]
    lines += [{"step": s, "critic/score/mean": 0.1 * s, "actor/ppo_kl": 0.01, "actor/entropy": 1.0 - 0.1 * s,
               "response_length/mean": 10 + s, "timing_s/step": 1.0} for s in (1, 2, 3)]
    lines.append({"step": 2, "critic/score/mean": 0.5})  # a resumed run repeats step 2: the last record wins
    f.write_text("\n".join(json.dumps(l) for l in lines))
    series = load(f)
    assert series["critic/score/mean"] == [(1, 0.1), (2, 0.5), (3, 0.30000000000000004)]
    out = plot(f, tmp_path / "curves.png")
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_a_line_cut_by_a_kill_is_skipped_naming_it(tmp_path, capsys):
    """A run killed while writing leaves a cut last line (the trainer drops it on resume, jaxppo/setup.py): the
    curves of the complete lines are still drawn, and the skipped line is named."""
    f = tmp_path / "metrics.jsonl"
    f.write_text("\n".join(json.dumps({"step": s, "critic/score/mean": 0.1 * s}) for s in (1, 2)) + '\n{"step": 3, "cri')
    assert load(f)["critic/score/mean"] == [(1, 0.1), (2, 0.2)]
    assert f"{f}:3: not a metrics record" in capsys.readouterr().err
    assert plot(f, tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"
