"""Attention in tree passes: grouped key/value heads read in place, and the tree masks of sliding-window layers.

With a mask, as in every tree pass, transformers' ``sdpa`` copies each layer's key/value cache once per query
group (``repeat_kv``: the masked GQA kernel is slow on CUDA, not on the CPU). While a tree pass runs (any thread),
the ``sdpa`` entry of transformers' attention mapping is :func:`_gqa_sdpa`, which calls torch's kernel with
``enable_gqa=True`` inside the calling thread's own tree passes on the CPU, the same logits to the bit
(tests/test_kernels.py), and passes every other call (other threads, devices, one-token steps) to the function it
stands in for, unchanged. The mapping is patched because a model's attention is picked by the name in its config,
which every thread shares.

:func:`window_plan` and :func:`sliding_tree_mask` give each sliding layer (Gemma-3 and the like) a tree mask that
keeps each node's own window, so such models are verified exactly at any length.
"""

from __future__ import annotations

import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass

import torch

_local = threading.local()  # .depth: > 0 inside a tree pass of this thread
_lock = threading.Lock()
# "passes": tree passes running; "inner": the sdpa function stood in for (kept after: a call that took the
# mapping's entry just before it was put back still finds it)
_state: dict = {"passes": 0}


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
    return inner(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, is_causal=is_causal,
                 **kwargs)


def _mapping():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def available() -> bool:
    """Whether this transformers has the attention mapping with an ``sdpa`` entry that tree passes stand in for."""
    try:
        return callable(_mapping()["sdpa"])
    except (ImportError, KeyError, TypeError):
        return False


@contextmanager
def tree_pass():
    """Within the block, this thread's masked sdpa calls on the CPU read shared key/value heads in place. The
    first tree pass to begin (any thread) installs the function; the last to end puts back what was there."""
    _local.depth = getattr(_local, "depth", 0) + 1
    if _local.depth == 1:
        with _lock:
            if _state["passes"] == 0:
                mapping = _mapping()
                _state["inner"] = mapping["sdpa"]
                mapping["sdpa"] = _gqa_sdpa
            _state["passes"] += 1
    try:
        yield
    finally:
        _local.depth -= 1
        if _local.depth == 0:
            with _lock:
                _state["passes"] -= 1
                if _state["passes"] == 0:
                    _restore(_mapping(), _state["inner"])


def _restore(mapping, inner) -> None:
    """Put ``inner`` back under ``sdpa``: transformers' own (global) entry is left to answer again rather than
    copied into the instance's mapping, where it would hide a later ``AttentionInterface.register``. An entry
    someone else put there meanwhile stays."""
    if mapping["sdpa"] is not _gqa_sdpa:
        return
    del mapping["sdpa"]  # the instance's entry: ours
    try:
        if mapping["sdpa"] is inner:
            return
    except KeyError:
        pass
    mapping["sdpa"] = inner  # what stood there was an instance entry of its own


# Sliding-window layers. transformers' window (masking_utils.sliding_window_overlay): the query at position q sees
# the keys at q - window < kv <= q. A tree node at depth d sits at past + d and sees, of the cached prefix and its
# ancestors, those within that window. The sliding cache layer holds only the last ``window - 1`` committed
# positions (``Cache.get_mask_sizes``), so its mask is ``[1, 1, n, held + n]``.

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class WindowPlan:
    """How a tree pass masks a model's attention layers. ``mode``: "full" (no sliding layer: one tree mask);
    "dict" (``attention_mask`` a dict keyed by layer type, as Gemma-2/3, Qwen2, Cohere-2: full and windowed
    masks); "single" (all layers sliding with one window, masks from ``create_sliding_window_causal_mask``, as
    Mistral, Phi-3: one windowed mask); "refuse" (not maskable exactly, ``why``: served only while prompt + new
    tokens + tree fit in the window, where the plain tree mask is exact).
    """

    mode: str
    window: int | None = None
    types: tuple[str, ...] = ()  # layer types keyed in the dict ("dict")
    sliding_layer: int = 0  # a sliding cache layer: it sizes the windowed mask
    why: str = ""


