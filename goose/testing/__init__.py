"""A test kit for Goose and for third-party components.

- :class:`ToyCausalLM`: a causal LM with the Hugging Face forward contract whose logits are an exact
  integer function of the (token, position) pairs each position may attend to. Any mask, position
  or cache bug changes its output, and it has no floating-point ties.
- :func:`reference_greedy`: greedy decoding of the toy computed from scratch (no cache, no mask):
  the oracle the property tests compare against.
- :class:`ArbitraryTreeSource`: a draft source that emits arbitrary trees drawn by Hypothesis,
  mixing correct (oracle) tokens and wrong ones.
- :class:`RecallSource`: an example source that learns across requests through ``end`` (docs/plugins.md).
- :class:`ArbitraryChainSource`, :class:`ArbitrarySuccessorSource`: chains and successors mixing
  the toy's greedy tokens and wrong ones (the policy kit's sources).
- :func:`echo_prompt`: a prompt that holds its own greedy continuation on the toy model.
- :class:`SourceLosslessnessKit`: subclass it in your plugin's tests to check that your draft
  source keeps output identical to greedy decoding.
- :class:`PolicyLosslessnessKit`: the same for a tree policy, over drawn chain, tree and
  successor sources; every tree it returns checked against its budget, its anchor and its credits.
- :class:`VerifierLosslessnessKit`: the same for a verifier: its output against greedy and sampled
  references, every pass's rows against the toy's logits and the greedy walk, deferred prefill rows,
  and ``end`` once per generation.
"""

from goose.testing.toy import ToyCausalLM, ToySplitLM, reference_greedy, reference_logits, reference_next, reference_sample
from goose.testing.examples import RecallOptions, RecallSource
from goose.testing.kit import (
    ArbitraryChainSource,
    ArbitrarySuccessorSource,
    ArbitraryTreeSource,
    PolicyLosslessnessKit,
    ReferenceTreeSource,
    SourceLosslessnessKit,
    echo_prompt,
    trees,
)
from goose.testing.verifier_kit import PrefillRowsSource, VerifierLosslessnessKit

__all__ = [
    "ToyCausalLM",
    "ToySplitLM",
    "reference_greedy",
    "reference_sample",
    "reference_logits",
    "reference_next",
    "ArbitraryTreeSource",
    "ArbitraryChainSource",
    "ArbitrarySuccessorSource",
    "ReferenceTreeSource",
    "echo_prompt",
    "RecallSource",
    "RecallOptions",
    "SourceLosslessnessKit",
    "PolicyLosslessnessKit",
    "VerifierLosslessnessKit",
    "PrefillRowsSource",
    "trees",
]
