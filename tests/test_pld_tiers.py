"""benchmarks/pld_tiers.py: how far pld's proposals hold, per confidence tier and per depth (no model needed)."""

import importlib.util
import json
from pathlib import Path

spec = importlib.util.spec_from_file_location("pld_tiers", Path(__file__).parents[1] / "benchmarks" / "pld_tiers.py")
pt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(pt)


def row(conf, n, accepted, left=64, prompt="1", pos=0):
    return dict(dataset="d", prompt=prompt, pos=pos, confidence=conf, n=n, accepted=accepted, left=left)


def test_deeper_counts_depth_d_only_where_d_minus_1_held_and_the_output_reaches_d():
    # 4 tokens, 2 right: depth 2 tried and hit, depth 3 tried and missed, depth 4 not tried
    assert pt.deeper([row(1.0, 4, 2)]) == (0.5, 2)
    # the output ends after 2 tokens: depth 3 cannot be judged
    assert pt.deeper([row(1.0, 4, 2, left=2)]) == (1.0, 1)


def test_by_depth_puts_each_trial_in_its_band_and_tier():
    rows = [row(1.0, 10, 10), row(0.8, 10, 3), row(0.2, 2, 0)]
    lines = pt.by_depth(rows).splitlines()
    consensus = next(x for x in lines if x.startswith("| 1.0"))
    long_ = next(x for x in lines if x.startswith("| 0.7"))
    # consensus: every depth 2..10 right; bands 2, 3-4, 5-8, 9-16 hold 1, 2, 4, 2 trials
    assert "1.000 (1) | 1.000 (2) | 1.000 (4) | 1.000 (2) | - | -" in consensus
    # long match right to depth 3: depth 2 hit, 3 hit, 4 missed, nothing deeper tried
    assert "1.000 (1) | 0.500 (2) | - |" in long_


def test_the_tables_come_from_saved_rows(tmp_path, capsys):
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([row(1.0, 8, 8), row(0.8, 8, 0, prompt="2")]))
    assert pt.main(["--rows", str(path)]) == 0
    out = capsys.readouterr().out
    assert "| 1.0 (consensus) | 1 | 1 | 1.00 |" in out and "p_d, d 3-4" in out
    assert pt.main(["--rows", str(tmp_path / "missing.json")]) == 2
