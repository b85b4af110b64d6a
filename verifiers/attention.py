"""Grouped-query attention without copying the cache, in tree passes on the CPU.

A model whose attention heads share key/value heads (grouped-query attention: SmolLM2 has 9 query
heads on 3 key/value heads) runs transformers' ``sdpa`` backend in one of two ways. With no mask,
torch's ``scaled_dot_product_attention(..., enable_gqa=True)`` reads the shared heads as they are.
With a mask, which every tree pass has, transformers first copies each layer's whole key and value
cache ``num_key_value_groups`` times (``repeat_kv``): on CUDA the masked GQA kernel would fall back
to a slow one. On the CPU it does not, and the copy is pure cost: for SmolLM2 with 259 cached
positions it was 60 copies of 0.6 MB per forward, 2.4-2.9 ms of a 36-39 ms tree pass (one-token
passes have no mask and no copy). The output is the same to the bit (checked on SmolLM2: logits of
an 8-node tree pass equal).

:func:`tree_pass` marks the calling thread's tree passes; :func:`install` registers, through
transformers' ``AttentionInterface`` mapping, an ``sdpa`` function that, inside a marked pass on
the CPU with a mask and shared heads, calls torch's kernel with ``enable_gqa=True``, and
otherwise calls the function it replaced, unchanged, with the same arguments. Other threads, other
devices and every call outside a tree pass therefore run exactly as before.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

import torch

_local = threading.local()  # .depth: > 0 inside a tree pass of this thread
_lock = threading.Lock()
_state: dict = {}  # "inner": the sdpa function replaced (set once installed)


def _gqa_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs):
    inner = _state["inner"]
    if (
        getattr(_local, "depth", 0) > 0
        and query.device.type == "cpu"
        and getattr(module, "num_key_value_groups", 1) > 1
        and attention_mask is not None
        and query.dim() == 4
        and query.shape[2] > 1
        and key.shape[-1] == value.shape[-1]
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and not kwargs.get("output_attentions", False)
    ):
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, is_causal=False,
            enable_gqa=True,
        )
        return out.transpose(1, 2).contiguous(), None
    return inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal, **kwargs)


def install() -> bool:
    """Put the tree-pass ``sdpa`` in transformers' attention mapping (once per process).

    Returns whether it is in place: False where this transformers has no such mapping."""
    with _lock:
        if "inner" in _state:
            return True
        try:
            from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

            inner = ALL_ATTENTION_FUNCTIONS["sdpa"]
        except (ImportError, KeyError, TypeError):
            return False
        _state["inner"] = inner
        ALL_ATTENTION_FUNCTIONS["sdpa"] = _gqa_sdpa
        return True


@contextmanager
def tree_pass():
    """Within the block, this thread's masked sdpa calls on the CPU read shared key/value heads in place."""
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
