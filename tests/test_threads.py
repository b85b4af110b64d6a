"""One decoder shared between threads: every built-in policy, greedy and sampling, equals the same calls
made one after another (issue 37).

The toy here is :class:`~goose.testing.ToySplitLM`, built as transformers' causal LMs are (a decoder
module and an LM head applied apart), so the verifier defers the prefill's logit rows and captures the
decoder's hidden states with a hook on the shared model, as it does on SmolLM2. The thread switch
interval is cut to 0.1 ms for these tests, so threads interleave inside every forward.
"""

from __future__ import annotations

import dataclasses
import sys
import threading

import pytest
import torch

import goose
from goose.decoding import Decoder
from goose.manager import get_registry
from goose.testing import ToyCausalLM, ToySplitLM, reference_greedy
from goose.verifiers import transformers_tree as greedy_verifier

pytestmark = pytest.mark.filterwarnings("ignore::goose.compose.CompositionWarning")

VOCAB = 16
FIXED = {"latency": {1: 1.0, 128: 1.0}}  # fit policies: a flat curve, not a measurement of the toy
SOURCES = {"pld+tr": ["pld", "tr"], "pld+suffix+tr": ["pld", "suffix", "tr"],
           # two successor sources: merged branches, per-set branch rates and the step's asked answers
           "pld+tr+context-bigram": ["pld", "tr", "context-bigram"]}


def _builtin_policies() -> list[str]:
    reg = get_registry()
    return sorted(n for n, e in reg.entries["policy"].items() if e.origin == "builtin" and e.alias_of is None)


def _policy_options(name: str) -> dict | None:
    entry = get_registry().get("policy", name)
    return dict(FIXED) if "latency" in entry.cls.Options.model_fields else None


def _compose(policy: str, sources: str, verifier=None) -> Decoder:
    """``verifier``: a callable that makes the decoder's verifier (None: the built-in)."""
    return goose.compose(ToySplitLM(VOCAB), None, sources=SOURCES[sources], policy=policy,
                         policy_options=_policy_options(policy), budget=24,
                         **({} if verifier is None else {"verifier": verifier()}))


def _prompts(k: int) -> list[list[int]]:
    """Prompts of 12-40 tokens with repeats in them (the context-match sources find something to copy)."""
    out = []
    for i in range(k):
        motif = [(3 * i + 5 * j + 1) % VOCAB for j in range(3 + i % 4)]
        out.append((motif * 12)[: 12 + (7 * i) % 29])
    return out


def _calls(threads: int, per_thread: int, sample: bool) -> list[list[dict]]:
    """Each thread's calls: (prompt, max_new_tokens, seed)."""
    prompts = _prompts(threads * per_thread)
    return [[dict(prompt=prompts[t * per_thread + j], n=14 + 9 * ((t + j) % 3), seed=1000 * t + j if sample else None)
             for j in range(per_thread)] for t in range(threads)]


def _generate(dec: Decoder, call: dict, sample: bool) -> list[int]:
    if not sample:
        return dec.generate(call["prompt"], max_new_tokens=call["n"]).token_ids
    g = torch.Generator().manual_seed(call["seed"])
    return dec.generate(call["prompt"], max_new_tokens=call["n"], do_sample=True, temperature=0.7, generator=g).token_ids


def run_threads(dec: Decoder, calls: list[list[dict]], sample: bool) -> tuple[dict, list]:
    """Every thread's calls on one decoder, the threads started together; (results by (t, j), errors)."""
    results, errors = {}, []
    start = threading.Barrier(len(calls))

    def work(t):
        try:
            start.wait()
            for j, call in enumerate(calls[t]):
                results[t, j] = _generate(dec, call, sample)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(len(calls))]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return results, errors


