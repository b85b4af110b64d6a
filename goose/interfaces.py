"""The three extension points (:class:`DraftSource`, :class:`TreePolicy`, :class:`Verifier`), their
:class:`Options`, the frozen records that cross them, and the :class:`DraftContext` a policy reads sources through."""

from __future__ import annotations

import math
import numbers
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from types import UnionType
from typing import ClassVar, Union, get_args, get_origin

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, field_validator

from goose.branches import BranchRates, Successors
from goose.errors import DraftSourceError
from goose.tree import ROOT, DraftTree


class Options(BaseModel):
    """Base class of every component's options: unknown fields are an error, and scalars are never converted:
    an ``int`` option refuses ``True``, ``3.0`` and ``"3"``; a ``float`` option takes an int but refuses a bool or
    a string; a ``bool`` option takes ``True`` or ``False`` only. The same holds for the items of a tuple or list
    option and the values (not the keys) of a dict option."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_scalars(cls, v, info):
        field_info = cls.model_fields.get(info.field_name)
        if field_info is None or v is None:
            return v
        problem = _scalar_problem(field_info.annotation, v)
        if problem is not None:
            where, wanted, bad = problem
            allowed = _SCALARS[wanted][1] + (_bounds(field_info.metadata) if not where else "")
            hint = _scalar_hint(info.field_name, wanted, bad, bool(where))
            raise ValueError(f"{'item ' + where + ': ' if where else ''}{_SCALARS[wanted][0]} is required, got {bad!r} "
                             f"({type(bad).__name__}); allowed: {allowed}. Hint: {hint}")
        return v


# the scalar kinds an option is held to: (what each requires, what it allows)
_SCALARS = {bool: ("True or False", "a bool"), int: ("an integer", "an int"), float: ("a number", "a float or an int")}


def _fits(kind: type, v) -> bool:
    """Whether option type ``kind`` (bool, int or float) may take ``v`` as it is (see :class:`Options`)."""
    if kind is bool:
        return isinstance(v, bool)
    if isinstance(v, (bool, str, bytes)):
        return False
    return kind is float or not (isinstance(v, numbers.Real) and not isinstance(v, numbers.Integral))


def _scalar_problem(annotation, v, where: str = ""):
    """``(where, kind, value)`` for the first value in ``v`` an option of type ``annotation`` must refuse (``where``:
    the item's place in the option, "" for the option itself), or None. Other types are left to pydantic."""
    if v is None:
        return None
    members = (tuple(a for a in get_args(annotation) if a is not type(None))  # int | None -> (int,)
               if get_origin(annotation) in (Union, UnionType) else (annotation,))
    scalars = [m for m in members if m in (bool, int, float)]
    if scalars and len(scalars) == len(members):
        if any(_fits(m, v) for m in scalars):
            return None
        wanted = bool if scalars == [bool] else float if float in scalars else int
        return where, wanted, v
    if len(members) != 1 or scalars:
        return None
    origin, args = get_origin(members[0]), get_args(members[0])
    items = ()  # (annotation, value, where) of each item
    if origin in (tuple, list, set, frozenset) and isinstance(v, (list, tuple)) and args:
        if origin is tuple and not (len(args) == 2 and args[1] is Ellipsis):
            pairs = zip(args, v) if len(args) == len(v) else ()
        else:
            pairs = ((args[0], x) for x in v)
        items = ((ann, x, f"{where}[{i}]") for i, (ann, x) in enumerate(pairs))
    elif origin is dict and isinstance(v, Mapping) and len(args) == 2:
        items = ((args[1], x, f"{where}[{k!r}]") for k, x in v.items())
    return next((found for ann, x, w in items if (found := _scalar_problem(ann, x, w)) is not None), None)


def _bounds(metadata) -> str:
    """The limits pydantic's ``Field(ge=..., le=...)`` set on an option, in words (" >= 1 and <= 4096"), or ""."""
    words = []
    for m in metadata:
        for attr, op in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            bound = getattr(m, attr, None)
            if bound is not None:
                words.append(f"{op} {bound!r}")
    return (" " + " and ".join(words)) if words else ""


def _scalar_hint(field: str, wanted: type, bad, nested: bool) -> str:
    """How to write option ``field`` (``nested``: an item inside it) so that it takes the value meant by ``bad``."""
    what = f"each item of {field}" if nested else field
    if wanted is bool:
        return f"{what}: True or False (true / false in a method spec)"
    number = None
    if isinstance(bad, str):
        try:
            number = (int if wanted is int else float)(bad.strip())
        except ValueError:
            pass
    elif isinstance(bad, float) and bad.is_integer():
        number = int(bad)
    if number is not None:
        return f"{what}: {number!r}, the number itself, not {bad!r}"
    return f"{what}: {_SCALARS[wanted][0]} written as one (`goose plugins --options` lists each component's options)"


@dataclass(frozen=True)
class Request:
    """What a component learns when a generation starts (``begin``)."""

    prompt_ids: tuple[int, ...]  # [prompt_len]
    vocab_size: int
    max_new_tokens: int
    budget: int  # node budget of one tree, root included


class TokenView(Sequence):
    """The loop's committed tokens, shared by every source, without a copy: reading works as on a list; each
    change raises ``TypeError`` (a ``DraftSourceError`` naming the source). ``list(state.tokens)`` is a copy."""

    __slots__ = ("_tokens",)

    def __init__(self, tokens: Sequence[int]):
        object.__setattr__(self, "_tokens", tokens)

    def __getitem__(self, i):
        return self._tokens[i]

    def __len__(self) -> int:
        return len(self._tokens)

    def __iter__(self):
        return iter(self._tokens)

    def __contains__(self, x) -> bool:
        return x in self._tokens

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenView):
            other = other._tokens
        return list(self._tokens) == list(other) if isinstance(other, (list, tuple)) else NotImplemented

    __hash__ = None

    def __repr__(self) -> str:
        return f"TokenView({list(self._tokens)!r})"

    def _refuse(self, *args, **kwargs):
        raise TypeError("state.tokens is read-only: it is the decoder's committed sequence, shared by every source. "
                        "Hint: copy it first (list(state.tokens)) to build on it")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = __setattr__ = _refuse
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse


