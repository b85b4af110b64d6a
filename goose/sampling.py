"""Choosing the committed tokens as transformers' decoding loop does: processors, then argmax or a draw.

A :class:`TokenRule` turns one row of raw logits into the next token as ``GenerationMixin._sample`` does, and
:func:`rule_walk` draws at the visited tree nodes only, so that under one seed the output is transformers' own
(docs/concepts.md explains the walk, :class:`FastTopP`, :class:`NoiseTape` and the numpy fills).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from goose.errors import InvalidInputError


@dataclass(frozen=True)
class Sampling:
    """Per-call decoding parameters, validated (see ``Decoder.generate``)."""

    do_sample: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int = 0

    def __post_init__(self):
        def bad(name, value, allowed, hint):
            raise InvalidInputError(f"{name}={value!r} is not allowed: {allowed}. Hint: {hint}")

        def num(x, kind=(int, float)) -> bool:
            return isinstance(x, kind) and not isinstance(x, bool)

        t, k, p, m, r, n = (self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty,
                            self.min_new_tokens)
        if t is not None and (not num(t) or t < 0):
            bad("temperature", t, "a number >= 0", "temperature=0.7, or do_sample=False for greedy")
        if self.do_sample and t is not None and t == 0:
            bad("temperature", t, "> 0 when do_sample=True (0 is greedy decoding)",
                "do_sample=False, or temperature=0.7")
        if k is not None and (not num(k, int) or k < 0):
            bad("top_k", k, "an int >= 0 (0: off)", "top_k=50")
        if p is not None and (not num(p) or not 0.0 < p <= 1.0):
            bad("top_p", p, "a number in (0, 1]", "top_p=0.9")
        if m is not None and (not num(m) or not 0.0 <= m <= 1.0):
            bad("min_p", m, "a number in [0, 1]", "min_p=0.05")
        if r is not None and (not num(r) or r <= 0):
            bad("repetition_penalty", r, "a number > 0 (1: off)", "repetition_penalty=1.1")
        if not num(n, int) or n < 0:
            bad("min_new_tokens", n, "an int >= 0", "min_new_tokens=8")


def build_processors(s: Sampling, prompt_len: int, eos_ids: Sequence[int]):
    """The processors transformers' ``generate`` would build for these parameters, in its order."""
    from transformers import (LogitsProcessorList, MinNewTokensLengthLogitsProcessor, MinPLogitsWarper,
                              RepetitionPenaltyLogitsProcessor, TemperatureLogitsWarper, TopKLogitsWarper,
                              TopPLogitsWarper)

    procs = LogitsProcessorList()
    if s.repetition_penalty is not None and s.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(penalty=float(s.repetition_penalty)))
    if s.min_new_tokens > 0 and eos_ids:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, s.min_new_tokens, list(eos_ids)))
    if s.do_sample:
        if s.temperature is not None and s.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(float(s.temperature)))
        if s.top_k is not None and s.top_k != 0:
            procs.append(TopKLogitsWarper(top_k=int(s.top_k), min_tokens_to_keep=1))
        if s.top_p is not None and s.top_p < 1.0:
            procs.append(TopPLogitsWarper(top_p=float(s.top_p), min_tokens_to_keep=1))
        if s.min_p is not None:
            procs.append(MinPLogitsWarper(min_p=float(s.min_p), min_tokens_to_keep=1))
    return procs


class FastTopP:
    """transformers' ``TopPLogitsWarper`` for one CPU row, bit for bit, from a value sort: the removed entries are
    ``scores < v``, ``v`` the first kept value. Where that could fail (a tie across the cut, NaN, a batch, a
    non-CPU or non-float32 tensor, another filter value, too few finite scores) the stock warper runs."""

    def __init__(self, stock):
        self.stock = stock
        self.top_p = float(stock.top_p)
        self.min_keep = int(stock.min_tokens_to_keep)
        self.fallbacks = 0

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if (scores.dim() != 2 or scores.shape[0] != 1 or scores.device.type != "cpu" or scores.dtype != torch.float32
                or self.stock.filter_value != -float("inf")):
            return self.stock(input_ids, scores)
        sv = _sorted_values(scores.detach().numpy()[0])  # ascending; NaN last
        n = sv.shape[0]
        if np.isnan(sv[-1]) or n < self.min_keep or not np.isfinite(sv[n - self.min_keep]):
            self.fallbacks += 1
            return self.stock(input_ids, scores)
        ordered = torch.from_numpy(sv).view(1, n)
        cum = ordered.softmax(dim=-1).cumsum(dim=-1)
        cut = int((cum[0] <= (1 - self.top_p)).sum())  # length of the removed prefix
        cut = min(cut, n - self.min_keep)
        if cut == 0:
            return scores.clone()
        if sv[cut - 1] == sv[cut]:  # a tie across the cut: which index goes depends on torch's sort
            self.fallbacks += 1
            return self.stock(input_ids, scores)
        return scores.masked_fill(scores < float(sv[cut]), -float("inf"))


