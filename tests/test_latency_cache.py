"""The latency cache shared by every process: what a stored curve is keyed by, and what may replace it.

- The key names what timed the curve: the composed verifier's ``timing_key`` (its class, name, version and
  the options its passes' time depends on), and the threads, dtype and CPU. A plugin verifier in the built-in's
  place, another version or another option is another curve.
- A check that disagrees with a stored curve only for a while (another benchmark running) does not replace
  it; a disagreement that lasts while the curve is measured anew, and that the new curve does not share,
  does. The progress lines say which.
- A curve measured while torch's thread count changed is used by that process and not stored.

The verifier timed here reports its passes at a rate the test sets (its speed protocol's ``time_pass``), so
what the cache decides does not depend on the machine's load.
"""

import json

import pytest
import torch
from pydantic import Field

import goose
import goose.verifiers.latency as lat
from goose.testing import ToyCausalLM
from goose.verifiers.transformers_tree import TransformersVerifier, TreeVerifierOptions
from test_verifier_kit import Wrapping

KW = dict(sizes=(1, 2, 4, 8), past_len=8, repeats=1, measure_head=False)
BUILTIN = "goose.verifiers.transformers_tree.TransformersVerifier"


def _builtin(model, **options):
    v = TransformersVerifier(TreeVerifierOptions(**options))
    v.bind(model)
    return v


class RatedOptions(goose.Options):
    depth: int = Field(1, description="an option of this verifier (a default timing key names every option)")


class Rated(Wrapping):
    """The built-in verifier, wrapped: its passes run, and each reports ``rate["s"]`` seconds a node.

    ``after``: the rate once a calibration ends (``forms_kept`` is called at the end of every measurement, not
    by a check): the machine's load changed meanwhile. ``threads``: torch's thread count set then instead."""

    name = "rated"
    Options = RatedOptions

    def __init__(self, rate, options=None):
        super().__init__(options)
        self.rate = rate
        self.after = self.threads = None
        self.measured = 0

    def time_pass(self, tree, form=None):
        self.inner.time_pass(tree)
        return self.rate["s"] * tree.num_nodes

    def forms_kept(self, forms):
        self.measured += 1
        if self.after is not None:
            self.rate["s"] = self.after
        if self.threads is not None:
            torch.set_num_threads(self.threads)  # what numba's pool launch once did to the caller's setting


def _rated(rate):
    model = ToyCausalLM(16)
    v = Rated(rate)
    v.bind(model)
    return model, v