@dataclass(frozen=True)
class DraftState:
    """The decoding state a source drafts from. ``tokens`` is read-only (a :class:`TokenView` of
    the loop's list in a decoder; any sequence when built by hand)."""

    tokens: Sequence[int]  # [prompt_len + committed]; tokens[-1] is the anchor
    prompt_len: int
    anchor: int
    prev_anchor: int | None
    budget: int  # node budget for this step, root included
    max_depth: int  # deepest node depth worth drafting this step (remaining tokens)
    step: int  # index of the verification cycle, 0-based


@dataclass(frozen=True)
class Proposal:
    """What one draft source proposes: nodes under the root (root excluded). ``parents[i]`` is -1 (the root) or
    an earlier node ``0 <= parents[i] < i``; a chain has ``parents == (-1, 0, 1, ...)``."""

    source: str
    tokens: tuple[int, ...]  # [num_drafted]
    parents: tuple[int, ...]  # [num_drafted]
    scores: tuple[float, ...] | None = None  # [num_drafted]
    confidence: float = 0.0  # the source's confidence in the whole proposal, in [0, 1]
    origins: tuple[str, ...] | None = None  # [num_drafted] per-node label; default: source
    info: Mapping = field(default_factory=dict, compare=False, hash=False)

    @classmethod
    def chain(cls, source: str, tokens: Sequence[int], confidence: float = 0.0, **info) -> Proposal:
        """A chain of ``tokens``. Integer ids become ints; a float or bool is kept, and refused by
        :func:`check_proposal` when the proposal leaves its source."""
        toks = tuple(_as_id(t) for t in tokens)
        return cls(source, toks, tuple(range(-1, len(toks) - 1)), None, confidence, None, info)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def first_chain(self) -> tuple[int, ...]:
        """All the tokens of a chain; for a tree, the path through each node's first child (a source's likeliest)."""
        out, node = [], -1
        for i, p in enumerate(self.parents):
            if p == node:
                out.append(self.tokens[i])
                node = i
        return tuple(out)

    def as_tree(self, root: int, route: str | None = None) -> DraftTree:
        """The proposal hung under ``root``, every node credited to its source (route: "path" or "tree")."""
        origins = self.origins or (self.source,) * len(self.tokens)
        return DraftTree.build((root, *self.tokens), (-1, *(p + 1 for p in self.parents)), (ROOT, *origins),
                               None if self.scores is None else (1.0, *self.scores),
                               route or ("path" if self.is_chain else "tree"),
                               ((),) + ((self.source,),) * len(self.tokens))


