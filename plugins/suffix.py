"""Suffix matching over the request and a history of earlier generations (SuffixDecoding-style).

The source ``suffix`` drafts what followed the longest suffix of the current text wherever it occurred before:
earlier in this request (prompt + committed tokens) or in the prompt and output of earlier requests of the same
decoder (the *history*). Where that suffix occurred with different continuations, the proposal is a **tree**
whose branches are weighted by how often each followed it (after SuffixDecoding, Oliaro et al., arXiv
2411.04975; written from the paper's description).

Index (:class:`_Segment`): the current request (appended to as tokens are committed) and each remembered request
are segments, each indexing every n-gram that has a following token, for ``n`` = ``min_pattern`` doubling up to
``max_pattern`` (2, 4, 8, 16, 32 by default). Each ``propose`` indexes only positions committed since the last.

Lookup (:meth:`SuffixSource._match`): from the longest indexed length down, in every segment (the current request
first, then the history newest first). At the first length ``n`` with a hit, at most ``max_occurrences``
occurrences are taken, most recent first, each checked token by token (hashes may collide) and extended
backwards to its exact match length (below the next indexed length, which missed, and at most ``max_pattern``).
The **pattern** ``m`` is the longest of these; only the occurrences that match ``m`` tokens are counted.

Tree (:meth:`SuffixSource._grow`): a node's score is the estimated probability of reaching it, the product of
``count(child) / count(parent)`` along its path (an occurrence whose text ends is counted in the parent, so the
estimate is conservative). Nodes are grown best-first by score (ties: the more recent occurrence) until
``max_nodes`` nodes, depth ``min(max_depth, state.max_depth)``, or scores below ``min_prob``. Siblings are
distinct tokens in ``[0, vocab_size)``, by frequency. The **likeliest chain** (the most frequent child at each
node) comes first, as nodes ``0..k-1`` with parents ``-1, 0, ..., k-2``, so a policy that reads a tree
proposal's first root-to-leaf path reads it; the other branches follow, parents before children.

History (:class:`SuffixHistory`): **all component sets of one decoder share one history**, so concurrent requests
learn from each other's finished generations, while the current request's index is per set; another
``goose.compose`` builds a new source with a history of its own. ``end(output)`` adds the request (its prompt
unless ``history_prompts=False``, and its committed tokens); the oldest requests, with their index, are evicted
beyond ``history`` requests or ``history_tokens`` tokens (a single request longer than that is not kept).
"""

from __future__ import annotations

import functools
import heapq
import sys
import threading
from array import array
from collections.abc import Sequence

import numpy as np

from pydantic import Field, model_validator

from goose.hookspecs import hookimpl
from goose.interfaces import DraftSource, DraftState, Options, Proposal, Request


class SuffixOptions(Options):
    history: int = Field(
        16, ge=0, le=1_000_000,
        description="earlier requests of this decoder kept for matching (prompt + output each); 0: no history",
        json_schema_extra={"why": "memory, and whether other requests are matched at all (0: this request only)"},
    )
    history_tokens: int = Field(
        65536, ge=0,
        description="most tokens kept across the history; the oldest requests are evicted first",
        json_schema_extra={"why": "memory bound of the history, in tokens"},
    )
    history_prompts: bool = Field(
        True, description="keep earlier requests' prompts in the history, not only their outputs",
        json_schema_extra={"why": "off: match earlier outputs only, where prompts repeat but their answers do not"},
    )
    max_pattern: int = Field(32, ge=1, le=1024, description="longest suffix of the current text matched",
        json_schema_extra={"why": "matching cost per step against how specific a match is"},
    )
    min_pattern: int = Field(2, ge=1, le=1024, description="shortest match accepted",
        json_schema_extra={"why": "raise it where short matches draft noise"},
    )
    max_depth: int = Field(24, ge=1, le=4096, description="deepest node of a proposal",
        json_schema_extra={"why": "the deepest token worth drafting on this device (SuffixDecoding's max tree depth)"},
    )
    max_nodes: int = Field(32, ge=1, le=4096, description="most nodes in a proposal tree",
        json_schema_extra={"why": "the tree size the verifier can afford per step"},
    )
    max_occurrences: int = Field(
        64, ge=1, le=1_000_000,
        description="occurrences of the matched suffix considered, most recent first (bounds the work per step)",
        json_schema_extra={"why": "work per step on very repetitive histories"},
    )
    min_prob: float = Field(
        0.1, ge=0.0, le=1.0,
        description="drop continuations whose estimated probability of being reached falls below this",
        json_schema_extra={"why": "draft length against wasted nodes (SuffixDecoding's min_token_prob)"},
    )
    tree: bool = Field(
        True, description="propose the tree of continuations; False: only its likeliest chain (for engines that "
        "verify one chain, e.g. vLLM; cheaper: no branch is grown)",
        json_schema_extra={"why": "off for engines that verify one chain (vLLM): the likeliest chain only"},
    )

    @model_validator(mode="after")
    def _patterns(self):
        if self.min_pattern > self.max_pattern:
            raise ValueError(f"min_pattern ({self.min_pattern}) must be <= max_pattern ({self.max_pattern})")
        return self


