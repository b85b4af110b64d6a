"""Layer 1 of losslessness: arbitrary draft trees on an exact toy model equal greedy decoding.

The fault-injection tests break the mask, the position ids or the KV commit on purpose and check
that the same property then fails: the property can catch a one-token bug.
"""

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import goose
import goose.tree
from goose.testing import ArbitraryTreeSource, ToyCausalLM, reference_greedy
from goose.testing.kit import ArbitraryTreeOptions
from goose.verifiers.transformers_tree import TransformersVerifier

NO_SHRINK = (Phase.explicit, Phase.generate)  # fault tests need a failing case, not the smallest one

V = 16

prompts = st.lists(st.integers(0, V - 1), min_size=1, max_size=40)
cases = st.fixed_dictionaries(
    {
        "prompt": prompts,
        "max_new": st.integers(0, 48),
        "budget": st.integers(1, 24),
        "eos": st.none() | st.integers(0, V - 1),
        "seed": st.integers(0, 2**32 - 1),
        "p_oracle": st.sampled_from([0.0, 0.3, 0.6, 0.9, 1.0]),
        "p_chain": st.sampled_from([0.0, 0.5, 0.9]),
    }
)


def run_case(c):
    model = ToyCausalLM(V, eos_token_id=c["eos"])
    src = ArbitraryTreeSource(ArbitraryTreeOptions(seed=c["seed"], p_oracle=c["p_oracle"], p_chain=c["p_chain"]))
    dec = goose.compose(model, None, sources=[src], policy="proposal", budget=c["budget"])
    out = dec.generate(c["prompt"], max_new_tokens=c["max_new"])
    ref = reference_greedy(c["prompt"], c["max_new"], V, [] if c["eos"] is None else [c["eos"]])
    assert out.token_ids == ref, f"diverged from greedy: {out.token_ids} != {ref}"
    assert len(out.token_ids) <= c["max_new"]
    assert out.stats.generated_tokens == len(ref)
    assert out.stats.forward_passes == (0 if c["max_new"] == 0 else out.stats.steps + 1)
    assert model.forward_calls == out.stats.forward_passes
    return out


@given(cases)
def test_arbitrary_trees_equal_greedy(c):
    run_case(c)


@settings(max_examples=30, deadline=None)
@given(prompt=prompts, max_new=st.integers(0, 48), eos=st.none() | st.integers(0, V - 1))
def test_greedy_decoder_equals_reference(prompt, max_new, eos):
    model = ToyCausalLM(V, eos_token_id=eos)
    out = goose.greedy(model).generate(prompt, max_new_tokens=max_new)
    assert out.token_ids == reference_greedy(prompt, max_new, V, [] if eos is None else [eos])


@settings(max_examples=30, deadline=None)
@given(prompt=prompts, max_new=st.integers(1, 60), budget=st.integers(2, 30))
def test_pld_chain_equals_greedy(prompt, max_new, budget):
    model = ToyCausalLM(V)
    dec = goose.compose(model, None, sources=["pld"], policy="chain", budget=budget)
    out = dec.generate(prompt, max_new_tokens=max_new)
    assert out.token_ids == reference_greedy(prompt, max_new, V)


def test_deep_acceptance_happens():
    """The oracle-heavy source must produce long accepted paths, or the property proves little."""
    out = run_case(dict(prompt=[1, 2, 3], max_new=40, budget=20, eos=None, seed=7, p_oracle=1.0, p_chain=0.9))
    assert max(out.stats.accept_lengths) >= 5
    assert out.stats.tau > 2


def test_max_new_tokens_zero_runs_no_forward():
    model = ToyCausalLM(V)
    out = goose.compose(model, None, sources=["pld"]).generate([1, 2, 3], max_new_tokens=0)
    assert out.token_ids == [] and out.stats.forward_passes == 0 and model.forward_calls == 0


def test_eos_inside_accepted_path_is_cut():
    """Find a prompt whose greedy continuation hits eos mid-way; a full-oracle chain must stop there."""
    for start in range(200):
        prompt = [start % V, (start * 7) % V]
        ref = reference_greedy(prompt, 30, V)
        eos = ref[5]
        if eos not in ref[:5]:
            break
    out = run_case(dict(prompt=prompt, max_new=30, budget=20, eos=eos, seed=1, p_oracle=1.0, p_chain=1.0))
    assert out.token_ids[-1] == eos and len(out.token_ids) == 6
    assert out.stats.stopped_by == "eos"