@dataclass(frozen=True)
class Verified:
    """One target forward pass and its outcome. Prefill: ``tokens`` are the prompt positions whose logits were
    computed (the last ``keep``), ``predecessors`` the tokens before them (-1 before the first). Tree pass:
    ``tokens`` are the tree's nodes, ``predecessors`` their parents' tokens; the root's is the token before the
    anchor on the single-step, chain and bypass routes, -1 on tree routes (as in the GOOSE reference)."""

    kind: str  # "prefill" or "tree"
    tokens: torch.Tensor  # [n] long: token at each verified position
    predecessors: torch.Tensor  # [n] long: token before it, -1 when none
    logits: torch.Tensor  # [n, vocab] target logits at each position (float)
    argmax: tuple[int, ...]  # [n] target's greedy next token at each position
    tree: DraftTree | None = None  # the verified tree (tree passes)
    path: tuple[int, ...] = ()  # accepted node indices, root first (tree passes)
    accepted: tuple[int, ...] = ()  # accepted draft tokens: root and bonus excluded
    bonus: int | None = None  # the target's token after the last accepted node (None: the walk ended on one)
    walk: str = "greedy"  # how tokens were chosen: "greedy" (raw argmax), "processed" or "sample"
    # a prefill that computed its last row only: returns the record with every row the sources asked for
    # (None: not available); the loop calls it before the first draft. A wrapping verifier passes it on as is.
    rest: Callable[[], Verified | None] | None = field(default=None, compare=False, repr=False)

    @property
    def accept_length(self) -> int:
        return len(self.accepted)


class _Component(ABC):
    """What the three roles share: the registered ``name``, the ``Options`` model and per-generation stats."""

    name: ClassVar[str] = ""
    Options: ClassVar[type[Options]] = Options

    def __init__(self, options: Options | None = None):
        self.options = options if options is not None else self.Options()

    def stats(self) -> dict:
        """Per-generation statistics, reported in ``stats.extra`` under the source's name, ``"policy"`` or
        ``"verifier"`` (a verifier's ``prefill_logit_rows`` as ``stats.extra["prefill_logit_rows"]``)."""
        return {}


class DraftSource(_Component):
    """A source of draft tokens: implement :meth:`propose` (a chain source), :meth:`successors` with
    ``provides_successors = True`` (a successor source, whose answers policies hang as branches), or both."""

    provides_successors: ClassVar[bool] = False
    #: with the name, the key of this source's measured confidence tiers (``goose tiers``): raise it when a
    #: change makes earlier measurements stale
    version: ClassVar[str] = "1"

    def attach(self, model, tokenizer) -> None:
        """Called once by ``compose`` with the target model and the decoder's tokenizer (None: composed without
        one), with which a source that works on text (a phrase list, a retrieval index) tokenizes it."""

    def begin(self, request: Request) -> None:
        """A generation starts; reset per-request state."""

    def end(self, output) -> None:
        """A generation succeeded: ``output`` is its :class:`~goose.decoding.GenerationOutput`. Called on the
        instance that drafted it (not when it raised): a source that learns across requests does so here."""

    def propose(self, state: DraftState) -> Proposal | None:
        """Draft tokens to follow ``state.anchor``, or None (a source that drafts only through
        :meth:`successors` need not implement it)."""
        return None

    def observe(self, verified: Verified) -> None:
        """Learn from a verified forward pass (prefill or tree). Called after every pass."""

    def prefill_positions(self, prompt_len: int) -> int:
        """How many trailing prompt positions' logits this source learns from in the prefill (0: none). The
        prefill computes only the most any source asks for: ``prompt_len x vocab`` logits can outweigh the model."""
        return 0

    def successors(self, token: int, prev: int | None) -> tuple[Sequence[int], Sequence[float]]:
        """Likely tokens after ``token`` (preceded by ``prev``), best first, with scores."""
        return (), ()


