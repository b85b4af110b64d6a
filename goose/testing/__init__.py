"""A test kit for Goose and for third-party components (docs/plugins.md, "Testing it"): the exact toy model
(:class:`ToyCausalLM`) and its from-scratch oracles (:func:`reference_greedy`, ...), draft sources mixing the toy's
greedy tokens and wrong ones, and the losslessness kits: pytest base classes that check a draft source, a tree
policy or a verifier keeps output identical to greedy decoding."""

from goose.testing.toy import (ToyCausalLM, ToySplitLM, reference_greedy, reference_logits, reference_next,
                               reference_sample)
from goose.testing.examples import RecallOptions, RecallSource
from goose.testing.kit import (ArbitraryChainSource, ArbitrarySuccessorSource, ArbitraryTreeSource,
                               PolicyLosslessnessKit, ReferenceTreeSource, SourceLosslessnessKit, echo_prompt, trees)
from goose.testing.verifier_kit import PrefillRowsSource, VerifierLosslessnessKit

__all__ = [
    "ToyCausalLM", "ToySplitLM", "reference_greedy", "reference_sample", "reference_logits", "reference_next",
    "ArbitraryTreeSource", "ArbitraryChainSource", "ArbitrarySuccessorSource", "ReferenceTreeSource", "echo_prompt",
    "RecallSource", "RecallOptions", "SourceLosslessnessKit", "PolicyLosslessnessKit", "VerifierLosslessnessKit",
    "PrefillRowsSource", "trees",
]