def _new_process():
    lat._checked.clear()
    lat._process_curves.clear()


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Each test starts with an empty cache, as a process of its own."""
    monkeypatch.setattr(lat, "cache_dir", lambda: tmp_path)
    _new_process()
    yield
    _new_process()


def test_the_key_names_the_class_version_and_options_that_timed_the_curve():
    model = ToyCausalLM(16)
    builtin = _builtin(model)
    base = lat.curve_path(model, builtin)
    assert builtin.timing_key()["class"] == BUILTIN and builtin.timing_key()["name"] == "transformers"
    assert lat.curve_path(model, _builtin(model)) == base  # the same verifier: the same curve
    assert goose.greedy(model).verifier.timing_key() == builtin.timing_key()  # what a default decoder composes
    gqa = _builtin(model, gqa=False)
    assert gqa.timing_key()["gqa"] is False and lat.curve_path(model, gqa) != base  # an option its time depends on
    stock = _builtin(model, linear="stock")
    assert stock.timing_key()["linear"] == "stock" and lat.curve_path(model, stock) != base

    class Elsewhere(TransformersVerifier):  # a plugin in the built-in's place
        pass

    class Later(TransformersVerifier):
        version = "2"

    elsewhere, later = Elsewhere(), Later()
    elsewhere.bind(model)
    later.bind(model)
    assert elsewhere.timing_key()["class"].endswith("Elsewhere") and lat.curve_path(model, elsewhere) != base
    two = lat.curve_path(model, later)
    assert later.timing_key()["version"] == "2" and two != base
    later.version = "3"  # raised when a change makes the verifier's earlier curves stale
    assert lat.curve_path(model, later) not in (base, two)

    # a verifier with the default timing key: its class, name, version and every option
    _, rated = _rated({"s": 0.001})
    deeper = Rated({"s": 0.001}, RatedOptions(depth=2))
    deeper.bind(model)
    assert rated.timing_key() == {"class": f"{__name__}.Rated", "name": "rated", "version": "1",
                                  "options": {"depth": 1}}
    assert lat.curve_path(model, deeper) != lat.curve_path(model, rated)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert lat.curve_path(model, builtin) != base  # the threads it runs with
    finally:
        torch.set_num_threads(threads)
    assert lat.curve_path(model, builtin) == base


def test_the_curve_is_measured_through_the_composed_verifiers_passes():
    rate = {"s": 0.002}
    model, v = _rated(rate)
    curve = lat.curve_for(model, v, **KW)
    assert curve.seconds == pytest.approx((0.002, 0.004, 0.008, 0.016)) and v.measured == 1
    assert lat.cached_curve(model, v) == curve and lat.curve_path(model, v).exists()
    assert lat.curve_path(model, _builtin(model)) != lat.curve_path(model, v)  # not the built-in's curve
    assert lat.curve_for(model, v, **KW) == curve and v.measured == 1  # cached, not measured again


def test_a_passing_disagreement_keeps_the_stored_curve(capsys):
    """Another process loads the machine while a check runs and while the curve is measured anew, then
    stops: the stored curve holds again and stays, for this process and every later one."""
    rate = {"s": 0.002}
    model, v = _rated(rate)
    first = lat.curve_for(model, v, **KW)
    stored = lat.curve_path(model, v).read_text()
    v.after = 0.002  # the other process ends once the curve is measured anew
    _new_process()
    capsys.readouterr()
    rate["s"] = 0.006  # busy
    got = lat.curve_for(model, v, **KW)
    err = capsys.readouterr().err
    assert v.measured == 2  # measured anew, then not stored
    assert got == first
    assert "disagrees (t(1) 2.0 ms cached, 6.0 ms now" in err and "holds again" in err
    assert lat.curve_path(model, v).read_text() == stored
    _new_process()
    assert lat.curve_for(model, v, **KW) == first and v.measured == 2


def test_a_lasting_disagreement_replaces_the_stored_curve(capsys):
    rate = {"s": 0.002}
    model, v = _rated(rate)
    first = lat.curve_for(model, v, **KW)
    _new_process()
    capsys.readouterr()
    rate["s"] = 0.004  # slower for good (another host under the same CPU name)
    got = lat.curve_for(model, v, **KW)
    err = capsys.readouterr().err
    assert got(1) == pytest.approx(0.004) and got != first
    assert "still disagrees" in err and "stored in its place" in err
    assert lat.LatencyCurve.from_dict(json.loads(lat.curve_path(model, v).read_text())) == got


def test_when_neither_curve_holds_the_process_uses_the_new_one_and_the_stored_one_stays(capsys):
    rate = {"s": 0.002}
    model, v = _rated(rate)
    first = lat.curve_for(model, v, **KW)
    stored = lat.curve_path(model, v).read_text()
    v.after = 0.012  # the load changes again once the curve is measured anew
    _new_process()
    capsys.readouterr()
    rate["s"] = 0.006
    got = lat.curve_for(model, v, **KW)
    assert got(1) == pytest.approx(0.006)
    assert "neither the cached" in capsys.readouterr().err
    assert lat.curve_path(model, v).read_text() == stored
    assert lat.cached_curve(model, v) == got  # what this process's verifier reads too
    assert lat.curve_for(model, v, **KW) == got and v.measured == 2  # measured once per process
    _new_process()
    assert lat.cached_curve(model, v) == first


def test_a_curve_measured_while_the_thread_count_changed_is_not_stored(capsys):
    model, v = _rated({"s": 0.002})
    threads = torch.get_num_threads()
    v.threads = threads + 1
    try:
        path = lat.curve_path(model, v)
        got = lat.curve_for(model, v, **KW)
        assert "thread count changed" in capsys.readouterr().err
        assert not path.exists()
        torch.set_num_threads(threads)
        assert lat.curve_path(model, v) == path and lat.cached_curve(model, v) == got
    finally:
        torch.set_num_threads(threads)
        _new_process()