class DraftContext:
    """What a tree policy works from in one step: the state, the budget, and lazy proposals (a source's
    ``propose`` runs when a policy first asks for it; its errors come back as a ``DraftSourceError``)."""

    __slots__ = ("state", "sources", "_proposals", "_succ", "source_s", "noise", "vocab_size", "branch_rates", "asked")

    def __init__(self, state: DraftState, sources: Sequence[DraftSource], noise=None, vocab_size: int | None = None,
                 branch_rates: BranchRates | None = None):
        self.state = state
        self.vocab_size = vocab_size  # proposals' ids are checked against it (None: non-negative only)
        self.sources = tuple(sources)
        self._proposals: dict[str, Proposal | None] = {}
        self._succ = tuple(s for s in self.sources if s.provides_successors)
        self.source_s = 0.0  # seconds spent inside the sources (propose, successors) this step
        self.noise = noise  # when sampling: this step's draw noise (goose.sampling.NoiseView), else None
        # two or more successor sources: their answers merge, ranked by these measured rates (goose.branches)
        self.branch_rates = branch_rates if branch_rates is not None or len(self._succ) < 2 else BranchRates()
        # {(token, prev): ((source, ids, scores), ...)}: the successor answers asked for this step, which the
        # loop books against the target's tokens after the pass (BranchRates.book)
        self.asked: dict = {}

    @property
    def budget(self) -> int:
        return self.state.budget

    def source(self, name: str) -> DraftSource | None:
        return next((s for s in self.sources if s.name == name), None)

    def proposal(self, name: str) -> Proposal | None:
        """Source ``name``'s checked proposal (None: no such source, or nothing proposed), asked once per step."""
        if name in self._proposals:
            return self._proposals[name]
        src = self.source(name)
        t0 = time.perf_counter()
        result = None if src is None else call_source(src, self.state, self.vocab_size)
        self.source_s += time.perf_counter() - t0
        self._proposals[name] = result
        return result

    def proposals(self) -> dict[str, Proposal]:
        """Every source's proposal, in source order, empty ones dropped."""
        return {s.name: p for s in self.sources if (p := self.proposal(s.name)) is not None and len(p)}

    def successors(self, token: int, prev: int | None, depth: int | None = None) -> Successors:
        """Likely next tokens after ``token`` (``prev`` before it) from every successor source: ``(ids, scores,
        sources)``, best first, ``sources[i]`` naming who proposed ``ids[i]``. One source's answer comes as
        given; several merge into one list ranked by measured acceptance (goose.branches). ``depth``: the tree
        depth they would be placed at (1: the root's children); given it while sampling, they are ranked by how
        likely this step's draw there picks each (:class:`~goose.sampling.NoiseView`)."""
        t0 = time.perf_counter()
        try:
            key = (token, prev)
            answers = self.asked.get(key)
            if answers is None:
                answers = self.asked[key] = self._ask(token, prev)
            if not answers:
                return _NO_SUCCESSORS
            if self.branch_rates is None:  # one successor source: its own answer
                name, ids, scores = answers[0]
                out = Successors(ids, scores, ((name,),) * len(ids))
            else:
                out = self.branch_rates.merge([(name, ids) for name, ids, _ in answers])
            if depth is not None and self.noise is not None and len(out.ids) > 1:
                by = dict(zip(out.ids, out.sources))
                ids, scores = self.noise.rank(out.ids, out.scores, depth)
                out = Successors(ids, scores, [by[t] for t in ids])
            return out
        finally:
            self.source_s += time.perf_counter() - t0

    def _ask(self, token: int, prev: int | None) -> tuple:
        """``((source, ids, scores), ...)``: every successor source's answer that is not empty, checked."""
        out = []
        for s in self._succ:
            try:
                ids, scores = s.successors(token, prev)
            except Exception as exc:  # noqa: BLE001 - re-raised with the plugin's name
                raise DraftSourceError(s.name, f"successors({token}, {prev}) raised {type(exc).__name__}: {exc}",
                                       "successors") from exc
            if len(ids) or len(scores):
                ids, scores = check_successors(s.name, token, ids, scores, self.vocab_size)
                out.append((s.name, ids, scores))
        return tuple(out)


