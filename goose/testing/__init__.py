"""A test kit for Goose and for third-party components.

- :class:`ToyCausalLM`: a causal LM with the Hugging Face forward contract whose logits are an exact integer
  function of the (token, position) pairs each position may attend to: any mask, position or cache bug changes
  its output, and it has no floating-point ties. :func:`reference_greedy` decodes it from scratch (no cache, no
  mask): the oracle the property tests compare against.
- Draft sources mixing the toy's greedy tokens and wrong ones: :class:`ArbitraryTreeSource` (trees),
  :class:`ArbitraryChainSource` (chains), :class:`ArbitrarySuccessorSource` (successors); :func:`echo_prompt`:
  a prompt that holds its own greedy continuation; :class:`RecallSource`: an example source that learns across
  requests through ``end`` (docs/plugins.md).
- :class:`SourceLosslessnessKit`, :class:`PolicyLosslessnessKit`, :class:`VerifierLosslessnessKit`: pytest base
  classes that check a draft source, a tree policy or a verifier keeps output identical to greedy decoding.
"""

from goose.testing.toy import ToyCausalLM, ToySplitLM, reference_greedy, reference_logits, reference_next, reference_sample
from goose.testing.examples import RecallOptions, RecallSource
from goose.testing.kit import (ArbitraryChainSource, ArbitrarySuccessorSource, ArbitraryTreeSource, PolicyLosslessnessKit,
                               ReferenceTreeSource, SourceLosslessnessKit, echo_prompt, trees)
from goose.testing.verifier_kit import PrefillRowsSource, VerifierLosslessnessKit

__all__ = [
    "ToyCausalLM", "ToySplitLM", "reference_greedy", "reference_sample", "reference_logits", "reference_next",
    "ArbitraryTreeSource", "ArbitraryChainSource", "ArbitrarySuccessorSource", "ReferenceTreeSource", "echo_prompt",
    "RecallSource", "RecallOptions", "SourceLosslessnessKit", "PolicyLosslessnessKit", "VerifierLosslessnessKit",
    "PrefillRowsSource", "trees",
]