# ----------------------------------------------------------------------------------------------
# Fault injection: each deliberate one-token bug must make the property fail.
# ----------------------------------------------------------------------------------------------
def _property_fails() -> BaseException | None:
    """Run the property; return the failure it finds (None if none). Prints how many cases it took."""
    tried = {"n": 0, "first_failure": None}

    @settings(max_examples=200, deadline=None, database=None, phases=NO_SHRINK, suppress_health_check=list(HealthCheck))
    @given(cases)
    def prop(c):
        tried["n"] += 1
        try:
            run_case(c)
        except Exception:
            if tried["first_failure"] is None:
                tried["first_failure"] = tried["n"]
            raise

    try:
        prop()
    except Exception as exc:  # noqa: BLE001 - an assertion or a crash: either way it fails
        print(f"property failed at generated case {tried['first_failure']} ({tried['n']} cases run incl. shrinking)")
        return exc
    print(f"property held on {tried['n']} cases")
    return None


def _diverged(exc: BaseException | None) -> str:
    """The injected fault was caught as what it is, a divergence from greedy decoding (``run_case``'s
    assertion), not a crash elsewhere; the message for the assert."""
    assert exc is not None, "the property held: the injected fault went unnoticed"
    assert isinstance(exc, AssertionError) and "diverged from greedy" in str(exc), f"not a divergence: {exc!r}"
    return str(exc)


def test_fault_mask_sibling_leak_is_caught(monkeypatch):
    orig = goose.tree.additive_mask

    def leaky(anc, past_len, dtype=None, device=None):
        anc = anc.copy()
        for i in range(1, anc.shape[0]):
            anc[i, i - 1] = True  # each node also sees the node laid out just before it
        return orig(anc, past_len, dtype, device)

    monkeypatch.setattr(goose.tree, "additive_mask", leaky)
    _diverged(_property_fails())


def test_fault_mask_hides_prefix_token_is_caught(monkeypatch):
    orig = goose.tree.additive_mask

    def hide_first(anc, past_len, dtype=None, device=None):
        m = orig(anc, past_len, dtype, device)
        if past_len:
            m[..., 0] = m.new_tensor(-1e30) if m.dtype.is_floating_point else 0
        return m

    monkeypatch.setattr(goose.tree, "additive_mask", hide_first)
    _diverged(_property_fails())


def test_fault_position_ids_by_layout_is_caught(monkeypatch):
    import torch

    def by_index(self, past_len, device=None):
        return torch.arange(past_len, past_len + self.num_nodes, device=device).view(1, -1)

    monkeypatch.setattr(goose.tree.DraftTree, "position_ids", by_index)
    _diverged(_property_fails())


def test_fault_kv_commit_without_gather_is_caught(monkeypatch):
    def crop_only(self, past, path, num_nodes):
        remove = num_nodes - len(path)
        if remove > 0:
            self.cache.crop(-remove)

    monkeypatch.setattr(TransformersVerifier, "commit", crop_only)
    _diverged(_property_fails())


def test_fault_kv_commit_off_by_one_is_caught(monkeypatch):
    orig = TransformersVerifier.commit

    def keep_one_less(self, past, path, num_nodes):
        orig(self, past, path, num_nodes)
        if len(path) > 1:
            self.cache.crop(-1)
            self.past_len_fault = True

    monkeypatch.setattr(TransformersVerifier, "commit", keep_one_less)
    exc = _property_fails()
    # a cache one position short is caught either way the random search meets it first: the next tree's
    # mask no longer fits the cache (the toy model refuses it; the verifier names itself), or the pass
    # runs on the short cache and the output diverges from greedy decoding (seen in a full CI-profile run)
    if isinstance(exc, goose.VerifierError):
        assert exc.hook == "verify" and "does not fit" in str(exc), repr(exc)
    else:
        _diverged(exc)


def test_unbroken_property_passes_the_same_search():
    assert _property_fails() is None
