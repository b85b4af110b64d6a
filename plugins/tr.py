"""Token recycling: an adjacency table of the successors the target itself predicted (docs/algorithm.md, section 5).

The source ``tr`` keeps, per token and per (previous token, token) pair (option ``bigram``, consulted first), the
top-K tokens the target ranked highest after it in any forward pass (the prefill, every node of a draft tree,
accepted or not), and serves them through :meth:`DraftSource.successors`. ``propose`` returns None: use it with a
tree policy (``spine``, ``iso3``, ``tr-tree``); with ``chain`` or ``proposal`` alone every step is an ordinary
one. The per-token tier is also ``[vocab, K]`` tensors (:attr:`TokenTable.ids`, -1 where unknown;
:attr:`TokenTable.scores`, the softmax over those K logits, 0 where unknown).

The harvest after each pass is vectorised: one top-k (:func:`topk_rows`), one softmax, one indexed write per
tensor. The rows are also kept as Python lists keyed by token, so that :meth:`TRSource.successors` (called tens
of times per step by a tree policy) is a dict lookup rather than a tensor read and a ``tolist``. The paper's
ablations and the original Token Recycling are options and the preset ``tr-original`` (docs/options.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from pydantic import Field

from goose.hookspecs import hookimpl
from goose.interfaces import DraftSource, Options, Request, Verified

_EMPTY: tuple[tuple[int, ...], tuple[float, ...]] = ((), ())


class TROptions(Options):
    k: int = Field(10, ge=1, le=256, description="successors kept per token (top-K of the target's logits)",
        json_schema_extra={"why": "branch width against the table's memory (vocabulary x k); the original TR uses 8"},
    )
    bigram: bool = Field(
        True, description="keep a (previous token, token) tier, consulted before the per-token row",
        json_schema_extra={"why": "off: the ablation without the pair tier (preset spine-nobigram); saves memory"},
    )
    prefill_harvest: bool = Field(
        True, description="seed the table from the prompt's prefill logits (off: decoding passes only)",
        json_schema_extra={"why": "off: the ablation without the prompt's rows (preset spine-noprefill)"},
    )
    prefill_window: int | None = Field(
        256, ge=1, description="harvest only the last this many prompt positions (the prefill then computes "
        "that many logit rows instead of prompt_len x vocab); None: every position, as in the reference",
        json_schema_extra={"why": "memory and time of long prompts (None: every prompt position, as the reference)"},
    )
    prefill_max_mib: float = Field(
        64.0, gt=0.0, description="and at most as many positions as fit this many MiB of float32 logits (a "
        "151,936-token vocabulary: 110 rows); the prompt_len x vocab matrix of a long prompt outgrows the model",
        json_schema_extra={"why": "memory cap on the prefill's logit rows for large vocabularies"},
    )
    warm: bool = Field(
        False, description="keep the table across generate() calls of one decoder (off: a new table per "
        "request, as in the GOOSE reference; the original Token Recycling keeps it)",
        json_schema_extra={"why": "keep the table across requests (the original TR; preset spine-warm)"},
    )
    min_score: float = Field(
        0.0, ge=0.0, lt=1.0, description="successors() drops entries scoring below this (tree policies apply "
        "their own threshold too; 0 keeps all K)",
        json_schema_extra={"why": "drop weak successors where branches are costly"},
    )


class TokenTable:
    """The adjacency table: unigram tensors plus their list mirror, and the bigram dict."""

    __slots__ = ("vocab_size", "k", "ids", "scores", "rows", "bigram")

    def __init__(self, vocab_size: int, k: int):
        self.vocab_size = vocab_size
        self.k = k
        self.ids = torch.full((vocab_size, k), -1, dtype=torch.long)  # [vocab, K] successor ids
        self.scores = torch.zeros((vocab_size, k), dtype=torch.float32)  # [vocab, K] softmax over the K
        self.rows: dict[int, tuple[list[int], list[float]]] = {}  # token -> unigram row (no -1)
        self.bigram: dict[tuple[int, int], tuple[list[int], list[float]]] = {}

    def harvest(self, tokens: Sequence[int], preds: Sequence[int], logits: torch.Tensor, bigram: bool) -> None:
        """Write the top-K of each position's logits into the rows of its token (and bigram)."""
        n = len(tokens)
        if n == 0:
            return
        # A later position of the same token (or (previous, token) pair) overwrites an earlier one's row, so
        # only the last position of each is read: the table ends the same (and an indexed write with repeated
        # indices would leave the winner unspecified).
        last = {t: i for i, t in enumerate(tokens)}  # token -> last position holding it
        last_pair = {(p, tokens[i]): i for i, p in enumerate(preds[:n]) if p >= 0} if bigram else {}
        read = sorted(set(last.values()).union(last_pair.values()))
        at = {i: j for j, i in enumerate(read)}  # position -> its row among those read
        k = min(self.k, self.vocab_size)
        x = logits[:n, : self.vocab_size]
        if len(read) < n:
            x = x.index_select(0, torch.tensor(read, dtype=torch.long, device=x.device))
        if x.dtype in (torch.bfloat16, torch.float16):
            x = x.float()  # topk on 16-bit logits is slower on CPU than upcasting first
        vals, idx = topk_rows(x, k)  # [rows read, k]
        probs = torch.softmax(vals.float(), dim=-1)
        probs = torch.nan_to_num(probs, nan=0.0, posinf=1.0, neginf=0.0)
        idx_l = idx.tolist()
        prob_l = probs.tolist()
        for t, i in last.items():
            self.rows[t] = (idx_l[at[i]], prob_l[at[i]])
        for pair, i in last_pair.items():
            self.bigram[pair] = (idx_l[at[i]], prob_l[at[i]])
        keep = torch.tensor([at[i] for i in last.values()], dtype=torch.long)
        dest = torch.tensor(list(last.keys()), dtype=torch.long)
        self.ids[dest, :k] = idx.index_select(0, keep.to(idx.device)).cpu()
        self.scores[dest, :k] = probs.index_select(0, keep.to(probs.device)).cpu()