_NO_SUCCESSORS = Successors((), (), ())


def _as_id(t):
    """An int for integer-valued ids (numpy or 0-d torch integers), anything else as it is."""
    if isinstance(t, int):  # bools included: kept, to be refused
        return t
    if isinstance(t, np.integer):
        return int(t)
    if isinstance(t, torch.Tensor) and t.numel() == 1 and not t.dtype.is_floating_point and t.dtype != torch.bool:
        return int(t)
    return t


def call_source(src: DraftSource, state: DraftState, vocab_size: int | None = None) -> Proposal | None:
    """``src.propose(state)``, checked as it leaves the source (:func:`check_proposal`); errors name the source."""
    try:
        prop = src.propose(state)
    except Exception as exc:  # noqa: BLE001 - re-raised with the plugin's name
        raise DraftSourceError.raised(src.name, "propose", exc) from exc
    if prop is None:
        return None
    if not isinstance(prop, Proposal):
        raise DraftSourceError(src.name, f"propose() must return a goose.Proposal or None, got {type(prop).__name__}")
    return check_proposal(src.name, prop, vocab_size)


def _finite(x) -> bool:
    """Whether ``x`` is a finite real number (a bool is not)."""
    return not isinstance(x, bool) and isinstance(x, numbers.Real) and math.isfinite(x)


def check_successors(source: str, token: int, ids: Sequence, scores: Sequence, vocab_size: int | None = None):
    """``(ids, scores)`` from source ``source``'s ``successors(token, ...)``, checked (one finite score per id, ids
    distinct ints in ``[0, vocab_size)``), or a :class:`DraftSourceError` naming the source, position and value."""

    def bad(what: str, hint: str):
        raise DraftSourceError(source, f"successors({token}, ...) returned {what}. Hint: {hint}")

    n = len(ids)
    if len(scores) != n:
        bad(f"{n} ids but {len(scores)} scores", "one score per successor id")
    if not all(type(t) is int for t in ids):
        ids = [_as_id(t) for t in ids]
        for i, t in enumerate(ids):
            if type(t) is not int:
                bad(f"id {t!r} ({type(t).__name__}) at position {i}, not an integer token id", "return int ids")
    lo, hi = min(ids), max(ids)
    if lo < 0 or (vocab_size is not None and hi >= vocab_size):
        b = lo if lo < 0 else hi
        bad(f"token id {b}, outside the vocabulary [0, {vocab_size})", "successors from this model's tokenizer")
    if len(set(ids)) != n:
        bad(f"a repeated id in {list(ids)}", "list each successor once, best first")
    for i, sc in enumerate(scores):
        if not _finite(sc):
            bad(f"score {sc!r} at position {i}, not a finite number",
                "scores are the successors' probabilities or weights")
    return ids, scores


def _plainly_valid(prop: Proposal, vocab_size: int | None) -> bool:
    """Whether ``prop`` passes every node check of :func:`check_proposal` as it is: a bulk test, so that a valid
    proposal skips the node-by-node checks, which exist to name what is wrong."""
    tokens, parents = prop.tokens, prop.parents
    n = len(tokens)
    if type(prop.confidence) is not float or not n:
        return False
    if not all(type(t) is int for t in tokens) or not all(type(p) is int for p in parents):
        return False
    if min(tokens) < 0 or (vocab_size is not None and max(tokens) >= vocab_size):
        return False
    # a chain has no siblings to repeat; a tree's parents come before their children
    if not prop.is_chain and not (min(parents) >= -1 and all(p < i for i, p in enumerate(parents))
                                  and len(set(zip(parents, tokens))) == n):
        return False
    sc = prop.scores
    return sc is None or all(type(x) is float and math.isfinite(x) for x in sc)