def check_threads_equal_sequence(policy: str, sources: str, sample: bool, threads: int, per_thread: int = 2,
                                 verifier=None) -> None:
    calls = _calls(threads, per_thread, sample)
    if sample:  # the same calls, one after another, on a decoder of their own
        seq_dec = _compose(policy, sources, verifier)
        expected = {(t, j): _generate(seq_dec, c, sample) for t, cs in enumerate(calls) for j, c in enumerate(cs)}
    else:  # greedy: what any sequence of these calls gives (the toy's oracle)
        expected = {(t, j): reference_greedy(c["prompt"], c["n"], VOCAB) for t, cs in enumerate(calls) for j, c in enumerate(cs)}
    dec = _compose(policy, sources, verifier)
    got, errors = run_threads(dec, calls, sample)
    assert not errors, f"{len(errors)} of {threads} threads failed; the first: {errors[0]!r}"
    wrong = [k for k in expected if got.get(k) != expected[k]]
    assert not wrong, f"{len(wrong)} of {len(expected)} calls differ from the same calls in sequence: {wrong[:5]}"
    assert dec.component_sets_in_use == 0  # every component set went back to the pool


@pytest.fixture(autouse=True)
def _switch_often():
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    yield
    sys.setswitchinterval(before)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("sources", ["pld+tr", "pld+suffix+tr"])
@pytest.mark.parametrize("policy", _builtin_policies())
def test_every_policy_in_four_threads_equals_the_calls_in_sequence(policy, sources, sample):
    check_threads_equal_sequence(policy, sources, sample, threads=4)


@pytest.mark.parametrize("threads", [2, 8])
@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("policy", ["spine", "spine-fit", "iso3"])
def test_two_and_eight_threads(policy, sample, threads):
    check_threads_equal_sequence(policy, "pld+suffix+tr", sample, threads=threads)


@pytest.mark.parametrize("sample", [False, True], ids=["greedy", "sample"])
@pytest.mark.parametrize("policy", ["spine", "spine-fit", "iso3"])
def test_two_successor_sources_in_four_threads(policy, sample):
    """The example project's branch source beside tr (installed by the README's command): each component set
    keeps its own branch rates and the answers its step asked for."""
    pytest.importorskip("goose_example_source")
    check_threads_equal_sequence(policy, "pld+tr+context-bigram", sample, threads=4)


# -- a pass of another thread inside this thread's prefill ----------------------------------------
class _Interleaved(ToySplitLM):
    """Holds a prompt's forward (a prefill: more than ``hold_above`` positions) between its decoder and its
    head until ``release`` is set, after announcing it on ``inside``: another thread's pass then runs
    through the same decoder module while this thread's prefill is under way."""

    def __init__(self, hold_above: int):
        super().__init__(VOCAB)
        self.hold_above, self.inside, self.release = hold_above, threading.Event(), threading.Event()
        self.held_once = False
        real = self.model.forward

        def forward(*a, **k):
            out = real(*a, **k)
            ids = a[0] if a else k["input_ids"]
            if ids.shape[1] > self.hold_above and not self.held_once:
                self.held_once = True
                self.inside.set()
                assert self.release.wait(10)
            return out

        self.model.forward = forward


def _prefill_meets_another_pass() -> dict:
    """Thread A's prefill (a 40-token prompt) is held after its decoder ran; thread B decodes a short
    prompt meanwhile, its passes running through the decoder module that A's prefill hooked."""
    model = _Interleaved(hold_above=30)
    dec = goose.compose(model, None, sources=["pld", "tr"], policy="spine", budget=24)
    long_p, short_p = ([3, 8, 13, 2, 7, 12] * 7)[:40], [4, 5, 6, 4, 5, 6, 4]
    assert len(long_p) == 40 and len(short_p) <= 30
    out: dict = {}

    def a():
        try:
            out["a"] = dec.generate(long_p, max_new_tokens=30)
        except BaseException as exc:  # noqa: BLE001 - reported by the caller
            out["a"] = exc

    th = threading.Thread(target=a)
    th.start()
    try:
        assert model.inside.wait(10)
        out["b"] = dec.generate(short_p, max_new_tokens=30)
    finally:
        model.release.set()
        th.join()
    if isinstance(out["a"], BaseException):
        raise out["a"]
    assert out["a"].token_ids == reference_greedy(long_p, 30, VOCAB)
    assert out["b"].token_ids == reference_greedy(short_p, 30, VOCAB)
    return {k: o.stats.extra for k, o in out.items()}