def topk_rows(x: torch.Tensor, k: int, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``torch.topk(x, k, dim=-1)`` of a ``[n, vocab]`` matrix in two passes: the maximum of each block of
    ``block`` columns, then the exact top-k among the columns of the k best blocks (and the tail that
    fills no block). The row's k largest values lie in those blocks (a value outside them is exceeded by
    k block maxima), so values are topk's; among equal values the indices may differ. The first pass is
    one vectorised reduction over the row, cheaper than ``topk`` on a large vocabulary; with fewer than
    ``4 k`` blocks this is plain ``topk``."""
    n, vocab = x.shape
    nb = vocab // block
    if nb < 4 * k:
        return torch.topk(x, k, dim=-1)
    main = nb * block
    best = torch.topk(x[:, :main].reshape(n, nb, block).amax(-1), k, dim=-1).indices  # [n, k] blocks
    cols = (best.unsqueeze(-1) * block + torch.arange(block, device=x.device)).reshape(n, k * block)
    if main < vocab:
        cols = torch.cat([cols, torch.arange(main, vocab, device=x.device).expand(n, vocab - main)], dim=1)
    vals, pos = torch.topk(x.gather(1, cols), k, dim=-1)
    return vals, cols.gather(1, pos)


class TRSource(DraftSource):
    """Token recycling: top-K successors the target predicted, with a bigram tier (successors only)."""

    name = "tr"
    Options = TROptions
    provides_successors = True

    def __init__(self, options: TROptions | None = None):
        super().__init__(options)
        self.table: TokenTable | None = None
        self._reset_counters()

    def _reset_counters(self) -> None:
        self.lookups = 0
        self.bigram_hits = 0
        self.harvested = 0

    def begin(self, request: Request) -> None:
        o = self.options
        t = self.table
        if not o.warm or t is None or t.vocab_size != request.vocab_size:
            self.table = TokenTable(request.vocab_size, o.k)
        self._reset_counters()

    def prefill_positions(self, prompt_len: int) -> int:
        o = self.options
        if not o.prefill_harvest:
            return 0
        if o.prefill_window is None:
            return prompt_len
        vocab = self.table.vocab_size if self.table is not None else 1
        rows = int(o.prefill_max_mib * 2**20 // (4 * max(1, vocab)))
        return max(1, min(prompt_len, o.prefill_window, rows))

    def observe(self, verified: Verified) -> None:
        o = self.options
        if verified.kind == "prefill" and not o.prefill_harvest:
            return
        if self.table is None:  # used without begin(): size the table from the logits
            self.table = TokenTable(int(verified.logits.shape[-1]), o.k)
        tokens = verified.tokens.tolist()
        preds = verified.predecessors.tolist() if o.bigram else ()
        self.table.harvest(tokens, preds, verified.logits, o.bigram)
        self.harvested += len(tokens)

    def successors(self, token: int, prev: int | None) -> tuple[Sequence[int], Sequence[float]]:
        t = self.table
        if t is None:
            return _EMPTY
        self.lookups += 1
        row = t.bigram.get((prev, token)) if prev is not None and self.options.bigram else None
        if row is not None:
            self.bigram_hits += 1
        else:
            row = t.rows.get(token)
            if row is None:
                return _EMPTY
        floor = self.options.min_score
        if floor > 0.0:
            ids, scores = row
            n = 0
            while n < len(scores) and scores[n] >= floor:
                n += 1
            return ids[:n], scores[:n]
        return row

    def stats(self) -> dict:
        t = self.table
        return {"harvested_positions": self.harvested, "lookups": self.lookups,
                "bigram_hit_rate": self.bigram_hits / self.lookups if self.lookups else 0.0,
                "tokens_known": len(t.rows) if t is not None else 0,
                "bigram_entries": len(t.bigram) if t is not None else 0}


@hookimpl(trylast=True)
def goose_register_sources(register) -> None:
    register(TRSource)
    register(TRSource, name="tr-original", defaults={"k": 8, "bigram": False, "warm": True},
             description="Token Recycling as published: K = 8, no bigram tier, table kept across requests")
