"""The draft tree as data, and the pure functions derived from it.

A tree is a parent-index array: node 0 is the root (the anchor: the last committed token, not yet in the
cache), ``parents[0] == -1`` and ``0 <= parents[i] < i``. Each node carries a token, an origin (its role in the
tree, or the source that drafted it), optionally the sources that proposed it, and a score.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
import torch

from goose.errors import InvalidTreeError

ROOT = "root"


@dataclass(frozen=True)
class DraftTree:
    """A validated draft tree. Build one with :meth:`build`, :meth:`from_chain` or :meth:`single`."""

    tokens: tuple[int, ...]  # [num_nodes] token id per node; tokens[0] is the anchor
    parents: tuple[int, ...]  # [num_nodes] parent index; parents[0] == -1
    origins: tuple[str, ...]  # [num_nodes] who drafted each node; origins[0] == "root"
    scores: tuple[float, ...] | None = None  # [num_nodes] optional drafter scores
    route: str = "tree"  # how the policy shaped it: "tree", "branched", "path", "single", ...
    meta: dict = field(default_factory=dict, compare=False, hash=False)
    # [num_nodes] names of the sources that proposed each node (root: ()); None: the origins say
    sources: tuple[tuple[str, ...], ...] | None = None

    def __post_init__(self) -> None:
        validate(self.tokens, self.parents, self.origins, self.scores, self.sources)
        if self.sources is not None:
            for i, s in enumerate(self.sources):
                if not (isinstance(s, tuple) and (s or i == 0) and all(type(x) is str and x for x in s)
                        and len(set(s)) == len(s)):
                    _bad_sources(i, s)

    def credited(self, i: int) -> tuple[str, ...]:
        """The sources credited with node ``i``: its ``sources`` where recorded, else its origin."""
        if self.sources is not None and self.sources[i]:
            return self.sources[i]
        return (self.origins[i],)

    def label(self, i: int) -> str:
        """``origin:source+source`` (e.g. ``spine:pld+suffix``, ``branch:tr``), or the origin alone."""
        if self.sources is not None and self.sources[i]:
            return f"{self.origins[i]}:{'+'.join(self.sources[i])}"
        return self.origins[i]

    def subtree(self, keep: Sequence[int]) -> DraftTree:
        """The tree of nodes ``keep`` (ascending, root first, each node's parent kept), renumbered."""
        remap = {old: new for new, old in enumerate(keep)}
        return DraftTree(
            tuple(self.tokens[i] for i in keep), tuple(-1 if i == 0 else remap[self.parents[i]] for i in keep),
            tuple(self.origins[i] for i in keep), None if self.scores is None else tuple(self.scores[i] for i in keep),
            self.route, dict(self.meta), None if self.sources is None else tuple(self.sources[i] for i in keep))

    @classmethod
    def build(cls, tokens: Sequence[int], parents: Sequence[int], origins: Sequence[str] | str,
              scores: Sequence[float] | None = None, route: str = "tree",
              sources: Sequence[Sequence[str]] | None = None, **meta) -> DraftTree:
        """A tree from plain sequences: integer ids become ints, scores floats, each node's ``sources`` a tuple;
        a single ``origins`` string labels every node but the root; ``meta`` is kept, unread, for the policy."""
        tokens = tuple(_node_id(i, t, "token") for i, t in enumerate(tokens))
        if isinstance(sources, (str, bytes)):
            raise InvalidTreeError(
                f"sources {sources!r} is not allowed: one entry per node, each a tuple of source names. "
                f"Hint: sources=[(), ({sources!r},), ...] (the root's (), then each drafted node's names)")
        if isinstance(origins, str):
            origins = (ROOT,) + (origins,) * (len(tokens) - 1)
        return cls(tokens, tuple(_node_id(i, p, "parent") for i, p in enumerate(parents)), tuple(origins),
                   None if scores is None else tuple(float(s) for s in scores), route, meta,
                   None if sources is None else tuple(_node_sources(i, s) for i, s in enumerate(sources)))

    @classmethod
    def single(cls, root: int) -> DraftTree:
        """The one-node tree: an ordinary decoding step."""
        return cls((int(root),), (-1,), (ROOT,), None, "single", {})

    @classmethod
    def from_chain(cls, root: int, chain: Sequence[int], origin: str, route: str = "path",
                   source: str | None = None) -> DraftTree:
        """A plain chain ``root -> chain[0] -> chain[1] -> ...`` (route "single" when empty); ``source``: the
        source that proposed it, credited with every node but the root."""
        n = len(chain)
        if source is not None and (type(source) is not str or not source):
            raise InvalidTreeError(
                f"from_chain: source {source!r} ({type(source).__name__}) is not allowed: the name of the source "
                "that proposed the chain, a non-empty str, or None. Hint: source=proposal.source")
        return cls((int(root), *(int(t) for t in chain)), tuple(range(-1, n)), (ROOT,) + (origin,) * n, None,
                   route if n else "single", {}, None if source is None else ((),) + ((source,),) * n)

    @classmethod
    def from_choices(cls, root: int, choices: Sequence[Sequence[int]], token_of, origin: str) -> DraftTree:
        """A tree from Medusa-style "choices", each a path of child ranks from the root (every prefix listed
        too); ``token_of(path)`` gives the token of the node ``path`` reaches."""
        index = {(): 0}
        tokens, parents = [int(root)], [-1]
        for choice in sorted((tuple(c) for c in choices), key=lambda c: (len(c), c)):
            if choice[:-1] not in index:
                raise InvalidTreeError(f"choice {choice} has no parent choice {choice[:-1]}; list every prefix")
            index[choice] = len(tokens)
            parents.append(index[choice[:-1]])
            tokens.append(int(token_of(choice)))
        return cls.build(tokens, parents, origin)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def num_nodes(self) -> int:
        return len(self.tokens)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        d = [0] * len(self.parents)
        for i in range(1, len(self.parents)):
            d[i] = d[self.parents[i]] + 1
        return tuple(d)

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        ch: list[list[int]] = [[] for _ in self.parents]
        for i in range(1, len(self.parents)):
            ch[self.parents[i]].append(i)
        return tuple(tuple(c) for c in ch)

    @cached_property
    def is_chain(self) -> bool:
        return all(p == i - 1 for i, p in enumerate(self.parents))

    @cached_property
    def ancestor_mask(self) -> np.ndarray:
        """``[n, n]`` bool: ``mask[i, j]`` is True when j is i or an ancestor of i."""
        return ancestor_mask(self.parents)

    def position_ids(self, past_len: int, device=None) -> torch.Tensor:
        """``[1, n]`` position ids: ``past_len + depth``."""
        return torch.tensor([[past_len + d for d in self.depths]], dtype=torch.long, device=device)

    def attention_mask(self, past_len: int, dtype=torch.float32, device=None) -> torch.Tensor:
        """``[1, 1, n, past_len + n]`` additive mask: 0 where a node may attend, dtype-min elsewhere."""
        return additive_mask(self.ancestor_mask, past_len, dtype, device)

    @cached_property
    def paths(self) -> tuple[tuple[int, ...], ...]:
        """Root-to-leaf node-index paths, in node order of the leaves."""
        anc = self.ancestor_mask  # a node's ancestors in index order are its root-to-node path
        return tuple(tuple(np.flatnonzero(anc[leaf]).tolist()) for leaf, ch in enumerate(self.children) if not ch)


def validate(tokens, parents, origins, scores=None, sources=None) -> None:
    """Reject a malformed tree, naming the node index and the offending value."""
    n = len(tokens)
    if n == 0:
        raise InvalidTreeError("a draft tree needs at least the root node (got 0 nodes)")
    for name, per_node in (("parents", parents), ("origins", origins), ("scores", scores), ("sources", sources)):
        if per_node is not None and len(per_node) != n:
            raise InvalidTreeError(f"{name} has {len(per_node)} entries but tokens has {n}; they must match")
    if parents[0] != -1:
        raise InvalidTreeError(f"node 0 is the root: parents[0] must be -1, got {parents[0]}")
    seen: dict[tuple[int, int], int] = {}
    for i in range(n):
        t = tokens[i]
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool) or t < 0:
            raise InvalidTreeError(f"node {i}: token must be a non-negative int, got {t!r}")
        if not isinstance(origins[i], str) or not origins[i]:
            raise InvalidTreeError(f"node {i}: origin must be a non-empty str, got {origins[i]!r}")
        if i == 0:
            continue
        p = parents[i]
        if not isinstance(p, (int, np.integer)) or not (0 <= p < i):
            raise InvalidTreeError(
                f"node {i}: parent must satisfy 0 <= parent < {i} (parents come before children), got {p!r}")
        if (p, t) in seen:
            raise InvalidTreeError(
                f"node {i}: token {t} repeats its sibling node {seen[p, t]} under parent {p}; "
                "siblings must propose distinct tokens (deduplicate in the tree policy)")
        seen[p, t] = i


