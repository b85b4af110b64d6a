"""Goose's draft sources inside vLLM: a ``custom_class`` speculative proposer (docs/vllm.md).

vLLM verifies one draft **chain** per request per engine step. :class:`Proposer` drafts it with Goose's
registered sources:

- each request gets its own copies of the sources (``begin`` when it first appears, ``end`` when it leaves
  the batch, so a cross-request source such as ``suffix`` learns its text);
- every source's chain is merged as the ``spine`` policy merges them (:mod:`goose.policies.chains`), led by the chain
  with the most expected accepted tokens under each source's measured acceptance, per band of the confidence
  its proposal reports (:mod:`goose.policies.rates`);
- how many tokens of each request's chain are drafted is planned for the whole batch (:meth:`Proposer.plan`):
  the tokens most likely to be accepted, across every request, as long as they add more expected committed
  tokens per second than the rows they add cost in the engine step, as measured while the engine runs
  (:class:`goose.vllm.cost.StepCost`); a batch where drafted rows cost what they earn gets none, and runs
  as without speculation;
- where drafting has not paid over a window of steps, the sources rest; where asking them has cost more than
  the plans after it saved, they are asked on one step in ``ask_every``; a probe step now and then keeps the
  cost of a step without drafts measured;
- ``tr`` (token recycling) is served from the logits vLLM computes: :class:`goose.vllm.recycle.Recycler`
  wraps the model's ``compute_logits`` (vLLM passes a proposer no logits, but hands it the model).

Losslessness is vLLM's: it verifies every drafted token with its own sampler.

Use (the engine imports this package by its path, in the worker process)::

    from vllm import LLM
    llm = LLM(model=path, speculative_config={
        "method": "custom_class", "model": "goose.vllm.Proposer", "num_speculative_tokens": 16})

Options (:class:`goose.vllm.options.ProposerOptions`, docs/options.md): ``$GOOSE_VLLM_OPTIONS`` (a JSON
object) and ``$GOOSE_VLLM_SOURCES`` (``pld{max_chain=32}+suffix{history=64}+tr``) for the proposer vLLM builds,
or ``Proposer(vllm_config, options={...})``.

Requests are not given by id: each batch row's tokens identify it. A row is matched to the state of the
request whose known tokens it extends (the same row first, then any other, since rows move when requests
leave); a state that no row extends has left and is freed; a preempted request that comes back starts anew.
"""

from goose.vllm.cost import StepCost, pool_non_decreasing, solve_normal3
from goose.vllm.options import ProposerOptions
from goose.vllm.proposer import ENV_OPTIONS, ENV_SOURCES, ENV_TRACE, RECYCLING, Proposer, build_sources, resolve_options
from goose.vllm.recycle import Recycler

__all__ = ["ENV_OPTIONS", "ENV_SOURCES", "ENV_TRACE", "RECYCLING", "Proposer", "ProposerOptions", "Recycler",
           "StepCost", "build_sources", "pool_non_decreasing", "resolve_options", "solve_normal3"]