def pattern_lengths(min_pattern: int, max_pattern: int) -> tuple[int, ...]:
    """The indexed n-gram lengths: ``min_pattern``, doubling, and ``max_pattern``; ascending."""
    out = []
    n = min_pattern
    while n < max_pattern:
        out.append(n)
        n *= 2
    out.append(max_pattern)
    return tuple(out)


_P = 0x9E3779B97F4A7C15  # odd multiplier of the n-gram hash (arithmetic mod 2**64)
_MASK = (1 << 64) - 1
_BULK = 16  # an append of at least this many positions is indexed with numpy


@functools.lru_cache(maxsize=None)
def _powers(n: int) -> tuple[int, ...]:
    """``P ** i mod 2**64`` for i in 0..n (shared by every segment and lookup of one longest pattern)."""
    out = [1]
    for _ in range(n):
        out.append((out[-1] * _P) & _MASK)
    return tuple(out)


def ngram_hash(tokens: Sequence[int]) -> int:
    """The index's hash of an n-gram: ``sum(t[n - 1 - i] * P ** i) mod 2**64`` (the last token times 1)."""
    h = 0
    for t in tokens:
        h = (h * _P + t) & _MASK
    return h


class _Segment:
    """One text (a request's tokens) and its n-gram index for the lengths in ``lengths``: ``last[k]`` maps the
    hash of an n-gram (n = lengths[k]) to its latest end position e, ``prev[k][e]`` is the previous end with the
    same hash (-1: none), so occurrences are walked most recent first. The hash (:func:`ngram_hash`) is read from
    the prefix hashes ``ph[e]`` (of tokens 0..e), so an append costs a few integer operations per length; a long
    one is hashed and chained with numpy. Only ends with a following token (e <= len(tokens) - 2) are indexed."""

    __slots__ = ("lengths", "tokens", "last", "prev", "indexed", "frozen", "ph", "_pow", "_nbytes", "__weakref__")

    def __init__(self, lengths: Sequence[int]):
        self.lengths = tuple(lengths)
        self.tokens: list[int] | array = []
        self.last: list[dict[int, int]] = [{} for _ in self.lengths]
        self.prev: list[array] = [array("i") for _ in self.lengths]
        self.indexed = 0  # end positions < indexed are in the index
        self.frozen = False
        self.ph: list[int] | None = []  # prefix hashes of tokens 0..e (dropped when frozen)
        self._pow = _powers(max(self.lengths))
        self._nbytes: int | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        """Append ``tokens`` and index every position that now has a follower."""
        if self.frozen:
            raise RuntimeError("a frozen (history) segment is immutable")
        start = len(self.tokens)
        self.tokens.extend(tokens)
        toks, ph = self.tokens, self.ph
        stop = len(toks) - 1  # the last position has no follower yet
        if stop - self.indexed >= _BULK:
            self._prefix_bulk(start)
            self._index_bulk(stop)
            return
        h = ph[-1] if ph else 0
        for t in toks[start:]:
            h = (h * _P + t) & _MASK
            ph.append(h)
        pw = self._pow
        for e in range(self.indexed, stop):
            for k, n in enumerate(self.lengths):
                prev = self.prev[k]
                if e - n + 1 < 0:
                    prev.append(-1)
                    continue
                h = ph[e] if e < n else (ph[e] - ph[e - n] * pw[n]) & _MASK
                table = self.last[k]
                prev.append(table.get(h, -1))
                table[h] = e
        self.indexed = max(self.indexed, stop)

    def _prefix_bulk(self, start: int) -> None:
        """Prefix hashes of positions ``start..`` with numpy: a scan of the linear recurrence
        ``ph[e] = ph[e - 1] * P + t[e]`` by doubling shifts (uint64 wraps mod 2**64)."""
        x = np.asarray(self.tokens[start:], dtype=np.int64).astype(np.uint64)  # an id mod 2**64, as in the loop
        s, pw = 1, _P
        with np.errstate(over="ignore"):
            if start and self.ph:
                x[0] += np.uint64((self.ph[-1] * _P) & _MASK)
            while s < len(x):
                x[s:] += x[:-s] * np.uint64(pw)
                s, pw = 2 * s, (pw * pw) & _MASK
        self.ph.extend(x.tolist())

    def _index_bulk(self, stop: int) -> None:
        """Index end positions ``indexed..stop - 1`` at once (as the loop in :meth:`extend` would)."""
        php = np.zeros(len(self.ph) + 1, dtype=np.uint64)  # php[e + 1] = ph[e]; php[0]: the empty prefix
        php[1:] = self.ph
        lo = self.indexed
        for k, n in enumerate(self.lengths):
            prev, table = self.prev[k], self.last[k]
            first = min(max(lo, n - 1), stop)  # earlier ends have no n tokens before them
            prev.extend([-1] * (first - lo))
            if first >= stop:
                continue
            e = np.arange(first, stop)
            with np.errstate(over="ignore"):
                h = php[first + 1 : stop + 1] - php[first - n + 1 : stop - n + 1] * np.uint64(self._pow[n])
            order = np.argsort(h, kind="stable")  # by hash, positions ascending within one
            hs = h[order]
            same = np.zeros(len(h), dtype=bool)
            same[1:] = hs[1:] == hs[:-1]
            chained = np.full(len(h), -1, dtype=np.int64)
            chained[order[1:]] = np.where(same[1:], e[order[:-1]], -1)
            if table:  # the first of each hash chains to the table's latest end
                heads = order[~same]
                get = table.get
                chained[heads] = [get(x, -1) for x in h[heads].tolist()]
            prev.extend(chained.tolist())
            table.update(zip(h.tolist(), e.tolist()))  # in order of position: the latest end is kept
        self.indexed = stop

    def freeze(self) -> _Segment:
        """Make the segment immutable (a history segment): tokens become a compact array."""
        if not self.frozen:
            try:
                self.tokens = array("i", self.tokens)
            except OverflowError:  # pragma: no cover - ids beyond 2**31
                self.tokens = array("q", self.tokens)
            self.frozen = True
            self.ph = None  # only appends read it
        return self

    def entries(self) -> int:
        return sum(len(d) for d in self.last)

    def nbytes(self) -> int:
        """Approximate memory held: the token array, the chain arrays, the dicts, their keys and values."""
        if self._nbytes is not None:
            return self._nbytes
        b = sys.getsizeof(self.tokens) + sum(sys.getsizeof(p) for p in self.prev)
        for d in self.last:
            b += sys.getsizeof(d) + sum(sys.getsizeof(key) + sys.getsizeof(val) for key, val in d.items())
        if self.frozen:  # kept: the segment no longer changes
            self._nbytes = b
        return b