def _sorted_values(x: np.ndarray) -> np.ndarray:
    """``np.sort(x)``; after a top-k filter most entries are -inf, and only the rest is sorted."""
    keep = x != -np.inf  # NaN and +inf are kept: the sort puts them last, as np.sort does
    m = int(np.count_nonzero(keep))
    if 4 * m >= x.shape[0]:
        return np.sort(x)
    out = np.full(x.shape[0], -np.inf, dtype=x.dtype)
    out[x.shape[0] - m :] = np.sort(x[keep])
    return out


def _two_args(processor) -> bool:
    """Whether ``LogitsProcessorList`` would call ``processor(input_ids, scores)`` with nothing more."""
    try:
        return len(inspect.signature(processor.__call__).parameters) <= 2
    except (TypeError, ValueError):
        return False


def _probe_gumbel() -> bool:
    """Whether ``torch.multinomial(p, 1)`` is ``argmax(p / q)`` with ``q = empty_like(p).exponential_()`` here,
    token and generator state both (:class:`NoiseTape`'s premise; where it fails, the rule uses ``multinomial``)."""
    g1, g2 = torch.Generator().manual_seed(20261201), torch.Generator().manual_seed(20261201)
    probe = torch.Generator().manual_seed(7)
    for n in (5, 4099, 49152):
        p = torch.rand((1, n), generator=probe) ** 8
        p[0, : n // 3] = 0.0
        p = p / p.sum()
        for _ in range(3):
            a = int(torch.multinomial(p, num_samples=1, generator=g1)[0, 0])
            q = torch.empty_like(p).exponential_(generator=g2)
            if a != int(torch.argmax(p / q)):
                return False
        if not torch.equal(g1.get_state(), g2.get_state()):
            return False
    return True


_GUMBEL: list[bool] = []
_PROBE_LOCK = threading.Lock()


def _memo(store: list[bool], probe: Callable[[], bool]) -> bool:
    """``probe()`` once per process, kept in ``store`` (tests set ``store[:] = [False]`` to turn a path off)."""
    if not store:
        with _PROBE_LOCK:
            if not store:
                store.append(probe())
    return store[0]


def gumbel_draws_match() -> bool:
    """:func:`_probe_gumbel`, once per process."""
    return _memo(_GUMBEL, _probe_gumbel)


_MASK53 = np.uint64((1 << 53) - 1)
_TWO_M53 = 2.0**-53


def _numpy_mt(state: torch.Tensor):
    """numpy's ``MT19937`` at the point of torch's CPU generator ``state`` (the same engine)."""
    buf = state.numpy()
    left = int(buf[8:12].view(np.int32)[0])
    nxt = int(buf[16:24].view(np.uint64)[0])
    key = buf[24 : 24 + 624 * 8].view(np.uint64).astype(np.uint32)
    bg = np.random.MT19937()
    # torch reads word `next` unless `left` says the block is spent (then it twists first)
    bg.state = {"bit_generator": "MT19937", "state": {"key": key, "pos": 624 if left == 1 else nxt}}
    return bg


def _torch_state(bg, like: torch.Tensor) -> torch.Tensor:
    """torch's generator state for numpy ``bg``'s engine, the other fields as in ``like``."""
    st = bg.state["state"]
    pos = int(st["pos"])
    out = like.clone()
    buf = out.numpy()
    buf[8:12].view(np.int32)[0] = 625 - pos
    buf[16:24].view(np.uint64)[0] = pos
    buf[24 : 24 + 624 * 8].view(np.uint64)[:] = st["key"]
    return out


class _Fill:
    """One token's exponential fill, kept as the generator's raw words until values are read: per element one
    64-bit word (two mt19937 outputs, high then low), ``u`` its low 53 bits, value ``float32(-log1p(-u))``."""

    __slots__ = ("raw", "q")

    def __init__(self, raw: np.ndarray | None = None, q: torch.Tensor | None = None):
        self.raw = raw  # uint64 words, two per element (None: q given)
        self.q = q  # the [1, vocab] float32 fill, once materialised

    def _u(self, idx=None) -> np.ndarray:
        hi, lo = self.raw[0::2], self.raw[1::2]
        if idx is not None:
            hi, lo = hi[idx], lo[idx]
        return (((hi << np.uint64(32)) | lo) & _MASK53).astype(np.float64) * _TWO_M53

    def at(self, idx) -> np.ndarray:
        """float32 values of the fill at these element indices."""
        if self.q is not None:
            return self.q.numpy()[0, idx]
        return (-np.log1p(-self._u(np.asarray(idx, dtype=np.int64)))).astype(np.float32)

    def tensor(self) -> torch.Tensor:
        if self.q is None:
            self.q = torch.from_numpy((-np.log1p(-self._u())).astype(np.float32)).view(1, -1)
        return self.q

    def has_zero(self) -> bool:
        """Whether some element is exactly 0 (u == 0: once in 2**53 draws), where p / q is not finite."""
        if self.q is not None:
            return bool((self.q == 0).any())
        lo = self.raw[1::2]
        if not (lo == 0).any():
            return False
        return bool((self._u() == 0.0).any())


def _probe_raw_fills() -> bool:
    """Whether :class:`_Fill` from numpy's engine equals torch's ``exponential_`` here, values and generator
    state: a fresh seed (the block not yet twisted), mid-block after other draws, several vocabulary sizes."""
    try:
        for seed, n, pre in ((3, 5, 0), (11, 4099, 7), (20261201, 49152, 1000), (5, 1, 3)):
            g, h = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
            if pre:
                torch.rand(pre, generator=g)
                torch.rand(pre, generator=h)
            for _ in range(3):
                want = torch.empty((1, n)).exponential_(generator=g)
                st = h.get_state()
                bg = _numpy_mt(st)
                fill = _Fill(bg.random_raw(2 * n))
                h.set_state(_torch_state(bg, st))
                if not torch.equal(fill.tensor(), want) or not torch.equal(g.get_state(), h.get_state()):
                    return False
                if not np.array_equal(_Fill(fill.raw).at([0, n - 1]), want.numpy()[0, [0, n - 1]]):
                    return False
    except (ValueError, TypeError, KeyError, RuntimeError, IndexError):
        return False
    return True


_RAW_FILLS: list[bool] = []


def raw_fills_match() -> bool:
    """:func:`_probe_raw_fills`, once per process."""
    return _memo(_RAW_FILLS, _probe_raw_fills)


class NoiseTape:
    """The exponential noise of each generated token's draw, drawn ahead from the request's generator, once per
    token; the state before each fill is kept, so that :meth:`finish` leaves the generator as transformers would."""

    def __init__(self, generator: torch.Generator | None, vocab: int):
        self.gen = generator if generator is not None else torch.default_generator
        self.vocab = vocab
        self.base = 0  # index of the first kept fill
        self.fills: list[_Fill] = []  # fills[i]: q of token base + i
        self.states: list[torch.Tensor] = []  # states[i]: generator state before fills[i]
        self.used = 0  # tokens whose draw has been made (their fills are spent)
        self.last: torch.Tensor | None = None
        self.raw = self.gen.device.type == "cpu" and raw_fills_match()  # fills from numpy's engine (see _Fill)

    def _fill(self, j: int) -> _Fill:
        """The fill of generated token j (0-based), drawing every fill up to it first."""
        if self.base + len(self.fills) <= j:
            while self.base + len(self.fills) <= j:
                st = self.gen.get_state()
                self.states.append(st)
                if self.raw:
                    bg = _numpy_mt(st)
                    fill = _Fill(bg.random_raw(2 * self.vocab))
                    self.gen.set_state(_torch_state(bg, st))
                else:
                    fill = _Fill(q=torch.empty((1, self.vocab), dtype=torch.float32).exponential_(generator=self.gen))
                self.fills.append(fill)
            self.last = self.gen.get_state()  # where the tape left the generator
        return self.fills[j - self.base]

    def noise(self, j: int) -> torch.Tensor:
        """q of generated token j (0-based) as a [1, vocab] float32 tensor, drawing every fill up to it first."""
        return self._fill(j).tensor()

    def noise_at(self, j: int, ids) -> np.ndarray:
        """q of generated token j at the token ids ``ids`` (float32)."""
        return self._fill(j).at(ids)

    def draw(self, j: int, probs: torch.Tensor) -> int:
        """Token j's draw from ``probs`` ([1, vocab], checked as multinomial checks it): ``argmax(probs / q)``,
        taken over the nonzero probabilities only (elsewhere the ratio is 0), unless some q is exactly 0."""
        f = self._fill(j)
        if f.q is None and not f.has_zero():
            p = probs.numpy()[0]
            idx = np.flatnonzero(p)  # ascending: ties go to the first, as torch.argmax's do
            if idx.size:
                return int(idx[int(np.argmax(p[idx] / f.at(idx)))])
        return int(torch.argmax(probs / f.tensor()))

    def spend(self, j: int) -> None:
        """Token j's draw is made: its fill and those before it are spent."""
        self.used = max(self.used, j + 1)

    def release(self, upto: int) -> None:
        """Forget the fills of tokens before ``upto`` (committed: never read again)."""
        drop = min(max(0, upto - self.base), len(self.fills))
        if drop:
            del self.fills[:drop], self.states[:drop]
            self.base += drop

    def finish(self) -> None:
        """Rewind the generator to just after the spent fills (drawn-ahead ones are undone), but only when
        nothing else drew from it since the tape's last fill, so that another user of a shared generator keeps
        its draws and no fill is handed out twice (such sharing is not seed-reproducible, as in transformers)."""
        i = self.used - self.base
        if 0 <= i < len(self.states) and self.last is not None and torch.equal(self.gen.get_state(), self.last):
            self.gen.set_state(self.states[i])
        self.fills.clear()
        self.states.clear()
        self.base = self.used


class NoiseView:
    """One step's view of the noise tape: successors ranked by ``score ** (1 / T) / q``, the draw's pick were the
    scores the target's distribution. Only the order of drafts changes, never how they are verified."""

    __slots__ = ("tape", "base", "inv_t", "max_depth")

    def __init__(self, tape: NoiseTape, base: int, temperature: float | None, max_depth: int):
        self.tape = tape
        self.base = base  # index of the token at depth 1
        self.inv_t = 1.0 / float(temperature) if temperature else 1.0
        self.max_depth = max_depth  # deepest depth whose noise is read (each new fill costs a vocabulary of draws)

    def rank(self, ids: Sequence[int], scores: Sequence[float], depth: int):
        """``(ids, scores)`` reordered by the draw at ``depth`` (as given where its noise is not read)."""
        if not 1 <= depth <= self.max_depth or len(ids) < 2:
            return ids, scores
        q = self.tape.noise_at(self.base + depth - 1, list(ids)).tolist()
        it = self.inv_t
        keys = [(s**it if s > 0.0 else 0.0) / max(qt, 1e-30) for qt, s in zip(q, scores)]
        total = sum(keys)
        if not total > 0.0:
            return ids, scores
        order = sorted(range(len(keys)), key=keys.__getitem__, reverse=True)
        return [ids[i] for i in order], [keys[i] / total for i in order]


class TokenRule:
    """One request's token choice: the committed sequence, processors, draw, and when to stop."""

    def __init__(self, prompt_ids: Sequence[int], max_new_tokens: int, capacity: int, processors=None,
                 do_sample: bool = False, generator: torch.Generator | None = None,
                 stop_ids: frozenset[int] = frozenset(), stopping_criteria=None, record: bool = False,
                 temperature: float | None = None):
        self.processors = None
        if processors is not None and len(processors):
            from transformers import LogitsProcessorList, TopPLogitsWarper

            # a plain TopPLogitsWarper is served by FastTopP (same output)
            self.processors = LogitsProcessorList(FastTopP(p) if type(p) is TopPLogitsWarper else p for p in processors)
        # LogitsProcessorList.__call__ inspects each processor's signature per call; processors that take
        # (input_ids, scores) only are called directly, in the same order (None: through the list)
        procs = self.processors or ()
        self._chain = tuple(procs) if all(_two_args(p) for p in procs) else None
        self.do_sample = do_sample
        self.generator = generator
        self.stop_ids = stop_ids
        self.criteria = stopping_criteria if stopping_criteria is not None and len(stopping_criteria) else None
        self.max_new = max_new_tokens
        n = len(prompt_ids)
        self.buf = torch.zeros((1, n + capacity + 1), dtype=torch.long)
        self.buf[0, :n] = torch.as_tensor(list(prompt_ids), dtype=torch.long)
        self.n = n  # committed length (prompt + committed tokens)
        self.generated = 0
        self.stopped: str | None = None  # "stop_token", "criteria", "max_new_tokens"
        self.record = record
        self.scores: list[torch.Tensor] = []  # processed scores of every committed token (record=True)
        self.raw: list[torch.Tensor] = []  # raw float32 logits of every committed token (record=True)
        self.draws = 0
        self.kind = "sample" if do_sample else "processed"
        self.tape: NoiseTape | None = None  # made at the first CPU float32 draw (see NoiseTape)
        self.temperature = temperature
        self._tape_ok = do_sample and (generator is None or generator.device.type == "cpu")

    def choose(self, row: torch.Tensor, before: Sequence[int]) -> int:
        """The token after the committed sequence + ``before`` (this step's tokens so far), from its raw row."""
        if self.buf.device != row.device:  # processors take input_ids on the logits' device
            self.buf = self.buf.to(row.device)
        k = self._put(before)
        logits = row.to(dtype=torch.float32).view(1, -1).clone()
        ids, scores = self.buf[:, : self.n + k], logits
        if self._chain is None:
            scores = self.processors(ids, logits)
        else:
            for p in self._chain:
                scores = p(ids, scores)
        if self.do_sample:
            probs = torch.softmax(scores, dim=-1)
            tape = self.noise_tape(probs)
            if tape is None:
                tok = int(torch.multinomial(probs, num_samples=1, generator=self.generator)[0, 0])
            else:
                # multinomial's own checks (in one pass: with no entry < 0 or inf, sum > 0 iff max > 0),
                # then its draw with the fill drawn ahead for this token
                lo, hi = (float(v) for v in torch.aminmax(probs))
                if not (hi < float("inf") and lo >= 0):  # NaN fails both
                    raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
                if not hi > 0:
                    raise RuntimeError("invalid multinomial distribution (sum of probabilities <= 0)")
                j = self.generated + k
                tok = tape.draw(j, probs)
                tape.spend(j)
            self.draws += 1
        else:
            tok = int(scores.argmax(dim=-1)[0])
        if self.record:
            self.scores.append(scores)
            self.raw.append(logits)
        return tok

    def noise_tape(self, probs: torch.Tensor | None = None) -> NoiseTape | None:
        """The request's noise tape, made at its first draw; None where draws go through ``multinomial``."""
        if self.tape is None and self._tape_ok and probs is not None:
            if (probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2
                    and probs.shape[0] == 1 and gumbel_draws_match()):
                self.tape = NoiseTape(self.generator, int(probs.shape[1]))
            else:
                self._tape_ok = False
        return self.tape

    def noise_view(self, max_depth: int = 16) -> NoiseView | None:
        """This step's noise for drafting (None when not sampling through the tape)."""
        t = self.tape
        return None if t is None else NoiseView(t, self.generated, self.temperature, max_depth)

    def finish(self) -> None:
        """The request is over: leave the generator as transformers' loop would."""
        if self.tape is not None:
            self.tape.finish()

    def ends(self, step_tokens: Sequence[int]) -> bool:
        """Whether the generation ends with the last of this step's tokens (sets ``stopped``)."""
        if step_tokens[-1] in self.stop_ids:
            self.stopped = "stop_token"
            return True
        if self.generated + len(step_tokens) >= self.max_new:
            self.stopped = "max_new_tokens"
            return True
        if self.criteria is not None:
            k = self._put(step_tokens)
            # transformers hands the criteria its scores only when asked to keep them; none need them
            if bool(self.criteria(self.buf[:, : self.n + k], None).any()):
                self.stopped = "criteria"
                return True
        return False

    def _put(self, tokens: Sequence[int]) -> int:
        """Write ``tokens`` after the committed sequence, uncommitted; their count."""
        k = len(tokens)
        if k:
            self.buf[0, self.n : self.n + k] = torch.as_tensor(list(tokens), dtype=torch.long)
        return k

    def commit(self, tokens: Sequence[int]) -> None:
        """Append this step's committed ``tokens``; their fills are released."""
        k = self._put(tokens)
        self.n += k
        self.generated += k
        if self.tape is not None:
            self.tape.release(self.generated)


def rule_walk(tree, logits: torch.Tensor, rule: TokenRule,
              choose: Callable | None = None) -> tuple[tuple[int, ...], tuple[int, ...], int | None]:
    """Walk ``tree`` choosing each token with ``rule``: (path, accepted tokens, bonus). The bonus is None when
    the walk ended on an accepted node (a drafted token that ends the generation)."""
    return walk_from(tree, logits, rule, choose or rule.choose, [0], [])


def walk_from(tree, logits, rule: TokenRule, choose: Callable, path: list[int], drawn: list[int]):
    """:func:`rule_walk` from a partial walk: ``path`` (root first) and the tokens ``drawn`` so far."""
    children, tokens = tree.children, tree.tokens
    node = path[-1]
    while True:
        tok = choose(logits[node], drawn)
        drawn.append(tok)
        nxt = next((c for c in children[node] if tokens[c] == tok), None)
        if nxt is not None:
            path.append(nxt)
            node = nxt
        if rule.ends(drawn) or nxt is None:
            break
    accepted = tuple(drawn[: len(path) - 1])
    bonus = drawn[-1] if len(drawn) > len(path) - 1 else None
    return tuple(path), accepted, bonus
