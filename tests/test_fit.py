"""The device-fitted policy: lossless, prunes to what pays on the given latency curve, falls back."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import goose
from goose.latency import LatencyCurve, curve_for, measure
from goose.testing import ToyCausalLM, reference_greedy

FLAT = {1: 1.0, 128: 1.0}  # a forward over 128 tokens costs one token's (GPU-like)
STEEP = {1: 1.0, 2: 2.0, 128: 128.0}  # cost grows with every token: nothing pays unless certain


def run(prompt, n, latency, **opts):
    dec = goose.compose(
        ToyCausalLM(16), None, sources=["pld", "tr"], policy="spine-fit",
        policy_options={"latency": latency, **opts}, budget=24,
    )
    out = dec.generate(prompt, max_new_tokens=n)
    assert out.token_ids == reference_greedy(prompt, n, 16)
    return out


@settings(max_examples=25, deadline=None)
@given(
    prompt=st.lists(st.integers(0, 15), min_size=1, max_size=30),
    n=st.integers(1, 60),
    latency=st.sampled_from([FLAT, STEEP, {1: 1.0, 8: 1.5, 32: 4.0, 128: 20.0}]),
    prior=st.sampled_from([0.05, 0.3, 0.9]),
)
def test_fit_is_lossless(prompt, n, latency, prior):
    run(prompt, n, latency, prior=prior)


def test_steep_latency_falls_back_to_plain_decoding():
    out = run([1, 2, 3, 4] * 5, 60, STEEP, prior=0.3, explore_every=1000)
    st_ = out.stats.extra["policy"]
    assert st_["fit_fallback_steps"] > 0
    assert out.stats.routes.get("single", 0) >= st_["fit_fallback_steps"]


def test_flat_latency_keeps_whole_trees():
    out = run([1, 2, 3, 4] * 5, 60, FLAT, prior=0.3)
    st_ = out.stats.extra["policy"]
    assert st_["fit_fallback_steps"] == 0
    assert st_["fit_nodes_kept"] == st_["fit_nodes_offered"] > 0


def test_latency_curve_interpolates_and_extends():
    c = LatencyCurve((1, 4, 8), (1.0, 2.0, 4.0))
    assert c(1) == 1.0 and c(2) == pytest.approx(4 / 3) and c(8) == 4.0 and c(16) == 8.0
    assert c.table(3) == [0.0, 1.0, pytest.approx(4 / 3), pytest.approx(5 / 3)]


def test_measure_and_cache_on_a_model():
    m = ToyCausalLM(16, max_positions=4096)
    c = measure(m, sizes=(1, 2, 4), past_len=16, repeats=1)
    assert c.sizes == (1, 2, 4) and all(b >= a for a, b in zip(c.seconds, c.seconds[1:], strict=False))
    c1 = curve_for(m)
    c2 = curve_for(m)  # second call: from the cache file
    assert c1 == c2


def test_fit_refuses_to_wrap_itself():
    with pytest.raises(goose.InvalidInputError, match="cannot wrap itself"):
        goose.compose(ToyCausalLM(16), None, sources=["pld", "tr"], policy="fit", policy_options={"inner": "spine-fit"})
