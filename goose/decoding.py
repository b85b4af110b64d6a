"""The decoding loop: prefill, then draft -> shape -> verify -> commit until done. The only place that
sequences the components; inside the loop, the only hook calls are the per-step observers."""

from __future__ import annotations

import copy
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields, replace

import torch

from goose.branches import BranchRates
from goose.errors import (
    DecoderBusyError, DraftSourceError, GooseError, InvalidInputError, InvalidTreeError, TreePolicyError, VerifierError,
    call_component)
from goose.interfaces import DraftContext, DraftSource, DraftState, Request, TokenView, TreePolicy, Verified, Verifier
from goose.sampling import Sampling, TokenRule
from goose.tree import ROOT, DraftTree


@dataclass(frozen=True)
class Stats:
    """What one ``generate`` call achieved."""

    prompt_tokens: int
    generated_tokens: int
    forward_passes: int  # target forwards, prefill included
    steps: int  # verification cycles after the prefill
    # {source name: {"proposed": int, "drafted": int, "accepted": int}}: tokens the source offered (its proposals'
    # tokens and its successors' ids, as the policy asked), placed in verified trees, and accepted; a node two
    # sources proposed counts for both
    per_source: dict
    routes: dict  # {route: cycles}
    accept_lengths: tuple[int, ...]  # accepted draft tokens per cycle
    # {"draft": s (sources + tree shaping), "sources": s, "verify": s, "observe": s, "total": s,
    #  "check": s (the loop's check of what the verifier reported, _check_report; not part of "verify")}
    time_s: dict
    stopped_by: str  # "eos", "stop_token", "max_new_tokens", "stopping_criteria" or "none"
    extra: dict = field(default_factory=dict)  # sources' and policy's own stats
    verify_time_by_route: dict = field(default_factory=dict)  # {route: seconds in verify()}

    def speedup_estimate(self) -> float | None:
        """tau x (mean one-token step time / mean step time), from this run's own single steps (None: no
        single steps to time). ``goose bench`` measures the wall-clock speedup against real greedy decoding."""
        n1 = self.routes.get("single", 0)
        steps = sum(self.routes.values())
        if not n1 or not steps:
            return None
        t1 = self.verify_time_by_route["single"] / n1
        tall = sum(self.verify_time_by_route.values()) / steps
        return self.tau * t1 / tall if tall else None

    @property
    def tau(self) -> float:
        """Generated tokens per target forward pass, prefill included."""
        return self.generated_tokens / self.forward_passes if self.forward_passes else 0.0

    @property
    def mean_accept_length(self) -> float:
        """Mean accepted draft tokens + 1 (the bonus) per verification cycle."""
        a = self.accept_lengths
        return (sum(a) / len(a) + 1.0) if a else 0.0

    per_origin: dict = field(default_factory=dict)  # {origin (lead, side, branch, ...): {"drafted", "accepted"}}

    def acceptance(self, source: str) -> float:
        """Accepted / drafted of a source (or, failing that, of an origin such as ``"lead"``)."""
        d = self.per_source.get(source) or self.per_origin.get(source, {})
        return d.get("accepted", 0) / d["drafted"] if d.get("drafted") else 0.0

    def to_dict(self) -> dict:
        """Every field but ``accept_lengths``, with ``tau``, ``mean_accept_length`` and ``speedup_estimate``."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "accept_lengths"}
        return {**out, "tau": self.tau, "mean_accept_length": self.mean_accept_length,
                "speedup_estimate": self.speedup_estimate()}


@dataclass(frozen=True)
class GenerationOutput:
    token_ids: list[int]  # the new tokens only
    text: str
    stats: Stats
    prompt_ids: tuple[int, ...] = ()
    scores: tuple = ()  # record_scores: processed float32 scores [1, vocab] per new token (output_scores)
    logits: tuple = ()  # record_scores: raw float32 logits [1, vocab] per new token, as transformers' output_logits


@dataclass(frozen=True)
class StepRecord:
    """One verification cycle, handed to ``goose_on_step`` observers."""

    step: int
    tree: DraftTree
    verified: Verified
    committed: tuple[int, ...]  # tokens committed this cycle: accepted + bonus, cut at a stop token / max_new_tokens
    draft_s: float
    verify_s: float


@dataclass
class _Worker:
    """One set of per-request components: what a single ``generate`` call mutates."""

    sources: tuple
    policy: TreePolicy
    verifier: Verifier
    # two or more successor sources: their measured per-rank acceptance (goose.branches), and the answers
    # this step's drafting asked for, with the prev the root was asked with, booked after the pass
    branches: BranchRates | None = None
    asked: tuple = ({}, None)


@dataclass
class _Tally:
    """What one generation counts as it goes: forwards and steps, drafted and accepted tokens per source
    and per origin, routes, and the seconds each part of a step took."""

    forwards: int = 0
    steps: int = 0
    proposed: Counter = field(default_factory=Counter)  # by source name: tokens offered to the policy
    drafted: Counter = field(default_factory=Counter)  # by source name
    accepted: Counter = field(default_factory=Counter)
    o_drafted: Counter = field(default_factory=Counter)  # by origin
    o_accepted: Counter = field(default_factory=Counter)
    routes: Counter = field(default_factory=Counter)
    route_time: Counter = field(default_factory=Counter)
    accept_lengths: list[int] = field(default_factory=list)
    draft_s: float = 0.0
    sources_s: float = 0.0
    verify_s: float = 0.0
    observe_s: float = 0.0
    check_s: float = 0.0

    def offered(self, ctx: DraftContext) -> None:
        """What each source offered the policy this step: its proposal's tokens, and the ids of every successor
        answer the policy asked of it."""
        for name, prop in ctx._proposals.items():
            if prop is not None:
                self.proposed[name] += len(prop.tokens)
        for answers in ctx.asked.values():
            for name, ids, _ in answers:
                self.proposed[name] += len(ids)

    def count(self, tree: DraftTree, v: Verified, verify_s: float) -> None:
        """A verified tree: every drafted node, every accepted one, its route and its time."""
        origins, credited = tree.origins, tree.credited
        for i in range(1, tree.num_nodes):
            self.o_drafted[origins[i]] += 1
            for s in credited(i):
                self.drafted[s] += 1
        for i in v.path[1:]:
            self.o_accepted[origins[i]] += 1
            for s in credited(i):
                self.accepted[s] += 1
        self.routes[tree.route] += 1
        self.route_time[tree.route] += verify_s
        self.verify_s += verify_s
        self.accept_lengths.append(len(v.path) - 1)


class Decoder:
    """A composed speculative decoder. Build it with :func:`goose.compose`.

    Safe to share between threads: each ``generate`` call runs on its own component set from a pool, the
    first one ``compose`` built, the others copies of a snapshot taken at construction (the model and tokenizer
    shared). Components that cannot be copied make a concurrent call fail with ``DecoderBusyError``
    (docs/concepts.md, "One decoder, several threads")."""

    def __init__(
        self,
        model,
        tokenizer,
        sources: Sequence[DraftSource],
        policy: TreePolicy,
        verifier: Verifier,
        budget: int,
        stop_token_ids: Iterable[int] = (),
        eos_token_ids: Iterable[int] = (),
        hook=None,
        description: str = "",
    ):
        self.model, self.tokenizer = model, tokenizer
        self.sources, self.policy, self.verifier = tuple(sources), policy, verifier
        self.budget = budget
        self.max_nodes = call_component("policy", policy, "max_nodes", budget)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids) | self.eos_token_ids
        self.hook = hook
        self.description = description
        self.vocab_size = verifier.vocab_size
        self.max_positions = verifier.max_positions
        self._lock = threading.Lock()
        n_succ = sum(1 for s in self.sources if s.provides_successors)
        self._idle: list[_Worker] = [_Worker(self.sources, policy, verifier, BranchRates() if n_succ > 1 else None)]
        self._workers = 1
        self._template, self._template_error = self._snapshot()

    def _shared_memo(self) -> dict:
        """Objects a copy must share, not duplicate: the model (every module and tensor), the tokenizer."""
        model = self.model
        memo = {id(x): x for x in (self.tokenizer, self.hook, model)}
        if isinstance(model, torch.nn.Module):
            memo.update((id(t), t) for t in (*model.modules(), *model.parameters(), *model.buffers()))
        return memo

    def _snapshot(self):
        try:
            return copy.deepcopy(self._idle[0], self._shared_memo()), None
        except Exception as exc:  # noqa: BLE001 - reported when a concurrent call needs a copy
            return None, f"{type(exc).__name__}: {exc}"

    def _acquire(self) -> _Worker:
        with self._lock:
            if self._idle:
                return self._idle.pop()
            if self._template is None:
                raise DecoderBusyError(
                    "this decoder is generating in another thread, and its components cannot be copied "
                    f"for a second concurrent call ({self._template_error}). Hint: compose one decoder "
                    "per thread; they can share the model.")
            template = self._template
            self._workers += 1
        return copy.deepcopy(template, self._shared_memo())

    def _release(self, worker: _Worker) -> None:
        with self._lock:
            self._idle.append(worker)

    @property
    def component_sets_in_use(self) -> int:
        """How many of this decoder's component sets ``generate`` calls hold now: 0 once every call has
        returned (each set is back in the pool, for a later call to reuse)."""
        with self._lock:
            return self._workers - len(self._idle)

    def __repr__(self) -> str:
        return f"<goose.Decoder {self.description}>"

    def prompt_tensor(self, prompt) -> torch.Tensor:
        """``prompt`` (a str, a 1-D or [1, n] tensor, a list of ids) as checked 1-D token ids, or a clear error."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidInputError(
                    "prompt is a str but this decoder has no tokenizer; pass a tokenizer to compose() "
                    "or give the prompt as a 1-D LongTensor of token ids")
            ids = self.tokenizer(prompt, return_tensors="pt")["input_ids"]
        elif isinstance(prompt, torch.Tensor):
            ids = prompt
        elif isinstance(prompt, (list, tuple)):
            try:
                ids = torch.tensor(prompt, dtype=torch.long)
            except (TypeError, ValueError) as exc:
                raise InvalidInputError(f"prompt list must hold token ids (ints), got {prompt[:5]!r}...") from exc
        else:
            raise InvalidInputError(
                f"prompt must be a str or a 1-D LongTensor of token ids, got {type(prompt).__name__}")
        if ids.dim() == 2:
            if ids.shape[0] != 1:
                raise InvalidInputError(
                    f"batch size {ids.shape[0]} is not supported: Goose decodes one sequence at a time "
                    f"(got input of shape {tuple(ids.shape)}). Hint: call generate() once per prompt.")
            ids = ids[0]
        if ids.dim() != 1:
            raise InvalidInputError(f"prompt ids must be 1-D (or [1, n]), got shape {tuple(ids.shape)}")
        if ids.dtype not in (torch.long, torch.int, torch.int32, torch.int16, torch.uint8):
            raise InvalidInputError(f"prompt ids must be integers, got dtype {ids.dtype}")
        ids = ids.to(torch.long).cpu()
        if ids.numel() == 0:
            raise InvalidInputError(
                "empty prompt: at least one token is needed to start decoding. Hint: a chat model "
                "can start from its chat template (goose generate --chat).")
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.vocab_size:
            bad = lo if lo < 0 else hi
            raise InvalidInputError(
                f"prompt token id {bad} is outside the vocabulary [0, {self.vocab_size}). "
                "Hint: was the prompt encoded with this model's tokenizer?")
        if self.max_positions is not None and ids.numel() >= self.max_positions:
            raise InvalidInputError(
                f"prompt of {ids.numel()} tokens does not fit the model's context of "
                f"{self.max_positions} positions (at least one must remain to generate). "
                "Hint: shorten the prompt.")
        return ids

    def generate(
        self,
        prompt,
        max_new_tokens: int = 128,
        stop_token_ids: Iterable[int] | None = None,
        *,
        do_sample: bool | None = None,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        min_p: float | None = None,
        repetition_penalty: float | None = None,
        min_new_tokens: int | None = None,
        seed: int | None = None,
        generator: torch.Generator | None = None,
        logits_processor=None,
        stopping_criteria=None,
        streamer=None,
        record_scores: bool = False,
        stream_prompt: bool = True,
    ):
        """Decode (speculatively), return a :class:`GenerationOutput`.

        Stops after ``max_new_tokens`` or at a committed stop token (the model's eos ids, the decoder's and
        ``stop_token_ids``), which is included, as in transformers' ``generate``. The sampling arguments,
        ``logits_processor``, ``stopping_criteria`` and ``streamer`` are transformers' ``generate``'s: an unset one
        takes the value ``model.generate`` would give it, and under the same seed (``seed``, ``generator`` or torch's
        global generator) the output equals ``model.generate``'s token for token (docs/concepts.md). Without them
        the output is greedy decoding's. ``record_scores`` keeps each new token's scores and raw logits.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise InvalidInputError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        from goose import generation

        given = {k: v for k, v in dict(
            do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            repetition_penalty=repetition_penalty, min_new_tokens=min_new_tokens,
        ).items() if v is not None}
        if "do_sample" in given:
            given["do_sample"] = bool(given["do_sample"])
        Sampling(**{"do_sample": False, "min_new_tokens": 0, **given})  # checked with Goose's messages
        if seed is not None and generator is not None:
            raise InvalidInputError(
                "give seed or generator, not both. Hint: generator=torch.Generator().manual_seed(seed)")
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
            raise InvalidInputError(f"seed must be an int, got {seed!r}")
        if generator is not None and not isinstance(generator, torch.Generator):
            raise InvalidInputError(f"generator must be a torch.Generator, got {type(generator).__name__}")
        ids = self.prompt_tensor(prompt)
        prompt_len = ids.numel()
        if self.max_positions is not None and prompt_len + max_new_tokens > self.max_positions:
            raise InvalidInputError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                f"context of {self.max_positions} positions. Hint: max_new_tokens <= "
                f"{self.max_positions - prompt_len}.")
        if generation.uses_transformers(self.model):
            rule = generation.resolve(self.model, ids, max(max_new_tokens, 1), given, logits_processor,
                                      stopping_criteria)
        else:
            rule = generation.explicit(given, prompt_len, self.eos_token_ids, logits_processor, stopping_criteria)
        if seed is not None:
            generator = torch.Generator().manual_seed(seed)
        stops = set(stop_token_ids) if stop_token_ids is not None else set()
        return self.generate_resolved(ids, max_new_tokens, stops | rule.stop_ids, rule, generator, streamer,
                                      record_scores, stream_prompt)

    def generate_resolved(self, ids: torch.Tensor, max_new_tokens: int, stop_token_ids, resolved, generator=None,
                          streamer=None, record_scores: bool = False, stream_prompt: bool = True) -> GenerationOutput:
        """Decode ``ids`` (1-D, checked by :meth:`prompt_tensor`) under a rule already resolved
        (goose/generation.py's ``Resolved``): what :meth:`generate` does after resolving its arguments, and
        what ``goose.hf_generate`` calls with the processors and criteria transformers' ``generate`` prepared."""
        needs_rule = not resolved.plain_greedy or record_scores
        if needs_rule and not self.verifier.supports_rules:
            raise InvalidInputError(
                f"verifier {self.verifier.name!r} verifies greedily only, so it cannot sample or apply logits "
                "processors / stopping criteria. Hint: compose with verifier='transformers' (the built-in verifier, "
                "which does both).")
        prompt_len = ids.numel()
        stops = set(self.stop_token_ids)
        stops.update(int(t) for t in stop_token_ids)
        prompt_ids = tuple(ids.tolist())
        t_start = time.perf_counter()
        if max_new_tokens == 0:
            stats = Stats(prompt_len, 0, 0, 0, {}, {}, (), {"total": 0.0}, "max_new_tokens")
            return GenerationOutput([], "", stats, prompt_ids)
        call_component("verifier", self.verifier, "check_request", prompt_len, max_new_tokens, self.max_nodes)
        rule = None
        if needs_rule:
            rule = TokenRule(
                prompt_ids, max_new_tokens, max_new_tokens + self.max_nodes + 1, resolved.processors,
                resolved.do_sample, generator, frozenset(stops), resolved.criteria, record=record_scores,
                temperature=resolved.temperature)
        if streamer is not None and stream_prompt:
            streamer.put(ids.view(1, -1).cpu())
        worker = self._acquire()
        try:
            out = self._run(worker, ids, prompt_ids, max_new_tokens, stops, t_start, rule, streamer)
        finally:
            self._release(worker)
        if streamer is not None:
            streamer.end()
        out.stats.extra["generation"] = {**resolved.values, "from": resolved.source,
                                         "processors": [type(p).__name__ for p in resolved.processors]}
        if rule is not None and rule.record:
            n = len(out.token_ids)
            out = replace(out, scores=tuple(rule.scores[:n]), logits=tuple(rule.raw[:n]))
        return out

    def _run(self, worker: _Worker, ids, prompt_ids, max_new_tokens: int, stops, t_start: float, rule=None,
             streamer=None):
        """One generation on one component set: begin, prefill and steps, then the output and every end()."""
        request = Request(prompt_ids, self.vocab_size, max_new_tokens, self.budget)
        for s in worker.sources:
            call_component("source", s, "begin", request)
        call_component("policy", worker.policy, "begin", request)
        if worker.branches is not None:
            worker.branches.begin()
        if self.hook is not None:
            self.hook.goose_on_generation_start(decoder=self, request=request)
        keep = self._prefill_positions(worker, len(prompt_ids))
        tally = _Tally()
        verifier = worker.verifier
        try:
            new, stopped_by = self._steps(worker, ids, prompt_ids, keep, max_new_tokens, stops, rule, streamer, tally)
        finally:
            call_component("verifier", verifier, "end")
            if rule is not None:
                rule.finish()
        out = self._output(worker, prompt_ids, new, stopped_by, keep, rule, tally, t_start)
        self._end(worker, out)
        return out

    @staticmethod
    def _prefill_positions(worker: _Worker, prompt_len: int) -> int:
        """How many of the prompt's last positions the prefill computes logits for: what the sources ask
        (``prefill_positions``), as far as the policy allows, at least 1."""
        keep = 1
        for s in worker.sources:
            keep = max(keep, int(call_component("source", s, "prefill_positions", prompt_len) or 0))
        wanted = call_component("policy", worker.policy, "prefill_positions", prompt_len, keep)
        return max(1, min(int(wanted), keep, prompt_len))

    def _steps(self, worker: _Worker, ids, prompt_ids, keep: int, max_new_tokens: int, stops, rule, streamer,
               tally: _Tally) -> tuple[list[int], str]:
        """The prefill, then commit -> draft -> verify until a stop: the new tokens and why decoding stopped."""
        verifier = worker.verifier
        rule_kw = {} if rule is None else {"rule": rule}  # a greedy-only verifier is never passed one
        v = call_component("verifier", verifier, "prefill", ids, keep, **rule_kw)
        _check_pass(verifier, v, "prefill")
        t0 = time.perf_counter()
        _check_first(verifier, v, rule is None, self.vocab_size)
        tally.check_s += time.perf_counter() - t0
        tally.forwards = 1
        # a verifier may defer the prefill's other logit rows (Verified.rest): the sources observe the
        # prefill just before the first draft, with every row, or at the end with the last row only when
        # the generation ends at its first token
        deferred = v if v.rest is not None else None
        if deferred is None:
            self._observe(worker, v, tally)
        seq = list(prompt_ids)
        view = TokenView(seq)  # what sources read: the same list, read-only
        new: list[int] = []
        committed = _cut((v.bonus,), stops, max_new_tokens)
        while True:
            stopped_by = self._commit(committed, new, seq, stops, max_new_tokens, rule, streamer)
            if stopped_by is not None:
                break
            if deferred is not None:
                # the deferred rows' LM head is prefill work, timed by the verifier as prefill_forward:
                # only the sources' harvest counts as observe (or the profile counts it twice)
                try:
                    full = deferred.rest()
                except GooseError:
                    raise
                except Exception as exc:  # noqa: BLE001 - the deferred rows are the verifier's prefill
                    raise VerifierError.raised(verifier.name, "prefill", exc) from exc
                if full is None:
                    full = replace(deferred, rest=None)
                else:
                    _check_pass(verifier, full, "prefill")
                    full = replace(full, bonus=deferred.bonus, walk=deferred.walk)
                self._observe(worker, full, tally)
                deferred = None
            tree, draft_s = self._draft(worker, seq, view, len(prompt_ids), max_new_tokens - len(new), rule, tally)
            committed = self._verify(worker, tree, stops, max_new_tokens - len(new), draft_s, rule, tally)
        if deferred is not None:  # ended at its first token: the last row is all the sources see
            self._observe(worker, replace(deferred, rest=None), tally)
        return new, stopped_by

    def _commit(self, committed: tuple[int, ...], new: list[int], seq: list[int], stops, max_new_tokens: int,
                rule, streamer) -> str | None:
        """Append a step's tokens (already cut at the first stop token and at max_new_tokens) and stream them;
        why decoding stops after them, or None."""
        new.extend(committed)
        seq.extend(committed)
        if rule is not None:
            rule.commit(committed)
        if streamer is not None and committed:
            streamer.put(torch.tensor([committed], dtype=torch.long))
        if committed and committed[-1] in stops:
            return "eos" if committed[-1] in self.eos_token_ids else "stop_token"
        if rule is not None and rule.stopped == "criteria":
            return "stopping_criteria"
        if len(new) >= max_new_tokens:
            return "max_new_tokens"
        return None

    def _draft(self, worker: _Worker, seq: list[int], view: TokenView, prompt_len: int, remaining: int, rule,
               tally: _Tally) -> tuple[DraftTree, float]:
        """The step's tree (the anchor alone where nothing is drafted, or only one token remains) and the
        seconds drafting and shaping took."""
        max_depth = remaining - 1
        if self.max_positions is not None:
            max_depth = min(max_depth, self.max_positions - len(seq))
        t0 = time.perf_counter()
        anchor = seq[-1]
        tree = None
        worker.asked = ({}, None)
        if max_depth > 0:
            state = DraftState(
                view, prompt_len, anchor, seq[-2] if len(seq) >= 2 else None, self.budget, max_depth, tally.steps)
            ctx = DraftContext(state, worker.sources, None if rule is None else rule.noise_view(), self.vocab_size,
                               worker.branches)
            tree = self._shape(worker.policy, ctx, anchor, max_depth)
            worker.asked = (ctx.asked, state.prev_anchor)
            tally.sources_s += ctx.source_s
            tally.offered(ctx)
        if tree is None:
            tree = DraftTree.single(anchor)
        draft_s = time.perf_counter() - t0
        tally.draft_s += draft_s
        return tree, draft_s

    def _verify(self, worker: _Worker, tree: DraftTree, stops, room: int, draft_s: float, rule,
                tally: _Tally) -> tuple[int, ...]:
        """One forward over the tree, checked (:func:`_check_report`) and observed; the tokens it commits (cut at the
        first stop token and at ``room``)."""
        t0 = time.perf_counter()
        rule_kw = {} if rule is None else {"rule": rule}
        v = call_component("verifier", worker.verifier, "verify", tree, **rule_kw)
        _check_pass(worker.verifier, v, "verify")
        t1 = time.perf_counter()
        verify_s = t1 - t0
        _check_report(worker.verifier, tree, v, rule is None, self.vocab_size)
        tally.check_s += time.perf_counter() - t1
        tally.forwards += 1
        self._observe(worker, v, tally)
        tally.count(tree, v, verify_s)
        step_tokens = (*v.accepted, v.bonus) if v.bonus is not None else tuple(v.accepted)
        committed = _cut(step_tokens, stops, room)
        if self.hook is not None:
            self.hook.goose_on_step(decoder=self, step=StepRecord(tally.steps, tree, v, committed, draft_s, verify_s))
        tally.steps += 1
        return committed

    def _output(self, worker: _Worker, prompt_ids, new: list[int], stopped_by: str, keep: int, rule, tally: _Tally,
                t_start: float) -> GenerationOutput:
        """The generation's output and its statistics (the components' own stats under ``extra``)."""
        sources, policy, verifier = worker.sources, worker.policy, worker.verifier
        extra = {}
        for key, role, comp in (*((s.name, "source", s) for s in sources), ("policy", "policy", policy)):
            st = call_component(role, comp, "stats")
            if st:
                extra[key] = st
        if worker.branches is not None:  # successor sources' measured rate at ranks 0, 1, 2
            extra["branch_rates"] = worker.branches.snapshot()
        st = call_component("verifier", verifier, "stats")
        # the rows the prefill's LM head computed: keep, or 1 where deferred rows were never needed
        extra["prefill_logit_rows"] = int(st.get("prefill_logit_rows", keep)) if st else keep
        if st:
            extra["verifier"] = st
        if rule is not None:
            extra["sampling"] = {"walk": rule.kind, "draws": rule.draws}
        t = tally
        stats = Stats(
            len(prompt_ids), len(new), t.forwards, t.steps,
            # every composed source, with zeros where it drafted nothing ("was my source consulted?")
            {o: {"proposed": t.proposed[o], "drafted": t.drafted[o], "accepted": t.accepted[o]}
             for o in sorted({*t.drafted, *(s.name for s in sources)})},
            dict(t.routes), tuple(t.accept_lengths),
            {"draft": t.draft_s, "sources": t.sources_s, "verify": t.verify_s, "observe": t.observe_s,
             "check": t.check_s, "total": time.perf_counter() - t_start},
            stopped_by, extra, dict(t.route_time),
            {o: {"drafted": t.o_drafted[o], "accepted": t.o_accepted[o]} for o in sorted(t.o_drafted)})
        text = self.tokenizer.decode(new, skip_special_tokens=True) if self.tokenizer is not None else ""
        return GenerationOutput(new, text, stats, prompt_ids)

    def _end(self, worker: _Worker, out: GenerationOutput) -> None:
        """The lifecycle's last calls: each source's and the policy's ``end`` (what was committed, and how),
        then the observers' ``goose_on_generation_end``. Every one runs even when one raises; the first error
        is raised after them, naming its component."""
        first: BaseException | None = None
        for s in worker.sources:
            try:
                s.end(out)
            except Exception as exc:  # noqa: BLE001 - re-raised with the plugin's name
                first = first or DraftSourceError.raised(s.name, "end", exc)
        try:
            call_component("policy", worker.policy, "end", out)
        except GooseError as exc:
            first = first or exc
        if self.hook is not None:
            try:
                self.hook.goose_on_generation_end(decoder=self, output=out)
            except Exception as exc:  # noqa: BLE001 - an observer's error, raised after the components' ends
                first = first or exc
        if first is not None:
            raise first

    def _shape(self, policy: TreePolicy, ctx: DraftContext, anchor: int, max_depth: int) -> DraftTree | None:
        """The policy's tree for this step, checked (None: an ordinary step); every error names the policy."""
        try:
            tree = call_component("policy", policy, "shape", ctx)
        except InvalidTreeError as exc:
            raise InvalidTreeError(f"Tree policy {policy.name!r} built an invalid tree: {exc}") from exc
        if tree is None:
            return None
        if not isinstance(tree, DraftTree):
            raise TreePolicyError(
                policy.name,
                f"Tree policy {policy.name!r} returned {type(tree).__name__}; shape() must return "
                "a goose.DraftTree or None. Hint: DraftTree.build(tokens, parents, origins)", "shape")
        if tree.num_nodes < 2:  # an ordinary step; the policy's meta travels with it, unread, to its observe
            return DraftTree((anchor,), (-1,), (ROOT,), None, "single", dict(tree.meta))
        if tree.tokens[0] != anchor:
            raise TreePolicyError(
                policy.name,
                f"Tree policy {policy.name!r} returned a tree rooted at token {tree.tokens[0]}, but "
                f"the anchor is {anchor}; node 0 must be the anchor (ctx.state.anchor)", "shape")
        if tree.num_nodes > self.max_nodes:
            raise TreePolicyError(
                policy.name,
                f"Tree policy {policy.name!r} returned {tree.num_nodes} nodes, over its limit of "
                f"{self.max_nodes} at budget {self.budget} (root included; see TreePolicy.max_nodes)", "shape")
        vocab = self.vocab_size
        for i, t in enumerate(tree.tokens):
            if t >= vocab:  # sources' ids were checked as they left them: this one is the policy's
                by = tree.sources[i] if tree.sources is not None else ()
                raise TreePolicyError(
                    policy.name,
                    f"Tree policy {policy.name!r} returned token id {t} at tree node {i} (origin {tree.origins[i]!r}"
                    + (f", credited to {', '.join(by)}" if by else "")
                    + f"), outside the vocabulary [0, {vocab}). Hint: place only ids the sources proposed.", "shape")
        if max(tree.depths) > max_depth:
            tree = prune(tree, max_depth)
        return tree

    def _observe(self, worker: _Worker, v: Verified, tally: _Tally) -> None:
        """The sources and the policy learn from a pass (timed as ``observe``)."""
        t0 = time.perf_counter()
        for s in worker.sources:
            try:
                s.observe(v)
            except Exception as exc:  # noqa: BLE001
                raise DraftSourceError.raised(s.name, "observe", exc) from exc
        call_component("policy", worker.policy, "observe", v)
        if worker.branches is not None and v.tree is not None:
            tree = v.tree
            worker.branches.book(worker.asked[0], worker.asked[1], tree.tokens, tree.parents, v.path, v.bonus)
        tally.observe_s += time.perf_counter() - t0


def _check_pass(verifier: Verifier, v, hook: str) -> None:
    """What the verifier's ``hook`` (prefill or verify) returned, as the loop reads it: a :class:`Verified` with
    one logit row per token, or a :class:`VerifierError` naming the verifier and the hook."""
    if not isinstance(v, Verified):
        raise VerifierError(
            verifier.name,
            f"Verifier {verifier.name!r} returned {type(v).__name__} from {hook}(); it must return a goose.Verified. "
            "Hint: build the record as TransformersVerifier does (verifiers/greedy.py)", hook)
    rows, n = int(v.logits.shape[0]), int(v.tokens.shape[0])
    if rows != n:  # the sources index the logits by the tokens' positions
        raise VerifierError(
            verifier.name,
            f"Verifier {verifier.name!r} returned a {v.kind} pass with {rows} logit rows for {n} "
            f"tokens; a Verified holds one row per token (Verified.logits[i] follows Verified.tokens[i]). "
            "Hint: slice the tokens and predecessors to the rows the forward computed.", hook)


_REPORT_HINT = (
    "Hint: a verifier reports the root-to-node walk of the tree it was given (Verified.path, node 0 first), the "
    "tokens of the walk's nodes after the root (Verified.accepted) and the token after the last one "
    "(Verified.bonus), as TransformersVerifier.verify does; goose.testing.VerifierLosslessnessKit checks a "
    "verifier's passes")


def _check_report(verifier: Verifier, tree: DraftTree, v: Verified, greedy: bool, vocab: int) -> None:
    """What the verifier's ``verify(tree)`` reported, checked before anything observes or commits it (a
    :class:`VerifierError` names the node and the value): one logit row per node, ``path`` a root-to-node walk,
    ``accepted`` its tokens, ``bonus`` None or an id; in a ``greedy`` request, each the argmax of the row before."""
    name = verifier.name

    def bad(what: str):
        raise VerifierError(name, f"Verifier {name!r} {what}. {_REPORT_HINT}", "verify")

    n = tree.num_nodes
    if v.kind != "tree":
        bad(f"returned a {v.kind!r} record from verify(); a tree pass is kind='tree'")
    if v.tree is not tree and v.tree != tree:
        got = (f"a {v.tree.num_nodes}-node tree {v.tree.tokens}" if isinstance(v.tree, DraftTree)
               else "no tree" if v.tree is None else f"a {type(v.tree).__name__}")
        bad(f"reported a pass over {got}, not the {n}-node tree {tree.tokens} it was given; Verified.tree is the tree "
            "verify() received")
    logits = v.logits
    if logits.dim() != 2 or int(logits.shape[0]) != n:
        bad(f"returned logits of shape {tuple(logits.shape)} for a {n}-node tree; a tree pass holds one row per "
            "node, [num_nodes, vocab]")
    path, parents = v.path, tree.parents
    if not path or type(path[0]) is not int or path[0] != 0:
        bad(f"reported path {tuple(path)}, which does not start at node 0 (the root)")
    prev = 0
    for k in range(1, len(path)):
        node = path[k]
        if type(node) is not int or not 0 <= node < n:
            bad(f"reported path {tuple(path)}: path[{k}] = {node!r} is not a node of the {n}-node tree "
                f"(an int in 0..{n - 1})")
        if parents[node] != prev:
            bad(f"reported path {tuple(path)}: path[{k}] = node {node} follows node {prev}, but node {node} is not "
                f"a child of node {prev} (its parent is node {parents[node]}); a path walks from a node to one of "
                "its children")
        prev = node
    accepted, tokens = v.accepted, tree.tokens
    if len(accepted) != len(path) - 1:
        bad(f"reported {len(accepted)} accepted tokens {tuple(accepted)} for the path {tuple(path)} of "
            f"{len(path) - 1} nodes after the root; accepted holds one token per path node after the root "
            f"(the walk's tokens: {tuple(tokens[i] for i in path[1:])})")
    for k, t in enumerate(accepted):
        if t != tokens[path[k + 1]]:
            bad(f"reported accepted token {t!r} for node {path[k + 1]} of the path {tuple(path)}, whose token is "
                f"{tokens[path[k + 1]]}; the accepted tokens are the path's tokens")
    bonus = v.bonus
    if bonus is not None and (type(bonus) is not int or not 0 <= bonus < vocab):
        bad(f"reported bonus {bonus!r} after node {path[-1]}, not a token id (an int in [0, {vocab}))")
    if greedy:
        last = len(path) - 1
        rows = logits[: last + 1] if path[-1] == last else logits.index_select(
            0, torch.tensor(path, dtype=torch.long, device=logits.device))
        best = rows.max(-1).indices.tolist()  # as TransformersVerifier's top1: the first index among equal maxima
        for k in range(last):
            if accepted[k] != best[k]:
                bad(f"accepted node {path[k + 1]} (token {accepted[k]}) in a greedy request, but the argmax of its "
                    f"parent node {path[k]}'s logit row is {best[k]}; a greedy walk accepts a child only when its "
                    "token is its parent's argmax")
        if bonus != best[last]:
            bad(f"reported bonus {bonus!r} after node {path[-1]} in a greedy request, but the argmax of that "
                f"node's logit row is {best[last]}; the bonus is the last node's argmax")


def _check_first(verifier: Verifier, v: Verified, greedy: bool, vocab: int) -> None:
    """What the verifier's ``prefill`` reported as the first new token (``bonus``): a token id in ``[0, vocab)``
    and, in a ``greedy`` request, the argmax of the last prompt position's row; or a :class:`VerifierError`."""
    name, bonus = verifier.name, v.bonus
    if type(bonus) is not int or not 0 <= bonus < vocab:
        raise VerifierError(
            name, f"Verifier {name!r} reported the prefill's bonus {bonus!r}, not a token id (an int in [0, {vocab})); "
            "it is the first new token. Hint: the argmax (or the rule's choice) of the last prompt position's row",
            "prefill")
    if greedy and v.logits.dim() == 2:
        best = int(v.logits[-1].max(-1).indices)
        if bonus != best:
            raise VerifierError(
                name, f"Verifier {name!r} reported the prefill's bonus {bonus} in a greedy request, but the argmax of "
                f"the last prompt position's logit row is {best}. Hint: the first new token is that argmax "
                "(TransformersVerifier.prefill)", "prefill")


def _cut(committed: tuple[int, ...], stops, room: int) -> tuple[int, ...]:
    """Cut after the first stop token and at ``room`` tokens."""
    for i, t in enumerate(committed):
        if t in stops:
            committed = committed[: i + 1]
            break
    return committed[:room]


def prune(tree: DraftTree, max_depth: int) -> DraftTree:
    """Drop nodes deeper than ``max_depth`` (their subtrees go with them)."""
    return tree.subtree([i for i, d in enumerate(tree.depths) if d <= max_depth])
