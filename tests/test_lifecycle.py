"""The end-of-generation call (issue 21, point 5): sources and policies learn what was committed.

A source that remembers each finished generation (``end``) and drafts from that history in the
next request: on one decoder, the second time a prompt is asked it drafts the whole first answer
and the model accepts it; the output stays identical to greedy decoding.
"""

import pytest

import goose
from goose.testing import RecallSource, ToyCausalLM, reference_greedy

V = 16


Recall = RecallSource  # goose.testing's example source (drafts what followed the last 3 tokens earlier)


class Counting(goose.TreePolicy):
    name = "counting-chain"
    ends = 0

    def shape(self, ctx):
        for name, p in ctx.proposals().items():
            return p.as_tree(ctx.state.anchor)
        return None

    def end(self, output):
        type(self).ends += 1


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


def test_a_source_learns_across_requests_through_end():
    src = Recall()
    dec = goose.compose(ToyCausalLM(V, max_positions=128), None, sources=[src], policy="chain")
    want = reference_greedy(PROMPT, 40, V)
    first = dec.generate(PROMPT, max_new_tokens=40)
    second = dec.generate(PROMPT, max_new_tokens=40)
    assert first.token_ids == second.token_ids == want
    assert len(src.ends) == 2 and src.ends[0].token_ids == want and src.ends[0].prompt_ids == tuple(PROMPT)
    assert src.ends[1].stats is second.stats
    # the second request drafts the first answer: far fewer forwards
    acc = second.stats.per_source.get("recall", {}).get("accepted", 0)
    assert acc >= 30 and second.stats.forward_passes < first.stats.forward_passes / 3


@pytest.mark.parametrize("policy", ["chain", "spine", "spine-fit", "iso3"])
def test_end_is_called_once_per_generation_through_wrapping_policies(policy):
    src = Recall()
    kw = {"policy_options": {"latency": {1: 1.0, 64: 1.0}}} if policy == "spine-fit" else {}
    dec = goose.compose(ToyCausalLM(V, max_positions=128), None, sources=[src, "tr"], policy=policy, **kw)
    for n in (5, 9):
        assert dec.generate(PROMPT, max_new_tokens=n).token_ids == reference_greedy(PROMPT, n, V)
    assert [len(o.token_ids) for o in src.ends] == [5, 9]


def test_a_policy_hears_the_end_too_and_errors_in_end_are_named():
    Counting.ends = 0
    dec = goose.compose(ToyCausalLM(V), None, sources=["pld"], policy=Counting())
    dec.generate(PROMPT, max_new_tokens=6)
    assert Counting.ends == 1

    class Bad(Recall):
        name = "bad-end"

        def end(self, output):
            raise RuntimeError("disk full")

    dec = goose.compose(ToyCausalLM(V), None, sources=[Bad()], policy="chain")
    with pytest.raises(goose.DraftSourceError, match=r"'bad-end' failed: end\(\) raised RuntimeError: disk full"):
        dec.generate(PROMPT, max_new_tokens=6)