def test_another_threads_pass_during_a_prefill_is_not_taken_for_its_rows():
    extra = _prefill_meets_another_pass()
    # A's 40 prompt positions were deferred and computed after the prefill, and token recycling read them all
    rows = extra["a"]["prefill_logit_rows"]
    assert rows == 40, f"thread A's prefill gave its sources {rows} of its 40 deferred rows"
    assert extra["a"]["tr"]["harvested_positions"] >= 40


# -- the tests above catch shared state: faults injected ------------------------------------------
def test_fault_a_capture_that_takes_every_threads_pass_is_caught(monkeypatch):
    """The prefill's hidden-state capture as it was before the fix: every thread's passes taken."""
    import contextlib

    @contextlib.contextmanager
    def every_thread(decoder, k):
        held = []
        handle = decoder.register_forward_hook(lambda _m, _a, out: held.append(out.last_hidden_state[0, -k:].clone()))
        try:
            yield held
        finally:
            handle.remove()

    monkeypatch.setattr(greedy_verifier, "final_hidden", every_thread)
    with pytest.raises(AssertionError, match="deferred rows"):
        test_another_threads_pass_during_a_prefill_is_not_taken_for_its_rows()


class _FewerRows(greedy_verifier.TransformersVerifier):
    """A verifier that hands the loop a prefill whose logits have fewer rows than its tokens."""

    name = "fewer-rows"

    def prefill(self, prompt_ids, keep=None):
        v = super().prefill(prompt_ids, keep)
        return dataclasses.replace(v, logits=v.logits[-1:], argmax=v.argmax[-1:])


def test_a_pass_with_fewer_logit_rows_than_tokens_is_refused_naming_the_verifier():
    dec = goose.compose(ToyCausalLM(VOCAB), None, sources=["pld", "tr"], policy="spine",
                        verifier=_FewerRows(greedy_verifier.TreeVerifierOptions(defer_prefill_rows=False)))
    with pytest.raises(goose.PluginError, match=r"Verifier 'fewer-rows' returned a prefill pass with 1 logit rows for 20 tokens"):
        dec.generate(list(range(16)) + [1, 2, 3, 4], max_new_tokens=8)


class _Shared(greedy_verifier.TransformersVerifier):
    """The built-in verifier, copied as itself: every component set the decoder makes for a concurrent call
    holds this one verifier (one KV cache for every thread)."""

    name = "shared"

    def __deepcopy__(self, memo):
        return self


def test_fault_one_verifier_for_every_thread_is_caught():
    with pytest.raises(AssertionError, match="threads failed|differ from the same calls"):
        check_threads_equal_sequence("spine", "pld+tr", sample=False, threads=4, verifier=_Shared)


# -- state shared on purpose, made safe ---------------------------------------------------------
class _SlowPasses(greedy_verifier.TransformersVerifier):
    """The built-in verifier whose timed passes take 5 ms each (a calibration takes long enough for
    every other thread to arrive meanwhile); it records which threads timed passes and how many calibrations
    ended (``forms_kept``)."""

    name = "slow-passes"

    def __init__(self):
        super().__init__()
        self.timed_by: set = set()
        self.calibrations = 0

    def time_pass(self, tree, form=None):
        self.timed_by.add(threading.get_ident())
        threading.Event().wait(0.005)
        super().time_pass(tree, form)
        return 0.001 * tree.num_nodes

    def forms_kept(self, forms):
        self.calibrations += 1
        super().forms_kept(forms)


