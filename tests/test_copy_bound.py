"""benchmarks/copy_bound.py: the oracle copy drafter that bounds what copying gives a repeating workload."""

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("copy_bound", Path(__file__).parents[1] / "benchmarks" / "copy_bound.py")
cb = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cb)


def test_a_draw_that_repeats_an_earlier_one_is_copied_whole_only_with_history():
    seq = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    # prefill commits 5; one pass copies 6..14 (9 tokens) after the earlier draw's 5, plus a bonus
    assert cb.oracle_passes([seq], [], seq, 1) == 2
    assert cb.oracle_passes([], [], seq, 1) == len(seq)  # nothing repeats within the draw: one token a pass


def test_the_oracle_takes_the_continuation_that_agrees_longest():
    earlier = [[1, 2, 9, 9], [1, 2, 3, 4, 0]]  # two continuations of "1 2": the second agrees longer
    seq = [1, 2, 3, 4, 5]
    assert cb.longest_copy(earlier, [7, *seq], 3, 2) == 2  # after "1 2": "3 4" (not "9 9")
    assert cb.longest_copy(earlier, [7, *seq], 3, 3) == 0  # "7 1 2" occurs nowhere


def test_the_own_text_and_the_prompt_are_searched_too():
    prompt = [3, 4, 5, 6]
    seq = [3, 4, 5, 6, 2]
    # prefill commits 3; then "3" matches the prompt's 3, which is followed by 4 5 6 (accepted), bonus 2
    assert cb.oracle_passes([], prompt, seq, 1) == 2
    assert cb.oracle_passes([], [], seq, 1) == 5


def test_the_copy_is_cut_at_the_limit():
    doc = [1, 2, 3, 4, 5, 6]
    assert cb.longest_copy([doc], [9, 1, 2, 3, 4, 5, 6], 2, 1) == 5
    assert cb.longest_copy([doc], [9, 1, 2, 3, 4, 5, 6], 2, 1, limit=3) == 3


def _vllm_bound():
    import sys

    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))  # it imports copy_bound as the script does
    try:
        s = importlib.util.spec_from_file_location("vllm_copy_bound", Path(__file__).parents[1] / "benchmarks" / "vllm_copy_bound.py")
        mod = importlib.util.module_from_spec(s)
        s.loader.exec_module(mod)
        return mod
    finally:
        sys.path.pop(0)


def test_the_one_request_oracle_drafts_what_is_accepted_at_most_k_a_pass():
    vb = _vllm_bound()
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    out = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]  # the output repeats the prompt
    own = vb.replay([prompt], [out], vb.oracle_drafter(4, 1, False))
    # the prefill gives 1; then each pass drafts 4 of 2..12 (accepted) plus the model's own token
    assert own == [4, 4, 0]  # the last pass has one token left: its own
    assert sum(own) + len(own) + 1 == len(out)
    fresh = [[20, 21, 22, 23], [20, 21, 22, 23]]  # a second request repeats the first one's output
    alone = vb.replay([[30], [31]], fresh, vb.oracle_drafter(8, 1, False))
    shared = vb.replay([[30], [31]], fresh, vb.oracle_drafter(8, 1, True))
    assert alone == [0, 0, 0, 0, 0, 0]  # nothing repeats within a request
    assert shared == [0, 0, 0, 2]  # with the first request's text: 21 22 copied, 23 the model's


def test_the_step_cost_is_read_from_the_trace_and_never_falls(tmp_path):
    vb = _vllm_bound()
    # calls: (decoding requests, rows planned, propose ms, clock ms, tokens committed, booked-out, rested)
    calls = [[1, 1, 0.5, 0.0, 1, 0, 0], [1, 5, 0.5, 34.0, 1, 0, 0], [1, 9, 0.5, 67.0, 1, 0, 0],
             [1, 1, 0.5, 111.0, 3, 0, 0], [2, 2, 0.5, 145.0, 1, 1, 0], [1, 1, 0.5, 300.0, 1, 0, 0]]
    trace = tmp_path / "t"
    trace.write_text("".join(f"{c}\n" for c in calls) + '{"stats": {}}\n')
    costs = vb.step_costs(str(trace))
    # the step planned at 111 ms ran a prompt (the next call says so): left out; the one planned with 2 requests
    # is not one request's
    assert {d: (n, round(1e3 * t, 1)) for d, (n, t) in costs.items()} == {0: (1, 34.0), 4: (1, 33.0), 8: (1, 44.0)}
    cost, _ = vb.cost_curve(costs, min_steps=1)
    # 4 drafted rows measured faster than none: pooled with it (33.5 ms at no drafts), then along to 44 ms at 8
    assert [1e3 * cost(d) for d in (0, 4, 6, 8, 10)] == pytest.approx([33.5, 38.75, 41.375, 44.0, 46.625])
    assert vb.cost_curve({4: (9, 0.03)}) is None  # no step without drafts measured: no baseline


def test_the_one_request_bound_refuses_files_it_cannot_read(tmp_path, capsys, monkeypatch):
    vb = _vllm_bound()
    old = tmp_path / "old.json"
    old.write_text('{"rows": []}')  # a results file from before prompts and outputs were kept
    cases = [([str(tmp_path / "missing.json")], "cannot read the results file"),
             ([str(old)], "no prompts or no-speculation outputs at concurrency 1"),
             ([str(old), "--min-match", "0,x"], "--min-match must be positive integers")]
    for argv, said in cases:
        monkeypatch.setattr("sys.argv", ["vllm_copy_bound.py", *argv])
        with pytest.raises(SystemExit):
            vb.main()
        assert said in capsys.readouterr().err
