"""Goose's draft sources inside vLLM: a ``custom_class`` speculative proposer (docs/vllm.md).

Use (the engine imports this package by its path, in the worker process)::

    LLM(model=path, speculative_config={
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
