"""The proposer vLLM calls (``custom_class``): per request, its own copies of the sources; per step, every
request's chains merged (:mod:`goose.policies.chains`), priced against the engine's measured step cost
(:mod:`goose.vllm.cost`) and planned for the whole batch (:meth:`Proposer.plan`). docs/vllm.md explains each
decision ("How it decides what to draft")."""

from __future__ import annotations

import copy
import json
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from time import perf_counter
from types import SimpleNamespace

import numpy as np

from goose.policies.chains import Drafted, merge, rank
from goose.errors import InvalidInputError
from goose.interfaces import DraftSource, DraftState, Request, TokenView, call_source
from goose.policies.rates import SourceRates, shrunk
from goose.vllm.cost import StepCost
from goose.vllm.options import (ASK_DECAY, ASK_EVERY, MAY_PAY_EVERY, PRIOR, PRIOR_WEIGHT, PROBE_BELOW, REQUEST_WEIGHT,
                                REST_EARLY, REST_MAX, REST_STEPS, REST_WINDOW, START_REACH, ProposerOptions)
from goose.vllm.recycle import Recycler

ENV_SOURCES = "GOOSE_VLLM_SOURCES"
ENV_OPTIONS = "GOOSE_VLLM_OPTIONS"  # a JSON object of ProposerOptions, for the proposer vLLM builds
RECYCLING = "tr"  # the source name served by the Recycler
ENV_TRACE = "GOOSE_VLLM_TRACE"  # a file path: each call's step is written there (Proposer._trace)


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
    expected: float = 0.0  # expect summed over this request's drafts so far
    accepted: float = 0.0  # what was accepted of them