def check_proposal(source: str, prop: Proposal, vocab_size: int | None = None) -> Proposal:
    """``prop`` as it leaves source ``source``, checked (ids, parents and confidence normalised to int and float),
    or a :class:`DraftSourceError` naming the source, the node index and the value."""

    def bad(what: str, hint: str):
        raise DraftSourceError(source, f"{what}. Hint: {hint}")

    if prop.source != source:
        bad(f"its proposal says source={prop.source!r}; a proposal is credited to the source that made it",
            "Proposal.chain(self.name, ...) / Proposal(self.name, ...)")
    n = len(prop.tokens)
    if len(prop.parents) != n:
        bad(f"proposal has {n} tokens but {len(prop.parents)} parents", "one parent per token (-1: the root)")
    for name, per_node in (("scores", prop.scores), ("origins", prop.origins)):
        if per_node is not None and len(per_node) != n:
            bad(f"proposal has {n} tokens but {len(per_node)} {name}", f"one {name[:-1]} per token, or {name}=None")
    c = prop.confidence
    if not _finite(c) or not 0.0 <= c <= 1.0:
        bad(f"confidence={c!r} is not allowed: a finite number in [0, 1]",
            "0 when unsure; the policies give a confident chain more budget (docs/plugins.md)")
    if _plainly_valid(prop, vocab_size):
        return prop
    limit = f"[0, {vocab_size})" if vocab_size is not None else "[0, vocabulary size)"
    tokens = tuple(_as_id(t) for t in prop.tokens)
    seen: dict[tuple[int, int], int] = {}
    for i, (t, p) in enumerate(zip(tokens, prop.parents)):
        if isinstance(t, bool) or not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size):
            bad(f"proposal node {i}: token id {t!r} is not allowed: an int in {limit}",
                "draft ids of this model's tokenizer, as ints")
        p = _as_id(p)
        if isinstance(p, bool) or not isinstance(p, int) or not (p == -1 or 0 <= p < i):
            bad(f"proposal node {i}: parent {p!r} is not allowed: -1 (the root) or an earlier node 0..{i - 1}",
                "parents[i] names a node before i; a chain is parents=(-1, 0, 1, ...)")
        if (p, t) in seen:
            bad(f"proposal node {i}: token {t} under parent {p} repeats node {seen[p, t]} (duplicate siblings)",
                "propose each continuation once; merge duplicates before returning")
        seen[p, t] = i
    if prop.scores is not None:
        for i, s in enumerate(prop.scores):
            if not _finite(s):
                bad(f"proposal node {i}: score {s!r} is not allowed: a finite number", "scores=None if there are none")
    if any(type(t) is not int for t in (*prop.tokens, *prop.parents)) or type(c) is not float:
        prop = replace(prop, tokens=tokens, parents=tuple(int(_as_id(p)) for p in prop.parents), confidence=float(c))
    return prop


class TreePolicy(_Component):
    """Turns the sources' proposals and a node budget into one draft tree."""

    def bind(self, sources: Sequence[DraftSource]) -> None:
        """Called once by ``compose`` with the decoder's sources; raise GooseError if unusable."""

    def attach(self, model, verifier: Verifier) -> None:
        """Called once by ``compose`` with the target model and the bound verifier that will run it (e.g. to
        calibrate that verifier's latency through its speed protocol)."""

    def max_nodes(self, budget: int) -> int:
        """The most nodes (root included) a tree of this policy may have at ``budget``; the loop refuses larger
        trees. A policy that extends the budget (e.g. with confidence) overrides it."""
        return budget

    def begin(self, request: Request) -> None:
        """A generation starts; reset per-request state."""

    def end(self, output) -> None:
        """A generation finished (see :meth:`DraftSource.end`)."""

    def consulted(self, sources: Sequence[DraftSource]) -> frozenset[str] | None:
        """After :meth:`bind`: the names of the sources this policy may ever draft from (None: any of them).
        ``compose`` warns about a source the policy never consults."""
        return None

    def prefill_positions(self, prompt_len: int, wanted: int) -> int:
        """How many trailing prompt positions' logits the prefill computes, given what the sources want (the loop
        computes at least 1); a policy that knows what a row through the LM head costs (``fit``) may lower it."""
        return wanted

    @abstractmethod
    def shape(self, ctx: DraftContext) -> DraftTree | None:
        """Return the tree to verify (root = ``ctx.state.anchor``), or None for an ordinary step."""

    def observe(self, verified: Verified) -> None:
        """Learn from a verified pass (e.g. update acceptance estimates)."""