def test_threads_that_need_one_latency_curve_measure_it_once():
    import goose.verifiers.latency as lat

    model = ToyCausalLM(VOCAB)
    v = _SlowPasses()
    v.bind(model)
    assert lat.cached_curve(model, v) is None  # its own key: no curve cached by an earlier test
    got = []
    kw = dict(sizes=(1, 2, 4, 8), past_len=8, repeats=3, measure_head=False)
    threads = [threading.Thread(target=lambda: got.append(lat.curve_for(model, v, **kw))) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert v.calibrations == 1 and len(v.timed_by) == 1  # one thread measured, once; the others waited for it
    assert len(got) == 4 and len(set(got)) == 1 and got[0] == lat.cached_curve(model, v)


def test_the_curve_file_is_never_torn(tmp_path, monkeypatch):
    """Writers replace the file whole: a reader between two writes parses one of them, and a writer that
    fails leaves the old file and no temporary file behind."""
    import json

    import goose.verifiers.latency as lat

    path = tmp_path / "curve.json"
    texts = [json.dumps({"writer": w, "pad": "x" * 200_000}) for w in range(3)]
    lat.write_atomic(path, texts[0])
    stop, seen, errors = threading.Event(), set(), []

    def reader():
        while not stop.is_set():
            try:
                seen.add(json.loads(path.read_text())["writer"])
            except ValueError as exc:  # a torn file
                errors.append(exc)

    def writer(w):
        for _ in range(30):
            lat.write_atomic(path, texts[w])

    r = threading.Thread(target=reader)
    r.start()
    ws = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for th in ws:
        th.start()
    for th in ws:
        th.join()
    stop.set()
    r.join()
    assert not errors and seen <= {0, 1, 2}
    assert path.stat().st_mode & 0o777 == 0o644  # readable as an ordinary write leaves it

    def fail(src, dst):
        raise OSError("disk full")

    before = path.read_text()
    monkeypatch.setattr(lat.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        lat.write_atomic(path, texts[1])
    assert path.read_text() == before and [p.name for p in tmp_path.iterdir()] == ["curve.json"]


def test_the_bypass_nesting_count_is_per_thread(monkeypatch):
    """Thread A is held inside its bypass's construction (depth 1) while this thread composes bypasses nested
    as deep as allowed: a count shared between threads would add A's level and refuse this one."""
    from goose import manager
    from goose.policies import spine

    inside, release = threading.Event(), threading.Event()
    real = manager.build_inner
    holder = {}

    def held_build_inner(*a, **k):
        if threading.get_ident() == holder.get("a"):
            inside.set()
            assert release.wait(10)
        return real(*a, **k)

    monkeypatch.setattr(manager, "build_inner", held_build_inner)

    def nested(depth):
        opts = {"inner": "spine-tree"}
        for _ in range(depth - 1):
            opts = {"inner": "bypass", "inner_options": opts}
        return opts

    errors = []

    def a():
        holder["a"] = threading.get_ident()
        try:
            goose.compose(ToyCausalLM(VOCAB), None, sources=["pld", "tr"], policy="bypass")
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    th = threading.Thread(target=a)
    th.start()
    try:
        assert inside.wait(10)
        goose.compose(ToyCausalLM(VOCAB), None, sources=["pld", "tr"], policy="bypass",
                      policy_options=nested(spine._MAX_NESTING))
        with pytest.raises(goose.InvalidInputError, match="nest more than 8 deep"):
            goose.compose(ToyCausalLM(VOCAB), None, sources=["pld", "tr"], policy="bypass",
                          policy_options=nested(spine._MAX_NESTING + 1))
    finally:
        release.set()
        th.join()
    assert not errors and getattr(spine._NESTING, "depth", 0) == 0


def test_a_decoder_composed_during_another_threads_tree_pass_finds_every_linear_layer():
    """The reroute puts a forward on the shared layers during a tree pass; a verifier bound meanwhile must
    still take them for plain layers (a forward someone else put there, accelerate's, it leaves alone)."""
    from goose.verifiers import skinny

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    before = skinny.linears(model)
    with skinny.rerouted(model, before):
        assert skinny.linears(model) == before
    other = torch.nn.Linear(8, 8)
    other.forward = lambda x: x  # someone else's forward on the instance
    assert skinny.linears(torch.nn.Sequential(other)) == []