class SuffixHistory:
    """Earlier requests of one decoder, as frozen segments, oldest first; bounded; thread-safe: appends and
    evictions take the lock, readers only to read the tuple of segments (immutable once here). Shared by every
    component set of the decoder: ``copy.deepcopy`` returns the same object."""

    def __init__(self, max_requests: int, max_tokens: int):
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._segments: tuple[_Segment, ...] = ()
        self._tokens = 0
        self.added = 0
        self.evicted = 0

    def __deepcopy__(self, memo) -> SuffixHistory:
        return self  # one history per decoder: every pooled component set learns into it

    def __getstate__(self):
        state = dict(self.__dict__)
        del state["_lock"]
        return state

    def __setstate__(self, state) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def add(self, seg: _Segment) -> None:
        """Remember a finished request (a frozen segment); evict the oldest beyond the limits."""
        seg.freeze()
        with self._lock:
            segs = (*self._segments, seg)
            tokens = self._tokens + len(seg)
            drop = 0
            while drop < len(segs) and (len(segs) - drop > self.max_requests or tokens > self.max_tokens):
                tokens -= len(segs[drop])
                drop += 1
            self._segments = segs[drop:]
            self._tokens = tokens
            self.added += 1
            self.evicted += drop

    def segments(self) -> tuple[_Segment, ...]:
        """The remembered requests, oldest first (an immutable snapshot)."""
        with self._lock:
            return self._segments

    def __len__(self) -> int:
        return len(self.segments())

    @property
    def tokens(self) -> int:
        with self._lock:
            return self._tokens

    def index_size(self) -> tuple[int, int]:
        """(index entries, approximate bytes) held by the history."""
        segs = self.segments()
        return sum(s.entries() for s in segs), sum(s.nbytes() for s in segs)


