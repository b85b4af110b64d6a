"""The verifier's speed protocol (goose.Verifier: timing_key, pass_forms, form_serves, time_pass, forms_kept):
a fitted policy prices trees by the latency curve of the verifier it was composed with, timed through that
verifier's own passes and cached under its own key.

- A plugin verifier that wraps the built-in (the example project's ``tree-sizes``) gets a curve of its own.
- A verifier with pass forms of its own sees each timed only at the sizes it serves, and learns which forms
  the curve kept.
- A verifier without the protocol is timed through its own ``verify``.
"""

import pytest

import goose
from goose.testing import ToySplitLM, reference_greedy
from goose.verifiers import latency
from goose.verifiers.transformers_tree import TransformersVerifier
from test_verifier_kit import Wrapping

V = 16
PROMPT = [3, 8, 13, 2, 7, 12, 3, 8, 13, 2, 7, 12]


@pytest.fixture(autouse=True)
def cache(tmp_path, monkeypatch):
    """An empty cache of this test's own: the user's (latency curves, stored tiers) is never read or written."""
    monkeypatch.setenv("GOOSE_CACHE", str(tmp_path))
    # the suite's conftest points the latency cache at one folder for the whole session: this test's own instead
    monkeypatch.setattr(latency, "cache_dir", lambda: tmp_path / "latency")
    return tmp_path / "latency"


def _builtin_path(model):
    v = TransformersVerifier()
    v.bind(model)
    return latency.curve_path(model, v)


def test_a_plugin_verifier_that_wraps_the_builtin_gets_its_own_curve(cache):
    pytest.importorskip("goose_example_source")
    model = ToySplitLM(V)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit", verifier="tree-sizes", budget=16)
    v = dec.verifier
    assert type(v).__name__ == "CountingVerifier" and v.timing_key()["class"] == "goose_example_source.CountingVerifier"
    path = latency.curve_path(model, v)
    assert path != _builtin_path(model)
    assert path.exists() and [p.name for p in cache.iterdir()] == [path.name]  # its curve alone: not the built-in's
    assert dec.policy.curve == latency.cached_curve(model, v)  # the curve the fit prices trees by
    # it was timed through the plugin's own passes (its verify, which counts the trees it is sent)
    assert sum(v.stats()["tree_sizes"].values()) > 0
    out = dec.generate(PROMPT, max_new_tokens=40)
    assert out.token_ids == reference_greedy(PROMPT, 40, V)
    assert out.token_ids == goose.greedy(model).generate(PROMPT, max_new_tokens=40).token_ids
    # a second decoder of the same composition reads that curve, measures none
    again = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit", verifier="tree-sizes", budget=16)
    assert again.policy.curve == dec.policy.curve and [p.name for p in cache.iterdir()] == [path.name]


class Halves(Wrapping):
    """The built-in verifier, wrapped, with a pass form of its own, ``half``, that serves passes of 2 to 12 nodes at
    half the default's time (the times are reported, not measured: the calibration's choices are the test's).
    ``timed`` records each (nodes, form) the calibration asked for; ``kept`` what ``forms_kept`` was told."""

    name = "halves"

    def __init__(self, options=None):
        super().__init__(options)
        self.timed: list = []
        self.kept = None

    def pass_forms(self):
        return ("half",)

    def form_serves(self, form, rows):
        return form == "half" and 2 <= rows <= 12

    def time_pass(self, tree, form=None):
        n = tree.num_nodes
        self.timed.append((n, form))
        self.inner.time_pass(tree)  # a real pass over the cache; its time is the default's below
        return 0.001 * (1 + 0.1 * n) * (0.5 if form == "half" else 1.0)

    def forms_kept(self, forms):
        self.kept = forms


def test_a_verifier_with_forms_of_its_own_is_timed_in_them_where_they_serve(cache):
    model = ToySplitLM(V)
    v = Halves()
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit", verifier=v, budget=16)
    halves = [n for n, f in v.timed if f == "half"]
    assert halves and all(2 <= n <= 12 for n in halves)  # timed in its form, only where the form serves
    assert all(f in (None, "half") for _, f in v.timed)
    curve = dec.policy.curve
    assert curve == latency.cached_curve(model, v) and latency.curve_path(model, v).exists()
    assert [f for f, _ in curve.forms] == ["half"] and v.kept == frozenset({"half"})  # what the curve kept
    assert set(curve.sizes_in("half")) <= set(range(2, 13)) and curve.form(1) is None and curve.form(16) is None
    assert curve(4) == pytest.approx(0.0007)  # priced in the form it runs in: half of 1.4 ms
    out = dec.generate(PROMPT, max_new_tokens=30)
    assert out.token_ids == reference_greedy(PROMPT, 30, V)


class Narrow(Halves):
    """``half`` serves passes of 2 to 4 nodes only: fewer than the calibration's warm-up compares forms at."""

    name = "narrow"

    def form_serves(self, form, rows):
        return form == "half" and 2 <= rows <= 4


def test_a_form_is_never_timed_at_a_size_it_does_not_serve(cache):
    model = ToySplitLM(V)
    v = Narrow()
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit", verifier=v, budget=16)
    halves = sorted({n for n, f in v.timed if f == "half"})
    assert halves and set(halves) <= {2, 3, 4}, halves  # the warm-up and the walk alike
    assert set(dec.policy.curve.sizes_in("half")) <= {2, 3, 4}
    assert dec.generate(PROMPT, max_new_tokens=20).token_ids == reference_greedy(PROMPT, 20, V)


class Plain(Wrapping):
    """A wrapping verifier without the speed protocol: greedy only, counting its verify calls."""

    name = "plain-wrap"

    def __init__(self, options=None):
        super().__init__(options)
        self.verifies = 0

    def verify(self, tree, rule=None):
        self.verifies += 1
        return super().verify(tree, rule)

    def end(self):
        self.inner.end()


def test_a_verifier_without_the_protocol_is_timed_through_its_own_verify(cache):
    model = ToySplitLM(V)
    v = Plain()
    assert v.pass_forms() == () and v.timing_key()["class"].endswith(".Plain")
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine-fit", verifier=v, budget=16)
    timed = v.verifies
    assert timed > 0  # the calibration ran its verify
    assert [p.name for p in cache.iterdir()] == [latency.curve_path(model, v).name]
    assert dec.policy.curve.forms == () and dec.policy.curve == latency.cached_curve(model, v)
    out = dec.generate(PROMPT, max_new_tokens=30)
    assert out.token_ids == reference_greedy(PROMPT, 30, V)
    assert v.verifies - timed == out.stats.forward_passes - 1  # then one verify a pass after the prefill
