"""What the verifier reports to observers: predecessors, paths, the cache after commits."""

import pytest
import torch

import goose
from goose.testing import ToyCausalLM
from goose.verifiers.greedy import ROOT_PREDECESSOR_ROUTES


def test_root_predecessor_by_route():
    steps = []

    class Obs:
        @goose.hookimpl
        def goose_on_step(self, decoder, step):
            steps.append(step)

    goose.register_plugin(Obs(), name="obs")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 2
    for policy, sources in [("greedy", []), ("chain", ["pld"]), ("spine", ["pld", "tr"])]:
        steps.clear()
        out = goose.compose(ToyCausalLM(16), None, sources=sources, policy=policy).generate(prompt, max_new_tokens=30)
        seq = list(prompt) + out.token_ids
        produced = 1  # the prefill committed the first token
        for st in steps:
            v = st.verified
            before_anchor = seq[len(prompt) + produced - 2]
            want = before_anchor if st.tree.route in ROOT_PREDECESSOR_ROUTES else -1
            assert int(v.predecessors[0]) == want, (policy, st.tree.route)
            for i in range(1, st.tree.num_nodes):
                assert int(v.predecessors[i]) == st.tree.tokens[st.tree.parents[i]]
            assert v.tree.tokens[0] == seq[len(prompt) + produced - 1]
            produced += len(st.committed)
        assert produced == len(out.token_ids)
        assert {s.tree.route for s in steps} <= {"single", "chain", "spine", "bypass"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top1_is_argmax_with_ties(dtype):
    """The walk's argmax picks the first of equal maxima in every dtype, as greedy decoding does."""
    from goose.verifiers.greedy import top1

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4096, generator=g) * 2).round().to(dtype)  # coarse values: many ties
    x[0, 7] = x[0, 3] = x[0].max() + 1  # an exact tie on row 0
    assert top1(x) == tuple(x.float().argmax(-1).tolist())
    assert top1(x)[0] == 3
