"""The latency cache shared by every process: what a stored curve is keyed by, and what may replace it.

- The key names what timed the curve: the class registered under the timing verifier's name (a plugin in
  the built-in's place is another producer), its version and options, the threads, dtype and CPU.
- A check that disagrees with a stored curve only for a while (another benchmark running) does not replace
  it; a disagreement that lasts while the curve is measured anew, and that the new curve does not share,
  does. The progress lines say which.
- A curve measured while torch's thread count changed is used by that process and not stored.
"""

import dataclasses
import json

import pytest
import torch

import goose.verifiers.latency as lat
from goose.manager import get_registry
from goose.testing import ToyCausalLM

KW = dict(sizes=(1, 2, 4, 8), past_len=8, repeats=1, measure_head=False)


def _clocked(monkeypatch, rate):
    """A toy model whose forward takes ``rate["s"]`` per token on a clock the latency module reads."""
    clock = {"t": 0.0}

    class Clocked(ToyCausalLM):
        def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kw):
            clock["t"] += rate["s"] * input_ids.shape[1]
            return super().forward(input_ids, attention_mask, position_ids, cache, use_cache, **kw)

    monkeypatch.setattr(lat.time, "perf_counter", lambda: clock["t"])
    return Clocked(16)


def _after_measuring(monkeypatch, rate, then: float) -> None:
    """Once :func:`lat.measure` returns, the forward takes ``then`` a token (the machine's load changed)."""
    real = lat.measure

    def measure(*a, **k):
        try:
            return real(*a, **k)
        finally:
            rate["s"] = then

    monkeypatch.setattr(lat, "measure", measure)


def _new_process():
    lat._checked.clear()
    lat._process_curves.clear()


def test_the_key_names_the_class_version_and_options_that_timed_the_curve(monkeypatch):
    model = ToyCausalLM(16)
    base = lat.curve_path(model)
    assert lat.timed_by()["class"] == "goose.verifiers.transformers_tree.TransformersVerifier"
    assert lat.curve_path(model, {"gqa": False}) != base  # another option of the timing verifier

    entry = get_registry().get("verifier", lat.TIMING_VERIFIER)

    class Elsewhere(entry.cls):  # a plugin registered under the built-in's name
        pass

    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(get_registry().entries["verifier"], lat.TIMING_VERIFIER, dataclasses.replace(entry, cls=Elsewhere))
        assert lat.timed_by()["class"].endswith("Elsewhere")
        assert lat.curve_path(model) != base
        mp.setattr(Elsewhere, "version", "2")
        elsewhere = lat.curve_path(model)
        mp.setattr(Elsewhere, "version", "3")
        assert lat.curve_path(model) != elsewhere  # its version
    assert lat.curve_path(model) == base
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert lat.curve_path(model) != base  # the threads it runs with
    finally:
        torch.set_num_threads(threads)


def test_a_passing_disagreement_keeps_the_stored_curve(monkeypatch, capsys):
    """Another process loads the machine while a check runs and while the curve is measured anew, then
    stops: the stored curve holds again and stays, for this process and every later one."""
    rate = {"s": 0.002}
    model = _clocked(monkeypatch, rate)
    first = lat.curve_for(model, **KW)
    stored = lat.curve_path(model).read_text()
    _after_measuring(monkeypatch, rate, 0.002)  # the other process ends
    _new_process()
    capsys.readouterr()
    rate["s"] = 0.006  # busy
    got = lat.curve_for(model, **KW)
    err = capsys.readouterr().err
    assert got == first
    assert "disagrees (t(1) 2.0 ms cached, 6.0 ms now" in err and "holds again" in err
    assert lat.curve_path(model).read_text() == stored
    _new_process()
    assert lat.curve_for(model, **KW) == first


def test_a_lasting_disagreement_replaces_the_stored_curve(monkeypatch, capsys):
    rate = {"s": 0.002}
    model = _clocked(monkeypatch, rate)
    first = lat.curve_for(model, **KW)
    _new_process()
    capsys.readouterr()
    rate["s"] = 0.004  # slower for good (another host under the same CPU name)
    got = lat.curve_for(model, **KW)
    err = capsys.readouterr().err
    assert got(1) == pytest.approx(0.004) and got != first
    assert "still disagrees" in err and "stored in its place" in err
    assert lat.LatencyCurve.from_dict(json.loads(lat.curve_path(model).read_text())) == got


def test_when_neither_curve_holds_the_process_uses_the_new_one_and_the_stored_one_stays(monkeypatch, capsys):
    rate = {"s": 0.002}
    model = _clocked(monkeypatch, rate)
    first = lat.curve_for(model, **KW)
    stored = lat.curve_path(model).read_text()
    _after_measuring(monkeypatch, rate, 0.012)  # the load changes again
    _new_process()
    capsys.readouterr()
    rate["s"] = 0.006
    got = lat.curve_for(model, **KW)
    assert got(1) == pytest.approx(0.006)
    assert "neither the cached" in capsys.readouterr().err
    assert lat.curve_path(model).read_text() == stored
    assert lat.cached_curve(model) == got  # what this process's verifier reads too
    assert lat.curve_for(model, **KW) == got  # measured once per process
    _new_process()
    assert lat.cached_curve(model) == first


def test_a_curve_measured_while_the_thread_count_changed_is_not_stored(monkeypatch, capsys):
    model = ToyCausalLM(16)
    real = lat.measure
    threads = torch.get_num_threads()

    def changes_threads(*a, **k):
        out = real(*a, **k)
        torch.set_num_threads(threads + 1)  # what numba's pool launch once did to the caller's setting
        return out

    monkeypatch.setattr(lat, "measure", changes_threads)
    try:
        path = lat.curve_path(model)
        got = lat.curve_for(model, **KW)
        assert "thread count changed" in capsys.readouterr().err
        assert not path.exists()
        torch.set_num_threads(threads)
        assert lat.cached_curve(model) == got
    finally:
        torch.set_num_threads(threads)
        _new_process()
