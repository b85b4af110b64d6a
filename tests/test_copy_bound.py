"""benchmarks/copy_bound.py: the oracle copy drafter that bounds what copying gives a repeating workload."""

import importlib.util
from pathlib import Path

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
