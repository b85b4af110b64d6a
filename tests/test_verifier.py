"""What the verifier reports to observers: predecessors, paths, the cache after commits."""

import pytest
import torch

import goose
from goose.testing import ToyCausalLM
from goose.verifiers.transformers_tree import ROOT_PREDECESSOR_ROUTES


def test_root_predecessor_by_route():
    steps = []

    class Obs:
        @goose.hookimpl
        def goose_on_step(self, decoder, step):
            steps.append(step)

    goose.register_plugin(Obs(), name="obs")
    prompt = [3, 1, 4, 1, 5, 9, 2, 6] * 2
    for policy, sources in [("none", []), ("chain", ["pld"]), ("spine", ["pld", "tr"])]:
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
        assert {s.tree.route for s in steps} <= {"single", "path", "branched", "bypassed"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_top1_is_argmax_with_ties(dtype):
    """The walk's argmax picks the first of equal maxima in every dtype, as greedy decoding does."""
    from goose.verifiers.transformers_tree import top1

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(64, 4096, generator=g) * 2).round().to(dtype)  # coarse values: many ties
    x[0, 7] = x[0, 3] = x[0].max() + 1  # an exact tie on row 0
    assert top1(x) == tuple(x.float().argmax(-1).tolist())
    assert top1(x)[0] == 3


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("vocab", [5, 4099, 262_144])
def test_top1_equals_argmax_on_edge_values(threads, vocab):
    """``max(-1).indices`` is the walk's argmax: equal to ``argmax`` on ties, NaN, infinities, rows of -inf
    and strided views, at a small, an odd and Gemma-3's vocabulary size, on one thread and two."""
    from goose.verifiers.transformers_tree import top1

    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(vocab)
        x = torch.randint(0, 3, (9, vocab), generator=g).float()  # ties everywhere
        x[1] = torch.randn(vocab, generator=g)
        x[2, vocab // 2] = float("nan")
        x[3, -1] = x[3, 0] = float("inf")
        x[4] = float("-inf")
        x[5] = 1.5
        x[6, torch.randperm(vocab, generator=g)[: max(1, vocab // 100)]] = float("nan")
        x[7, vocab - 1] = 3.0  # the maximum at the last index
        for view in (x, x[:, : vocab - 1] if vocab > 1 else x, x[::2], x.to(torch.bfloat16)):
            assert top1(view) == tuple(view.argmax(-1).tolist()), view.dtype
    finally:
        torch.set_num_threads(old)
