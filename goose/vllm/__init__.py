"""Goose's draft sources inside vLLM: a ``custom_class`` speculative proposer (docs/vllm.md).

vLLM verifies one draft chain per request per engine step, with its own sampler (so the output is vLLM's).
:class:`Proposer` gives each request its own copies of the sources, merges their chains as the ``spine``
policy does, and plans how many tokens each request drafts for the whole batch against the engine step's
measured cost (:class:`StepCost`); ``tr`` is served from the logits vLLM computes (:class:`Recycler`).

Use (the engine imports this package by its path, in the worker process)::

    from vllm import LLM
    llm = LLM(model=path, speculative_config={
        "method": "custom_class", "model": "goose.vllm.Proposer", "num_speculative_tokens": 16})

Options: :class:`ProposerOptions`, given as ``$GOOSE_VLLM_OPTIONS`` (a JSON object) and ``$GOOSE_VLLM_SOURCES``
(``pld{max_chain=32}+suffix{history=64}+tr``) for the proposer vLLM builds, or ``Proposer(vllm_config, options=...)``.
"""

from goose.vllm.cost import StepCost, pool_non_decreasing, solve_normal3
from goose.vllm.options import ProposerOptions
from goose.vllm.proposer import ENV_OPTIONS, ENV_SOURCES, ENV_TRACE, RECYCLING, Proposer, build_sources, resolve_options
from goose.vllm.recycle import Recycler

__all__ = ["ENV_OPTIONS", "ENV_SOURCES", "ENV_TRACE", "RECYCLING", "Proposer", "ProposerOptions", "Recycler",
           "StepCost", "build_sources", "pool_non_decreasing", "resolve_options", "solve_normal3"]
