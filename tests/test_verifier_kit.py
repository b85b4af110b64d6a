"""The verifier kit (goose.testing.VerifierLosslessnessKit): it passes the built-in verifier and a wrapping
one, and fails verifiers with one fault each (faults its checks are there to catch)."""

from dataclasses import replace

import pytest

import goose
from goose.testing import VerifierLosslessnessKit
from goose.verifiers.transformers_tree import TransformersVerifier


class Wrapping(goose.Verifier):
    """A verifier that wraps the built-in one and verifies greedily only (docs/plugins.md, "A verifier")."""

    name = "wrapping"

    def __init__(self, options=None):
        super().__init__(options)
        self.inner = TransformersVerifier()

    def bind(self, model):
        super().bind(model)
        self.inner.bind(model)

    def check_request(self, prompt_len, max_new_tokens, max_depth):
        self.inner.check_request(prompt_len, max_new_tokens, max_depth)

    def prefill(self, prompt_ids, keep=None, rule=None):
        return self.inner.prefill(prompt_ids, keep)

    def verify(self, tree, rule=None):
        return self.inner.verify(tree)

    def end(self):
        self.inner.end()


class TestBuiltinVerifier(VerifierLosslessnessKit):
    def make_verifier(self):
        return "transformers"


class TestGreedyVerifierRowsInPrefill(VerifierLosslessnessKit):
    max_examples = 10

    def make_verifier(self):
        return ("transformers", {"defer_prefill_rows": False, "headroom": False})


class TestWrappingVerifier(VerifierLosslessnessKit):
    max_examples = 10

    def make_verifier(self):
        return Wrapping()


# -- one fault each -------------------------------------------------------------------------------
class SwappedRows(TransformersVerifier):
    """Returns a tree pass's logit rows of two nodes off the walk's path swapped: the walk and the output are
    right, what the sources learn from is not (the loop checks the rows on the path only)."""

    name = "swapped-rows"

    def verify(self, tree, rule=None):
        v = super().verify(tree, rule)
        off = [i for i in range(tree.num_nodes) if i not in v.path]
        if len(off) < 2:
            return v
        logits = v.logits.clone()
        logits[off[:2]] = logits[off[1::-1]]
        return replace(v, logits=logits)


class ZeroPredecessors(TransformersVerifier):
    name = "zero-predecessors"

    def verify(self, tree, rule=None):
        v = super().verify(tree, rule)
        return replace(v, predecessors=v.predecessors * 0 + (v.tokens[0] + 1) % 16)


class DropsDeferredRows(TransformersVerifier):
    """Its deferred prefill rows hold the last position only."""

    name = "drops-deferred-rows"

    def prefill(self, prompt_ids, keep=None, rule=None):
        v = super().prefill(prompt_ids, keep, rule)
        if v.rest is None:
            return v
        rest = v.rest

        def last_only():
            full = rest()
            return None if full is None else replace(full, tokens=full.tokens[-1:], predecessors=full.predecessors[-1:],
                                                     logits=full.logits[-1:])

        return replace(v, rest=last_only)


class AcceptsOneLess(TransformersVerifier):
    """Reports one accepted token less than its walk found (the cache keeps it): the output diverges."""

    name = "accepts-one-less"

    def verify(self, tree, rule=None):
        v = super().verify(tree, rule)
        if len(v.path) < 2:
            return v
        return replace(v, path=v.path[:-1], accepted=v.accepted[:-1], bonus=v.accepted[-1])


class EndRaises(TransformersVerifier):
    name = "end-raises"

    def end(self):
        super().end()
        raise RuntimeError("the cache could not be released")


class IgnoresTheRule(TransformersVerifier):
    """Says it samples (supports_rules) but drops the loop's rule: it walks greedily."""

    name = "ignores-the-rule"

    def prefill(self, prompt_ids, keep=None, rule=None):
        return super().prefill(prompt_ids, keep)

    def verify(self, tree, rule=None):
        return super().verify(tree)


class TimesNothing(TransformersVerifier):
    """Its speed protocol reports no time for a pass in its default form."""

    name = "times-nothing"

    def time_pass(self, tree, form=None):
        return 0.0 if form is None else super().time_pass(tree, form)


@pytest.mark.parametrize("verifier,test,error,match", [
    (SwappedRows, "test_passes_are_exact", AssertionError, r"tree node \d \(path .*\): its logit row is not the model's"),
    (ZeroPredecessors, "test_passes_are_exact", AssertionError, "predecessors"),
    (DropsDeferredRows, "test_deferred_prefill_rows", AssertionError, r"deferred prefill rows cover 1 positions"),
    (AcceptsOneLess, "test_lossless_on_toy", AssertionError, "the walk.s path|diverged"),
    (AcceptsOneLess, "test_passes_are_exact", AssertionError, "the walk's path"),
    (EndRaises, "test_end_once_per_generation", goose.VerifierError, r"'end-raises' raised in end\(\)"),
    (IgnoresTheRule, "test_sampling_is_seed_identical", AssertionError, "sampling diverged"),
    (TimesNothing, "test_speed_protocol", AssertionError, r"time_pass\(<1 nodes>, None\) returned 0.0"),
])
def test_the_verifier_kit_fails_a_faulty_verifier(verifier, test, error, match):
    class Kit(VerifierLosslessnessKit):
        max_examples = 10

        def make_verifier(self):
            return verifier()

    with pytest.raises(error, match=match):
        getattr(Kit(), test)()


def test_the_verifier_kit_checks_a_greedy_only_verifier_refuses_sampling():
    """A verifier without supports_rules passes the sampling check by refusing the request, naming itself."""

    class Kit(VerifierLosslessnessKit):
        def make_verifier(self):
            return Wrapping()

    Kit().test_sampling_is_seed_identical()

    class Claims(Wrapping):  # says it refuses, but does sample: the kit sees the refusal missing
        name = "claims"
        supports_rules = True

    class Kit2(VerifierLosslessnessKit):
        max_examples = 6

        def make_verifier(self):
            return Claims()

    with pytest.raises(AssertionError, match="sampling diverged"):
        Kit2().test_sampling_is_seed_identical()
