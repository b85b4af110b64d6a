"""The few-row linear form of tree passes (verifiers/skinny.py): lossless, temporary, thread-local."""

import threading

import pytest
import torch

import goose
from goose.verifiers import skinny

from test_hf_architectures import V, get, hf_greedy
from test_prefill_rows import cached


@pytest.mark.parametrize("arch,policy,budget", [("llama", "spine", 24), ("qwen2", "spine", 24), ("gemma3", "chain", 8)])
def test_skinny_tree_passes_are_lossless_on_stock_architectures(arch, policy, budget):
    model = get(arch)
    prompt = [5, 17, 33, 5, 17, 33, 5, 17, 60, 2, 5, 17]
    want = hf_greedy(model, prompt, 20)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy=policy, budget=budget,
                        verifier_options={"linear": "skinny"})
    out = dec.generate(prompt, max_new_tokens=20)
    assert out.token_ids == want
    vstats = out.stats.extra["verifier"]
    trees = sum(v for k, v in out.stats.routes.items() if k != "single")
    assert trees > 0 and vstats.get("skinny_passes", 0) == trees  # every tree pass ran rerouted
    # the reroute is temporary: no module keeps an instance forward
    assert all("forward" not in m.__dict__ for m in skinny.linears(model))


def test_skinny_form_computes_the_same_product():
    lin = torch.nn.Linear(24, 40).double()
    x = torch.randn(1, 7, 24, dtype=torch.float64)
    with skinny.rerouted(lin, [lin]):
        y = lin(x)
        one = lin(x[:, :1])  # one row: exactly F.linear
    assert torch.allclose(y, torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-12)
    assert torch.equal(one, torch.nn.functional.linear(x[:, :1], lin.weight, lin.bias))
    assert "forward" not in lin.__dict__


def test_other_threads_keep_stock_linear_layers_during_a_rerouted_pass():
    lin = torch.nn.Linear(8, 8)
    seen = {}
    inside, done = threading.Event(), threading.Event()

    def other():
        assert inside.wait(5)
        calls = []
        real = torch.matmul
        try:
            torch.matmul = lambda *a, **k: calls.append(1) or real(*a, **k)
            lin(torch.randn(4, 8))
        finally:
            torch.matmul = real
        seen["skinny_calls"] = len(calls)
        done.set()

    th = threading.Thread(target=other)
    th.start()
    with skinny.rerouted(lin, [lin]):
        inside.set()
        assert done.wait(5)
    th.join()
    assert seen["skinny_calls"] == 0


class _Threes(goose.DraftSource):
    """A chain of three tokens every step (right or not): every tree the loop verifies has four nodes."""

    name = "threes"

    def propose(self, state):
        t = state.tokens[-1]
        return goose.Proposal.chain(self.name, [(t + 1) % V, (t + 2) % V, (t + 3) % V])


def test_auto_uses_the_calibrated_sizes():
    """linear='auto' runs each tree size in the form the verifier's cached curve lists for it (here: skinny at
    4 nodes only); a forced form ignores the curve."""
    from goose.verifiers import latency

    model = get("llama")
    prompt = [5, 17, 33, 5, 17, 33, 5, 17, 60, 2, 5, 17]
    curve = latency.LatencyCurve((1, 2, 4), (1.0, 1.0, 1.0), forms=(("skinny", (4,)),))
    dec = goose.compose(model, None, sources=[_Threes()], policy="chain", budget=8)
    sizes = []

    class Sizes:
        @goose.hookimpl
        def goose_on_step(self, decoder, step):
            sizes.append(step.tree.num_nodes)

    goose.register_plugin(Sizes(), name="tree-sizes-seen")
    try:
        with cached(model, dec.verifier, curve):
            out = dec.generate(prompt, max_new_tokens=12)
    finally:
        goose.unregister_plugin("tree-sizes-seen")
    assert out.token_ids == hf_greedy(model, prompt, 12)
    vstats = out.stats.extra["verifier"]
    assert vstats["linear"]["option"] == "auto" and vstats["linear"]["forms"] == {"4": "skinny"}
    assert sizes.count(4) > 0 and vstats.get("skinny_passes", 0) == sizes.count(4)  # every 4-node pass, only those
    assert set(sizes) - {4}  # passes of other sizes ran (stock)
    stock = goose.compose(model, None, sources=[_Threes()], policy="chain", budget=8,
                          verifier_options={"linear": "stock"})
    with cached(model, stock.verifier, curve):
        out = stock.generate(prompt, max_new_tokens=12)
    vstats = out.stats.extra["verifier"]
    assert vstats["linear"]["forms"] == {} and "skinny_passes" not in vstats


def test_a_verifier_calibrated_after_its_first_prefill_runs_the_new_curve():
    """A verifier calibrated on first use met its first prefill (the calibration's own) before any curve existed:
    once the calibration says which forms it kept, the next generation runs the curve's forms."""
    from goose.verifiers import latency

    model = get("llama")
    prompt = [5, 17, 33, 5, 17, 33, 5, 17, 60, 2, 5, 17]
    dec = goose.compose(model, None, sources=[_Threes()], policy="chain", budget=8)
    first = dec.generate(prompt, max_new_tokens=12)  # no curve cached yet: stock at every size
    assert first.stats.extra["verifier"]["linear"]["forms"] == {}
    curve = latency.LatencyCurve((1, 2, 4), (1.0, 1.0, 1.0), forms=(("skinny", (4,)),))
    with cached(model, dec.verifier, curve):
        dec.verifier.forms_kept(frozenset({"skinny"}))
        out = dec.generate(prompt, max_new_tokens=12)
    assert out.token_ids == hf_greedy(model, prompt, 12)
    assert out.stats.extra["verifier"]["linear"]["forms"] == {"4": "skinny"}


def test_calibration_times_both_forms():
    from goose.verifiers.latency import measure

    model = get("llama")
    v = goose.greedy(model).verifier
    assert "skinny" in v.pass_forms()
    # no early stop: under load one slow pass would otherwise end the curve (the test is about forms, not speed)
    c = measure(model, v, sizes=(1, 2, 3, 4), past_len=8, repeats=1, stop_ratio=1e9, budget_s=1e9)
    assert c.sizes == (1, 2, 3, 4) and set(c.sizes_in("skinny")) <= {2, 3, 4}
    assert {f for f, _ in c.forms} <= set(v.pass_forms())