def ancestor_mask(parents: Sequence[int]) -> np.ndarray:
    """``[n, n]`` bool: ``mask[i, j]`` is True when j is i or an ancestor of i."""
    n = len(parents)
    m = np.zeros((n, n), dtype=bool)
    for i in range(n):
        p = parents[i]
        if p >= 0:
            m[i, : p + 1] = m[p, : p + 1]
        m[i, i] = True
    return m


def additive_mask(anc: np.ndarray, past_len: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """``[1, 1, n, past_len + n]``: 0 over the past and where ``anc`` is True, dtype-min elsewhere."""
    n = anc.shape[0]
    mask = torch.full((1, 1, n, past_len + n), torch.finfo(dtype).min, dtype=dtype, device=device)
    if past_len:
        mask[..., :past_len] = 0
    mask[0, 0, :, past_len:].masked_fill_(torch.from_numpy(anc).to(device), 0.0)
    return mask


def _node_sources(i: int, s) -> tuple[str, ...]:
    """Node ``i``'s ``sources`` entry as a tuple: a tuple or list as is, a frozenset of names sorted; anything
    else (a bare string would iterate as its characters) is an error."""
    if isinstance(s, tuple):
        return s
    if isinstance(s, list):
        return tuple(s)
    if isinstance(s, frozenset) and all(type(x) is str for x in s):
        return tuple(sorted(s))
    _bad_sources(i, s)


def _bad_sources(i: int, s) -> None:
    """Refuse node ``i``'s ``sources`` entry ``s``, saying what is allowed."""
    if isinstance(s, str):
        what = f"a bare string, {s!r}, would credit each of its characters"
        hint = f"sources=[(), ({s!r},), ...]: one tuple of names per node"
    elif i and isinstance(s, (tuple, list, frozenset)) and not s:
        what = "an empty entry credits no source with a drafted node"
        hint = "name the source(s) that proposed it, e.g. ('pld',), or leave sources=None for the whole tree"
    elif isinstance(s, (tuple, list, frozenset)) and all(type(x) is str and x for x in s):
        what = "a source is named twice"
        hint = "name each source once"
    else:
        what = "every name must be a non-empty str" if isinstance(s, (tuple, list, frozenset)) else (
            f"a {type(s).__name__} is not a collection of names")
        hint = "sources=[(), ('pld',), ('pld', 'tr'), ...]: the root's () then each drafted node's source names"
    raise InvalidTreeError(f"node {i}: sources {s!r} is not allowed ({what}): a tuple, list or frozenset of source "
                           f"names, non-empty for every drafted node (the root's is ()). Hint: {hint}")


def _node_id(i: int, v, what: str) -> int:
    """An integer id (a Python or numpy integer) as an int; a float, bool or anything else is an error."""
    if isinstance(v, numbers.Integral) and not isinstance(v, bool):
        return int(v)
    raise InvalidTreeError(f"node {i}: {what} {v!r} ({type(v).__name__}) is not an integer id. Hint: build trees "
                           "from the int ids sources propose (int(t) for a tensor element)")
