"""An exact toy causal LM with the Hugging Face forward contract."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace

import torch
from torch import nn

MOD = 1_000_003


def _weight(pos):  # w(pos), of a tensor or an int
    return (pos * pos * 7 + pos * 3 + 1) % MOD


def _target(h, pos, vocab: int):  # the greedy token at position pos, of tensors or ints
    return (h * 31 + pos * 17 + 5) % MOD % vocab


class ToyCausalLM(nn.Module):
    """Logits at a position are ``-((v - target) mod V)``, ``target = (31 h + 17 pos + 5) mod p mod V``, where
    ``h = sum over attended keys j of (token_j + 1) * w(pos_j) mod p``: an integer function of exactly the (token,
    position) pairs the position attends to, computed in int64 and emitted as exactly representable floats. The
    cache holds (token, position) per entry in a stock ``DynamicCache``."""

    def __init__(self, vocab_size: int = 16, max_positions: int = 4096, eos_token_id: int | None = None):
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(vocab_size=vocab_size, num_hidden_layers=1,
                                       max_position_embeddings=max_positions, eos_token_id=eos_token_id)
        self.config._attn_implementation = "eager"
        self.generation_config = SimpleNamespace(eos_token_id=eos_token_id)
        self.dummy = nn.Parameter(torch.zeros(1), requires_grad=False)
        self.forward_calls = 0

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True, **kwargs):
        self.forward_calls += 1
        target = _toy_targets(input_ids, attention_mask, position_ids, cache, self.vocab_size)
        return SimpleNamespace(logits=_toy_logits(target, self.vocab_size), cache=cache, past_key_values=cache)


def _toy_targets(input_ids, attention_mask, position_ids, cache, vocab: int) -> torch.Tensor:
    """The toy's ``[1, n]`` greedy targets for one pass (the cache updated with its (token, position) rows)."""
    ids = input_ids[0].long()  # [n]
    n = ids.shape[0]
    past = cache.get_seq_length() if cache is not None else 0
    pos = torch.arange(past, past + n) if position_ids is None else position_ids[0].long()
    kv = torch.stack([ids, pos], dim=-1).to(torch.float32).view(1, 1, n, 2)
    keys = cache.update(kv, kv, 0)[0] if cache is not None else kv
    ktok = keys[0, 0, :, 0].long()  # [L]
    kpos = keys[0, 0, :, 1].long()  # [L]
    L = ktok.shape[0]
    if attention_mask is None or attention_mask.dim() == 2:
        attend = torch.arange(L).view(1, L) <= (torch.arange(n) + (L - n)).view(n, 1)
    else:
        if attention_mask.shape[-1] != L or attention_mask.shape[-2] != n:
            raise ValueError(f"mask shape {tuple(attention_mask.shape)} does not fit n={n}, kv={L}")
        attend = attention_mask[0, 0] == 0  # additive mask: 0 = attend
    contrib = ((ktok + 1) * _weight(kpos)) % MOD  # [L]
    h = (attend.long() * contrib.view(1, L)).sum(-1) % MOD  # [n]
    return _target(h, pos, vocab).view(1, n)


def _toy_logits(target: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[..., vocab]`` logits ``-((v - target) mod V)`` of ``[...]`` integer targets (exact in float32)."""
    return -torch.remainder(torch.arange(vocab) - target.unsqueeze(-1), vocab).to(torch.float32)


class ToyDecoder(nn.Module):
    """The decoder part of :class:`ToySplitLM`: its "final hidden state" is each position's target."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, **kwargs):
        target = _toy_targets(input_ids, attention_mask, position_ids, cache, self.vocab_size)
        return SimpleNamespace(last_hidden_state=target.to(torch.float32).unsqueeze(-1))


class ToyHead(nn.Module):
    """The LM head of :class:`ToySplitLM`: ``[..., 1]`` hidden targets to ``[..., vocab]`` logits."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.vocab_size = vocab_size

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return _toy_logits(hidden[..., 0], self.vocab_size)


class ToySplitLM(ToyCausalLM):
    """:class:`ToyCausalLM` as transformers' causal LMs are built: a decoder module (``get_decoder``), an
    LM head applied apart (``get_output_embeddings``) and ``logits_to_keep``. The verifier then defers the
    prefill's logit rows (it keeps the decoder's last hidden states and runs the head when the first draft
    needs them), as it does on real models; the logits are the same exact integers as the toy's."""

    def __init__(self, vocab_size: int = 16, max_positions: int = 4096, eos_token_id: int | None = None):
        super().__init__(vocab_size, max_positions, eos_token_id)
        self.model = ToyDecoder(vocab_size)
        self.lm_head = ToyHead(vocab_size)

    def get_decoder(self) -> nn.Module:
        return self.model

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids, attention_mask=None, position_ids=None, cache=None, use_cache=True,
                logits_to_keep: int = 0, **kwargs):
        self.forward_calls += 1
        hidden = self.model(input_ids, attention_mask, position_ids, cache).last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return SimpleNamespace(logits=self.lm_head(hidden), cache=cache, past_key_values=cache)


def _hash(seq: Sequence[int]) -> int:
    """``h`` of ``seq`` at positions 0..len-1, every token attended."""
    return sum((t + 1) * _weight(j) for j, t in enumerate(seq)) % MOD


def reference_next(seq: Sequence[int], vocab_size: int) -> int:
    """The toy's greedy next token after ``seq``, from scratch (positions 0..len-1, full causal)."""
    return _target(_hash(seq), len(seq) - 1, vocab_size)


def reference_greedy(prompt: Sequence[int], max_new_tokens: int, vocab_size: int,
                     stop_ids: Sequence[int] = ()) -> list[int]:
    """Plain greedy decoding of the toy, no cache, no mask: the losslessness oracle."""
    out, h, n = [], _hash(prompt), len(prompt)
    while len(out) < max_new_tokens:
        nxt = _target(h, n - 1, vocab_size)
        out.append(nxt)
        h = (h + (nxt + 1) * _weight(n)) % MOD
        n += 1
        if nxt in stop_ids:
            break
    return out


def reference_logits(seq: Sequence[int], vocab_size: int) -> torch.Tensor:
    """The toy's float32 logits row ``[1, vocab]`` after ``seq``, from scratch."""
    return _toy_logits(torch.tensor([reference_next(seq, vocab_size)]), vocab_size)


def reference_sample(prompt: Sequence[int], max_new_tokens: int, vocab_size: int, processors=None,
                     generator: torch.Generator | None = None, stop_ids: Sequence[int] = (),
                     do_sample: bool = True) -> list[int]:
    """One token at a time, as transformers' sampling loop: processors on the prefix, softmax, one draw."""
    seq, out = list(prompt), []
    while len(out) < max_new_tokens:
        scores = reference_logits(seq, vocab_size)
        if processors is not None and len(processors):
            scores = processors(torch.tensor([seq], dtype=torch.long), scores)
        if do_sample:
            tok = int(torch.multinomial(torch.softmax(scores, dim=-1), 1, generator=generator)[0, 0])
        else:
            tok = int(scores.argmax(-1)[0])
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    return out