def confidence(p1: float, n1: int, pattern: int) -> float:
    """``p1 * (1 - 2 ** (-pattern / 4)) * (1 if n1 >= 2 else 0.8)``, ``p1`` the estimated probability of the chain's
    first token and ``n1`` its count: a longer match and a continuation seen more than once mean a likelier chain
    (pattern 4: 0.5, 8: 0.75, 16: 0.94, 32: 0.996 of ``p1``). Below 1: a spine never bypasses its tree for it alone."""
    if pattern <= 0 or n1 <= 0 or p1 <= 0.0:
        return 0.0
    c = p1 * (1.0 - 2.0 ** (-pattern / 4.0)) * (1.0 if n1 >= 2 else 0.8)
    return min(1.0, max(0.0, c))


def _continuations(members: list, vocab: int | None) -> dict[int, list]:
    """``members`` (``(text, position)``, most recent first) grouped by the token at their position, each moved one
    past it; in order of first appearance, so among groups of one size the first is the most recent. Members at
    their text's end, and tokens outside ``[0, vocab)``, are left out."""
    groups: dict[int, list] = {}
    for seq, pos in members:
        t = seq[pos] if pos < len(seq) else -1
        if t >= 0 and (vocab is None or t < vocab):
            groups.setdefault(t, []).append((seq, pos + 1))
    return groups