class Proposer:
    """vLLM ``custom_class`` proposer drafting with Goose's sources. vLLM gives no request ids: each batch row
    is matched to the request state whose known tokens it extends (:func:`_claim`); a state no row extends has
    left and is freed; a preempted request that comes back starts anew."""

    #: the clock steps are timed with (a simulated engine sets its own)
    clock = staticmethod(perf_counter)

    def __init__(self, vllm_config=None, *, options: ProposerOptions | Mapping | None = None,
                 sources: Sequence | None = None, num_speculative_tokens: int | None = None,
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
        self.options = o = resolve_options(options, sources=sources, min_reach=min_reach)
        self.pristine, self.recycler = self._build()
        self.rates = SourceRates(PRIOR, PRIOR_WEIGHT, max_depth=max(16, self.k), carry=1.0)
        if o.tier_floors:
            for s in self.pristine:
                self.rates.set_tiers(s.name, [(f, PRIOR, PRIOR) for f in o.tier_floors])
        self.live: dict[int, _Live] = {}  # by batch row
        self.cost = StepCost()
        # rested / rests: steps rested, rests begun; probes: steps left undrafted (see _open_step); idle / unpaid:
        # steps the sources were not asked (see _whether_to_ask)
        self.counts = {"steps": 0, "drafted": 0, "accepted": 0, "requests": 0, "freed": 0, "rematched": 0,
                       "rested": 0, "rests": 0, "probes": 0, "idle": 0, "unpaid": 0}
        self.propose_s = self.propose_max_s = 0.0  # seconds spent in propose, in all, and the longest call
        self.resting = 0  # steps left to rest
        self.recent = [0.0, 0.0]  # accepted tokens and what was expected of the drafts, decayed a step
        self._prior = 1.0  # recent_factor() as this step's call read it
        self._rest_n = 0  # decoding requests when the rest began
        # per bucket of decoding requests (StepCost.bucket): steps booked in the current window, the seconds they
        # saved, and how long the next rest lasts (see _weigh)
        self.ledgers: dict[int, list] = {}
        self._planned: tuple | None = None  # (time, decoding requests, drafted rows, drafting seconds) of the last plan
        # per bucket of decoding requests: decayed [weight, seconds the plans after asking expected to save,
        # seconds asking took, steps since the last ask] (see _worth_asking)
        self.asks: dict[int, list[float]] = {}
        self._may: dict[int, tuple[int, bool]] = {}  # bucket of decoding requests -> (step, whether a draft may pay)
        self.trace_path = os.environ.get(ENV_TRACE) or None
        self.trace: list[tuple] = []  # the calls not yet written (and the last 20 written)
        self._traced = 0  # calls traced
        _INSTANCES.add(self)

    @staticmethod
    def instances() -> list[Proposer]:
        """The proposers built in this process (vLLM builds one per engine, in its worker: the calling process
        with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``)."""
        return list(_INSTANCES)

    def forget(self) -> None:
        """Forget what the sources learned across requests (``suffix``'s history, the recycled table); the
        measured rates and step costs are kept, and the model stays attached."""
        self.pristine, _ = self._build()
        if self.recycler is not None:
            self.recycler.clear()

    def _build(self):
        """The sources each request copies, and the Recycler when ``tr`` is among them (else None)."""
        built = build_sources(self.options.sources)
        tr = next((s for s in built if s.name == RECYCLING), None)
        rec = None if tr is None else Recycler(tr.options.bigram, self.vocab_size)
        return [s for s in built if s.name != RECYCLING], rec

    def load_model(self, model=None, *args, **kwargs) -> None:
        """vLLM's runner calls this with the target model: with ``tr`` among the sources, its
        ``compute_logits`` is wrapped so the Recycler reads each step's rows."""
        if self.recycler is not None and model is not None and not self.recycler.attach(model):
            import warnings

            warnings.warn(f"goose.vllm: token recycling ({RECYCLING!r}) is off: the model vLLM handed the proposer "
                          f"({type(model).__name__}) has no compute_logits to read the target's predictions from. "
                          "Allowed: models vLLM serves for generation. Hint: GOOSE_VLLM_SOURCES=pld+suffix",
                          RuntimeWarning, stacklevel=2)
            self.recycler = None

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None, **_) -> list[list[int]]:
        """vLLM's call between two engine steps: the drafts for every batch row (``[]``: none)."""
        now, wall = self.clock(), perf_counter()
        pending, prompt, left, left_requests = self._rows(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        decoding, tokens_now = self._book_last(pending, sampled_token_ids)
        unusual = prompt or left_requests > 0  # the step just run ran a prompt or lost a request
        resting, priced, probe = self._open_step(now, decoding, tokens_now, unusual)
        t0 = perf_counter()
        ask, idle = self._whether_to_ask(decoding, resting or probe, priced)
        laid = [(i, st, *(self._draft(st) if ask else ([], []))) for i, st in decoding]
        drafting = perf_counter() - t0  # seconds asking the sources and planning (what resting saves)
        if resting:
            self.resting -= 1
            self.counts["rested"] += 1
        t0 = perf_counter()
        scaled = [_lifted(r, self._factor(st)) for _, st, _, r in laid]
        counts = self.plan(scaled)
        drafting += perf_counter() - t0
        if ask and priced:
            self._book_ask(len(laid), scaled, counts, drafting)
        out, rows_verified = self._hand_out(len(sampled_token_ids), laid, counts)
        self.cost.step(now, rows_verified, tokens_now, left, prompt=prompt, requests=len(laid),
                       left_requests=left_requests)
        self._close_step(now, wall, len(laid), rows_verified, ask, idle, drafting, tokens_now, unusual, resting)
        return out

    def _open_step(self, now: float, decoding, tokens_now: int, unusual: bool) -> tuple[bool, bool, bool]:
        """Book what the step just run says; ``(resting, priced, probe)``: whether the sources rest this step,
        whether the plan reads the measured cost, and whether this step drafts nothing to keep a step without
        drafts measured."""
        self._prior = self.recent_factor()
        self.recent[0] *= self.options.recent_decay
        self.recent[1] *= self.options.recent_decay
        if self._planned is not None:  # what the last plan's step gave, now that it has run
            self._weigh(now, tokens_now, unusual)
        if self.resting and not self._rest_n / 2 <= len(decoding) <= 2 * self._rest_n:
            self.resting = 0  # the batch has halved or doubled since the rest began: its own ledger judges it
        resting = self.resting > 0
        priced = bool(decoding) and self.options.min_reach is None and self.cost.ready()
        probe = not resting and priced and self.cost.weight(len(decoding), 0) < PROBE_BELOW
        self.counts["probes"] += probe
        return resting, priced, probe

    def _close_step(self, now: float, wall: float, requests: int, rows_verified: int, ask: bool, idle: bool,
                    drafting: float, tokens_now: int, unusual: bool, resting: bool) -> None:
        """The call's bookkeeping: counts and its own time, the plan the next call weighs, whether the recycler
        reads the next step's rows, and the trace."""
        self.counts["steps"] += 1
        spent = perf_counter() - wall
        self.propose_s += spent
        self.propose_max_s = max(self.propose_max_s, spent)
        if requests and ask and self.options.min_reach is None and self.cost.ready():  # priced by the measured cost
            self._planned = (now, requests, rows_verified - requests, drafting)
        if self.recycler is not None:  # the next step's rows are read only if the next call drafts (as this one)
            self.recycler.active = self.resting == 0 and not idle
        if self.trace_path is not None:
            self._trace((requests, rows_verified, round(spent * 1e3, 3), round(now * 1e3, 3), tokens_now,
                         int(unusual), int(resting)))

    def _rows(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu):
        """Match the rows to requests (new ones started, those that left freed) and harvest the recycler's rows:
        ``(pending, prompt, left, left_requests)``, ``pending`` one ``(row, state, its tokens)`` per live request,
        ``prompt`` whether the step just run carried prompt tokens, ``left`` / ``left_requests`` the rows and
        requests counted for that step whose request left before it ran."""
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
        """Book every request's last draft against the tokens the target sampled, before any is drafted (so the
        rates' memo holds for the step); ``(decoding, tokens_now)``: the ``(row, state)`` of each request decoding
        this step, and the tokens the step just run committed."""
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
        """Append this call's ``entry`` to the trace; the file is JSON lines, appended every 20 calls (one array
        per call) and every 200 with a ``{"stats": ...}`` line (:meth:`stats`)."""
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
        of its batch size, and judge its window (docs/vllm.md, "When the sources are not asked", *Rest*); not
        booked (``skip``): a step that ran a prompt or lost a request. Booked from what happened, not from what
        the plan expected: a plain window sum, since a decayed one goes negative between the lumpy steps that pay."""
        t0, n, drafted, drafting = self._planned
        self._planned = None
        if skip or not self.cost.ready() or self.cost.outlier(now - t0, n + drafted, n):
            return
        led = self.ledgers.setdefault(StepCost.bucket(n), [0, 0.0, REST_STEPS])
        led[0] += 1
        base = self.cost.cost(n, n)  # a step of n requests without drafts
        led[1] += tokens * base / n - (now - t0) if drafted else -drafting
        if led[0] < REST_WINDOW and led[1] > -REST_EARLY * base:
            return
        if led[1] < 0.0:
            self.resting, self._rest_n = led[2], n
            led[2] = min(REST_MAX, 2 * led[2])
            self.counts["rests"] += 1
        else:
            led[2] = REST_STEPS
        led[0], led[1] = 0, 0.0

    def _worth_asking(self, n: int) -> bool:
        """Whether to ask the sources on a step of ``n`` decoding requests: while fewer than 3 asks have been
        measured at this batch size, or the plans after asking expected to save more than asking took (decayed
        means, :meth:`_book_ask`); else on one step in ``ASK_EVERY``, so both stay measured."""
        a = self.asks.get(StepCost.bucket(n))
        if a is None or a[0] < 3.0 or a[1] > a[2]:
            return True
        a[3] = (a[3] + 1) % ASK_EVERY
        return a[3] == 0

    def _book_ask(self, n: int, reaches: Sequence[Sequence[float]], counts: Sequence[int], seconds: float) -> None:
        """Book a step whose sources were asked: what its plan expects to save (the accepted drafts' time at a
        step's cost without drafts, less what the drafted rows add) against ``seconds`` asking and planning took."""
        rows = sum(counts)
        saving = 0.0
        if rows:
            base = self.cost.cost(n, n)
            accepted = sum(sum(r[:c]) for r, c in zip(reaches, counts))
            saving = accepted * base / n - (self.cost.cost(n + rows, n) - base)
        a = self.asks.setdefault(StepCost.bucket(n), [0.0, 0.0, 0.0, 0])
        d = ASK_DECAY
        a[0], a[1], a[2], a[3] = d * a[0] + 1.0, d * a[1] + saving, d * a[2] + seconds, 0

    def _may_pay(self, decoding: Sequence[_Live]) -> bool:
        """Whether any draft could pay this step: :meth:`plan` over the best chains the measured rates allow
        (every request offered the likeliest reach of any source and tier at each depth, lifted by the largest
        request factor). Kept ``MAY_PAY_EVERY`` steps per batch size bucket."""
        b = StepCost.bucket(len(decoding))
        kept = self._may.get(b)
        if kept is not None and self.counts["steps"] - kept[0] < MAY_PAY_EVERY:
            return kept[1]
        keys = list(self.rates.trials) or [(RECYCLING, 0.0)]
        best = [max(col) for col in zip(*(self.reach(key, self.k) for key in keys))]
        best = _lifted(best, max(1.0, *(self._factor(st) for st in decoding)))
        out = any(self.plan([best] * len(decoding)))
        self._may[b] = (self.counts["steps"], out)
        return out

    def plan(self, reaches: Sequence[Sequence[float]]) -> list[int]:
        """How many tokens each decoding request drafts, from each chain's reach (P(right through depth d)): the
        tokens taken likeliest first across the batch, as many as maximise the expected committed tokens per
        second ``(requests + sum of the reaches taken) / cost(requests + taken)``. With a fixed ``min_reach``, or
        before the step cost is measured, each drafts while its reach is at least that floor (or ``START_REACH``)."""
        n = len(reaches)
        if self.options.min_reach is not None or not self.cost.ready():
            floor = self.options.min_reach if self.options.min_reach is not None else START_REACH
            return [next((d for d, r in enumerate(reach) if r < floor), len(reach)) for reach in reaches]
        total = sum(len(reach) for reach in reaches)
        if not total:  # nothing offered: nothing to price
            return [0] * n
        # likeliest first; ties: shallower, then the earlier request (plain Python: see goose/vllm/cost.py)
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

    def _factor(self, st: _Live) -> float:
        """A request's accepted tokens over what the sources' rates expected of its drafts, shrunk toward the
        recent requests' factor by ``REQUEST_WEIGHT`` expected tokens; at most 2 (its reach is scaled by it)."""
        return min(2.0, shrunk(st.accepted, st.expected, self._prior, REQUEST_WEIGHT))

    def recent_factor(self) -> float:
        """Where a request's own factor starts (:meth:`_factor`): the recent requests' accepted tokens over
        what was expected of their drafts, shrunk toward 1 by ``REQUEST_WEIGHT`` expected tokens, at most 1."""
        acc, exp = self.recent
        return min(1.0, shrunk(acc, exp, 1.0, REQUEST_WEIGHT))

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
        out = SimpleNamespace(prompt_ids=tuple(st.tokens[: st.prompt_len]), token_ids=st.tokens[st.prompt_len :])
        for s in st.sources:  # end() reads these two of a finished generation
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
            chain = p.first_chain()[:room]  # cut before ranking: ranked by what can be drafted
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
        rec = self.recycler
        return {**self.counts, "live": len(self.live), "step_cost": self.cost.fit(), "step_plane": self.cost.plane(),
                "cost_by_requests": self.cost.table(), "steps_with_prompt": self.cost.skipped,
                "steps_too_slow": self.cost.outliers, "propose_ms_per_step": round(1e3 * self.propose_s / steps, 3),
                "propose_ms_max": round(1e3 * self.propose_max_s, 3), "recent_factor": round(self.recent_factor(), 3),
                "rates": self.rates.snapshot(),
                "recycled": None if rec is None else {**rec.counts, "tokens": len(rec.rows), "attached": rec.attached}}


_INSTANCES: weakref.WeakSet[Proposer] = weakref.WeakSet()


def _lifted(reach: Sequence[float], f: float) -> Sequence[float]:
    """``reach`` times a request factor ``f``; a factor above 1 lifts no depth past 0.98 (or its own reach, if
    higher): a request that has drafted well is not certain."""
    return reach if f == 1.0 else [min(max(r, 0.98), r * f) for r in reach]


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


def build_sources(spec) -> list[DraftSource]:
    """Sources from ``"pld+suffix+tr"`` (the sources of a method spec, :mod:`goose.specs`), a list of
    names / (name, options) pairs, or DraftSource instances; a source with a ``tree`` option not set drafts its
    likeliest chain alone. ``tr`` is served by the :class:`~goose.vllm.recycle.Recycler`; other successor-only
    sources need logits vLLM does not give and are refused."""
    from goose.manager import build_component
    from goose.specs import preset

    if isinstance(spec, str):
        if not spec.strip():
            raise InvalidInputError(f"{ENV_SOURCES} is empty. Allowed: registered source names joined by '+'. "
                                    "Hint: pld+suffix+tr")
        spec = preset(spec.strip() + "/chain")["sources"]
    built = [build_component("source", s, DraftSource, None) for s in spec]
    if not built:
        raise InvalidInputError("goose.vllm.Proposer needs at least one draft source. Hint: pld+suffix+tr")
    for s in built:
        successors_only = type(s).propose is DraftSource.propose or type(s).successors is not DraftSource.successors
        if s.name != RECYCLING and successors_only:
            raise InvalidInputError(
                f"source {s.name!r} only gives successors (it drafts from the target's logits, which vLLM's "
                f"proposer interface does not pass; only {RECYCLING!r} is served from them here). Allowed: sources "
                "that propose from the tokens (pld, suffix, or your own) and tr. Hint: pld+suffix+tr")
    for s in built:  # vLLM verifies one chain: a source that can propose its likeliest chain alone does
        opts = s.options
        if "tree" in type(opts).model_fields and "tree" not in opts.model_fields_set and opts.tree:
            s.options = opts.model_copy(update={"tree": False})
    names = [s.name for s in built]
    if len(set(names)) != len(names):
        raise InvalidInputError(f"draft source(s) listed twice in {names}; list each once")
    return built


def resolve_options(options=None, **given) -> ProposerOptions:
    """The proposer's options: ``options`` (a :class:`ProposerOptions` or a dict), else ``$GOOSE_VLLM_OPTIONS`` (a
    JSON object) with ``$GOOSE_VLLM_SOURCES`` for the sources; the keyword arguments given (not None) on top.
    A bad value is an :class:`InvalidInputError` naming it, what is allowed, and a hint."""
    from pydantic import ValidationError

    if isinstance(options, ProposerOptions):
        base = options.model_dump(exclude_unset=True)
    elif options is None:
        text = os.environ.get(ENV_OPTIONS, "").strip()
        hint = f"Hint: {ENV_OPTIONS}='{{\"min_reach\": 0.2}}'"
        try:
            base = json.loads(text) if text else {}
        except ValueError as exc:
            raise InvalidInputError(f"{ENV_OPTIONS} is not a JSON object ({exc}): {text[:80]!r}. {hint}") from exc
        if not isinstance(base, dict):
            raise InvalidInputError(f"{ENV_OPTIONS} must hold a JSON object of options, got {text[:80]!r}. {hint}")
        if os.environ.get(ENV_SOURCES) is not None:
            base["sources"] = os.environ[ENV_SOURCES]
    elif isinstance(options, Mapping):
        base = dict(options)
    else:
        raise InvalidInputError(f"options must be a goose.vllm.ProposerOptions or a dict, got {type(options).__name__}")
    base.update({k: v for k, v in given.items() if v is not None})
    try:
        return ProposerOptions(**base)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or '(options)'}: {e['msg']} (got {e.get('input')!r})"
                             for e in exc.errors())
        raise InvalidInputError(f"Invalid options for goose.vllm.Proposer: {problems}. Allowed options: "
                                f"{', '.join(sorted(ProposerOptions.model_fields))} (docs/options.md)") from exc
