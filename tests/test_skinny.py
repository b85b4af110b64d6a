"""The few-row linear form of tree passes (verifiers/skinny.py): lossless, temporary, thread-local."""

import threading

import pytest
import torch

import goose
from goose.verifiers import skinny

from test_hf_architectures import get, hf_greedy


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


def test_auto_uses_the_calibrated_sizes(monkeypatch):
    from goose.verifiers import latency

    model = get("llama")
    curve = latency.LatencyCurve((1, 2, 4), (1.0, 1.0, 1.0), skinny=(4,))
    monkeypatch.setattr(latency, "cached_curve", lambda m, setup=None: curve)
    dec = goose.compose(model, None, sources=["pld"], policy="chain", budget=8)
    v = dec.verifier
    assert v._form_for(4) == "skinny" and v._form_for(2) is None and v._form_for(1) is None
    stock = goose.compose(model, None, sources=["pld"], policy="chain", budget=8, verifier_options={"linear": "stock"})
    assert stock.verifier._form_for(4) is None


def test_calibration_times_both_forms():
    from goose.verifiers.latency import measure

    # no early stop: under load one slow pass would otherwise end the curve (the test is about forms, not speed)
    c = measure(get("llama"), sizes=(1, 2, 3, 4), past_len=8, repeats=1, stop_ratio=1e9, budget_s=1e9)
    assert c.sizes == (1, 2, 3, 4) and set(c.skinny) <= {2, 3, 4}