class Verifier(_Component):
    """Runs the target model: the prefill, then one forward per draft tree, and keeps its cache.

    The loop also reads ``vocab_size`` (ids outside ``[0, vocab_size)`` are refused), ``max_positions`` (the
    model's context, None: unbounded) and ``supports_rules`` (True: trees are walked with the request's
    :class:`~goose.sampling.TokenRule`, passed as ``rule``; False: greedy requests only, ``rule`` never passed).
    :meth:`bind` sets the first two from the model's config; a wrapping verifier, from the inner one.

    **Speed protocol** (:meth:`timing_key` to :meth:`forms_kept`): how ``spine-fit`` and ``goose calibrate``
    measure this verifier's latency curve (goose.verifiers.latency, docs/plugins.md); the defaults time
    :meth:`verify`."""

    supports_rules: ClassVar[bool] = False
    #: part of :meth:`timing_key`: raise it when a change makes this verifier's earlier latency curves stale
    version: ClassVar[str] = "1"
    vocab_size: int
    max_positions: int | None = None

    def bind(self, model) -> None:
        """Attach the target model; raise UnsupportedModelError if it cannot be served. Sets ``vocab_size``
        and ``max_positions`` from the model's (text) config where it has them."""
        self.model = model
        cfg = getattr(model, "config", None)
        if cfg is not None:
            text = text_config(cfg)
            if getattr(text, "vocab_size", None) is not None:
                self.vocab_size = int(text.vocab_size)
            self.max_positions = getattr(text, "max_position_embeddings", None)

    def check_request(self, prompt_len: int, max_new_tokens: int, max_depth: int) -> None:
        """Refuse a request this verifier cannot serve exactly (before any forward)."""

    @abstractmethod
    def prefill(self, prompt_ids: torch.Tensor, keep: int | None = None, rule=None) -> Verified:
        """Run the prompt (``[prompt_len]`` long) through the model, fresh cache. ``keep``: compute the logits of
        the last ``keep`` positions only (None: all), which the record covers; or return the last row only, with
        ``Verified.rest`` computing the full record (called before the first draft). ``rule``: the request's
        token rule, passed only when ``supports_rules``; the first token is ``rule.choose(...)`` instead of the
        argmax, and the same rule reaches every :meth:`verify` of the request."""

    @abstractmethod
    def verify(self, tree: DraftTree, rule=None) -> Verified:
        """Verify ``tree`` (its root is the anchor), walk it (greedily, or with ``rule``), commit the accepted path."""

    def end(self) -> None:
        """Release per-request state (the cache)."""

    def timing_key(self) -> dict:
        """Speed protocol: what this verifier's pass time depends on besides the model, the machine and the
        thread count; its latency curve is stored under it. Default: the class, name, version and options."""
        cls = type(self)
        return {"class": f"{cls.__module__}.{cls.__qualname__}", "name": self.name, "version": self.version,
                "options": self.options.model_dump(mode="json")}

    def pass_forms(self) -> tuple[str, ...]:
        """The forms (kernels) besides the default that a pass may run in, for the calibration to compare."""
        return ()

    def form_serves(self, form: str, rows: int) -> bool:
        """Whether ``form`` (one of :meth:`pass_forms`) runs a pass of ``rows`` nodes."""
        return False

    def time_pass(self, tree: DraftTree, form: str | None = None) -> float:
        """Seconds of one pass of ``tree`` (its root a committed token's successor) over the cache of the last
        :meth:`prefill`, in ``form`` (None: the default). The default times :meth:`verify`, which commits the
        walk's tokens: the cache grows by a token or so per pass, which the calibration allows."""
        t0 = time.perf_counter()
        self.verify(tree)
        return time.perf_counter() - t0

    def forms_kept(self, forms: frozenset[str]) -> None:
        """After a calibration of this verifier: the forms it found fastest at some size. The verifier may free
        what the others hold (packed weights, buffers), and should read its curve anew before its next pass:
        a calibration on first use runs through the verifier's own prefill, before any curve exists."""


def text_config(config):
    """The text decoder's part of a model config (a multimodal config holds it inside), or the config itself."""
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