def _decoder_source(model) -> str:
    """The source of the module that builds the attention masks (the decoder's forward)."""
    try:
        base = model.get_decoder()
    except (AttributeError, NotImplementedError, TypeError):
        base = None
    base = next((m for m in (base, getattr(model, "model", None)) if m is not None), model)
    try:
        return inspect.getsource(type(base).forward)
    except (OSError, TypeError):
        return ""


def window_plan(model, text_cfg) -> WindowPlan:
    """The :class:`WindowPlan` of ``model``, from its config's layer types, its cache's layers and its forward."""
    layer_types = tuple(str(t) for t in (getattr(text_cfg, "layer_types", None) or ()))
    sliding = getattr(text_cfg, "sliding_window", None)
    if layer_types:
        uses_window = any("sliding" in t for t in layer_types)
    else:
        uses_window = sliding is not None and bool(getattr(text_cfg, "use_sliding_window", True))
    if not uses_window or not sliding:
        return WindowPlan("full")
    window = int(sliding)

    def refuse(why: str) -> WindowPlan:
        return WindowPlan("refuse", window, why=why)

    try:
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        probe = DynamicCache(config=model.config)
    except (ImportError, TypeError, ValueError, KeyError, AttributeError) as exc:
        return refuse(f"this transformers builds no per-layer cache from the config ({exc})")
    layers = list(getattr(probe, "layers", ()))
    if not layers or not hasattr(probe, "activate_past_recording") or not hasattr(probe, "get_mask_sizes"):
        return refuse("this transformers' DynamicCache has no per-layer sliding cache that can roll back")
    is_sliding = [type(layer) is DynamicSlidingWindowLayer for layer in layers]
    known = {DynamicLayer.__name__, DynamicSlidingWindowLayer.__name__}
    odd = sorted({type(layer).__name__ for layer in layers} - known)
    if odd:
        return refuse(f"its cache has layers of type {', '.join(odd)}, whose roll-back Goose does not know")
    windows = {int(layer.sliding_window) for layer, s in zip(layers, is_sliding) if s}
    if windows != {window}:
        return refuse(f"its cache's sliding layers have windows {sorted(windows)}, not the config's {window}")
    first = is_sliding.index(True)
    source = _decoder_source(model)
    if layer_types and "attention_mask, dict" in source:
        if not set(layer_types) <= {FULL, SLIDING}:
            return refuse(f"its layer types {sorted(set(layer_types))} include others than {FULL!r} and {SLIDING!r}")
        if len(layer_types) != len(layers) or any((t == SLIDING) != s for t, s in zip(layer_types, is_sliding)):
            return refuse("its cache's sliding layers are not the config's sliding_attention layers")
        return WindowPlan("dict", window, tuple(sorted(set(layer_types))), first)
    if all(is_sliding) and "create_sliding_window_causal_mask" in source:
        return WindowPlan("single", window, (), first)
    if all(is_sliding):
        return refuse("its forward does not build its masks with transformers' create_sliding_window_causal_mask, "
                      "so the window rule a tree mask must reproduce is not known")
    return refuse("it mixes sliding and full-attention layers but takes a single attention mask for all of them")


def sliding_tree_mask(tree, past: int, window: int, held: int, dtype=torch.float32, device=None) -> torch.Tensor:
    """``[1, 1, n, held + n]`` additive mask of a tree pass on a sliding layer holding the ``held`` positions before
    ``past``: node i (at ``past + depth_i``) sees a cached position or an ancestor (itself included) at k iff
    ``k > past + depth_i - window``."""
    d = torch.tensor(tree.depths, dtype=torch.long)
    q = past + d
    cached = torch.arange(past - held, past, dtype=torch.long)
    see_cached = cached.view(1, -1) > (q - window).view(-1, 1)
    see_tree = torch.from_numpy(tree.ancestor_mask) & ((d.view(-1, 1) - d.view(1, -1)) < window)
    see = torch.cat([see_cached, see_tree], dim=1).to(device)
    mask = torch.zeros((1, 1, *see.shape), dtype=dtype, device=device)
    return mask.masked_fill_(~see, torch.finfo(dtype).min)