class SuffixSource(DraftSource):
    """Suffix matching over the request and earlier generations (SuffixDecoding-style): a frequency-weighted tree."""

    name = "suffix"
    Options = SuffixOptions

    def __init__(self, options: SuffixOptions | None = None):
        super().__init__(options)
        o = self.options
        self.lengths = pattern_lengths(o.min_pattern, o.max_pattern)
        self.history = SuffixHistory(o.history, o.history_tokens)
        self.live: _Segment | None = None
        self.vocab_size: int | None = None
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.proposals = 0
        self.history_proposals = 0

    # -- lifecycle -----------------------------------------------------------------------------
    def begin(self, request: Request) -> None:
        self.live = _Segment(self.lengths)
        self.vocab_size = request.vocab_size
        self._reset_counters()

    def end(self, output) -> None:
        o = self.options
        live, self.live = self.live, None  # handed over to the history (or dropped): never mutated again
        if o.history == 0 or o.history_tokens == 0:
            return
        seq = [*output.prompt_ids, *output.token_ids] if o.history_prompts else list(output.token_ids)
        seg = live
        if not o.history_prompts or live is None or len(live) > len(seq) or list(live.tokens) != seq[: len(live)]:
            seg = _Segment(self.lengths)  # not this request's text (or its prompt left out): index it afresh
        seg.extend(seq[len(seg) :])
        if len(seg) > o.history_tokens:
            return  # longer than the whole history may hold
        self.history.add(seg)

    # -- drafting ------------------------------------------------------------------------------
    def _sync(self, tokens: Sequence[int]) -> _Segment:
        live = self.live
        n = len(tokens)
        if live is None or len(live) > n or (len(live) and live.tokens[-1] != tokens[len(live) - 1]):
            live = self.live = _Segment(self.lengths)  # a different sequence: start over
        if n > len(live):
            live.extend(tokens[len(live) :])  # only the positions committed since the last call
        return live

    def _match(self, q: list[int], segs: Sequence[_Segment]):
        """(pattern length, [(segment, end position)]) of the longest suffix of ``q`` that occurred."""
        o = self.options
        lq = len(q)
        hashes = [0]  # hashes[n]: ngram_hash of q's last n tokens, every n at once
        pw = _powers(self.lengths[-1])
        for j in range(min(lq, self.lengths[-1])):
            hashes.append((hashes[-1] + q[lq - 1 - j] * pw[j]) & _MASK)
        for k in range(len(self.lengths) - 1, -1, -1):
            n = self.lengths[k]
            if n > lq:
                continue
            key = tuple(q[lq - n :])
            h = hashes[n]
            found: list[tuple[_Segment, int, int]] = []
            budget = o.max_occurrences
            for seg in segs:
                e = seg.last[k].get(h, -1)  # the latest end with this hash; most segments have none
                if e < 0:
                    continue
                prev, toks = seg.prev[k], seg.tokens
                while e >= 0 and budget > 0:
                    budget -= 1
                    if tuple(toks[e - n + 1 : e + 1]) == key:  # else a hash collision
                        m = n
                        lim = min(o.max_pattern, e + 1, lq)
                        while m < lim and toks[e - m] == q[lq - 1 - m]:
                            m += 1
                        found.append((seg, e, m))
                    e = prev[e]
                if budget <= 0:
                    break
            if found:
                best = max(m for _, _, m in found)
                return best, [(seg, e) for seg, e, m in found if m == best]
        return 0, []

    def propose(self, state: DraftState) -> Proposal | None:
        o = self.options
        tokens = state.tokens
        live = self._sync(tokens)
        depth_cap = min(o.max_depth, state.max_depth)
        if depth_cap <= 0 or len(tokens) < o.min_pattern:
            return None
        q = list(tokens[-o.max_pattern :])
        history = self.history.segments() if o.history else ()
        segs = (live, *reversed(history))
        pattern, occ = self._match(q, segs)
        if not occ:
            return None
        tree = self._grow(occ, depth_cap)
        if tree is None:
            return None
        toks, parents, scores, counts, chain_len = tree
        n_hist = sum(1 for seg, _ in occ if seg is not live)
        conf = confidence(scores[0], counts[0], pattern)
        self.proposals += 1
        if n_hist:
            self.history_proposals += 1
        info = {"match_len": chain_len, "pattern": pattern, "occurrences": len(occ), "from_history": n_hist}
        return Proposal(self.name, toks, parents, scores, conf, info=info)

    def _grow(self, occ: list[tuple[_Segment, int]], depth_cap: int):
        """Best-first tree over the occurrences' continuations, the likeliest chain first: ``(tokens, parents,
        scores, counts, chain length)`` or None. With ``tree=False`` each node grows only its likeliest child,
        so the proposal is that chain alone (the tree's first chain, less any cut ``max_nodes`` makes there)."""
        o = self.options
        vocab = self.vocab_size
        width = None if o.tree else 1
        heap: list = []
        counter = 0

        def expand(parent: int, depth: int, score: float, members: list) -> None:
            nonlocal counter
            groups = _continuations(members, vocab)
            total = len(members)
            for t, g in sorted(groups.items(), key=lambda kv: -len(kv[1]))[:width]:  # stable: recency among ties
                s = score * len(g) / total
                if s < o.min_prob or s <= 0.0:
                    break
                heapq.heappush(heap, (-s, counter, parent, t, depth, g))
                counter += 1

        expand(-1, 1, 1.0, [(seg.tokens, e + 1) for seg, e in occ])
        nodes: list[tuple[int, int, float, int]] = []  # (token, parent, score, count)
        first_child: dict[int, int] = {}
        while heap and len(nodes) < o.max_nodes:
            neg, _, parent, t, depth, g = heapq.heappop(heap)
            first_child.setdefault(parent, len(nodes))  # siblings pop best first: the first is the likeliest
            nodes.append((t, parent, -neg, len(g)))
            if depth < depth_cap:
                expand(len(nodes) - 1, depth + 1, -neg, g)
        if not nodes:
            return None
        chain = [first_child[-1]]
        while chain[-1] in first_child:
            chain.append(first_child[chain[-1]])
        on_chain = set(chain)
        order = chain + [i for i in range(len(nodes)) if i not in on_chain]
        where = {old: new for new, old in enumerate(order)}
        renumbered = ((t, where.get(p, -1), sc, c) for t, p, sc, c in (nodes[i] for i in order))
        toks, parents, scores, counts = zip(*renumbered)
        return toks, parents, scores, counts, len(chain)

    # -- reporting -----------------------------------------------------------------------------
    def index_size(self) -> dict:
        """Index entries and approximate bytes: the history's, the current request's, and in all."""
        h_entries, h_bytes = self.history.index_size()
        live = self.live
        l_entries, l_bytes = (0, 0) if live is None else (live.entries(), live.nbytes())
        return {"history_entries": h_entries, "history_bytes": h_bytes, "request_entries": l_entries,
                "request_bytes": l_bytes, "entries": h_entries + l_entries, "bytes": h_bytes + l_bytes}

    def stats(self) -> dict:
        size = self.index_size()
        return {"proposals": self.proposals, "history_proposals": self.history_proposals,
                "history_requests": len(self.history), "history_tokens": self.history.tokens,
                "index_entries": size["entries"], "index_mib": size["bytes"] / 2**20}


@hookimpl(trylast=True)
def goose_register_sources(register) -> None:
    register(SuffixSource)
