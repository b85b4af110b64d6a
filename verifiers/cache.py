"""A key/value cache layer that appends in place: transformers' ``DynamicLayer`` with headroom.

``DynamicLayer.update`` appends a step's keys and values with ``torch.cat``, which copies the
layer's whole cache on every forward, a cost that grows with the context. :class:`HeadroomLayer`
keeps each layer's keys and values in a buffer with room to grow (:data:`MIN_ROOM` positions or
1/:data:`GROWTH` more, whichever is larger, reallocated when full: a long prompt's cache is not
doubled) and writes a step's rows into it; ``keys`` and ``values`` are views of the filled part,
so everything that reads the cache (the model's attention, Goose's commit, which gathers accepted
rows through ``keys`` / ``values``, and ``crop``) sees what it saw before. Attention reads the
same values through a strided view, and its output is unchanged to the bit
(``tests/test_kernels.py`` compares every logit of tree passes with and without headroom).

:func:`with_headroom` swaps the plain dynamic layers of a fresh ``DynamicCache`` for these; a
sliding-window or any other layer class is left as it is.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer

MIN_ROOM = 256  # positions of headroom at least, per (re)allocation
GROWTH = 4  # and at least 1/GROWTH of what is held: a long prompt's cache is not doubled


class HeadroomLayer(DynamicLayer):
    """``DynamicLayer`` whose ``update`` writes into a preallocated buffer instead of concatenating."""

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self._kbuf = self._vbuf = None
        self._len = 0

    def _grow(self, need: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        cap = need + max(MIN_ROOM, need // GROWTH)
        b, h, _, dk = key_states.shape
        dv = value_states.shape[-1]
        kb = torch.empty((b, h, cap, dk), dtype=key_states.dtype, device=key_states.device)
        vb = torch.empty((b, h, cap, dv), dtype=value_states.dtype, device=value_states.device)
        if self._len:
            kb[:, :, : self._len] = self.keys
            vb[:, :, : self._len] = self.values
        self._kbuf, self._vbuf = kb, vb

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, new = self._len, key_states.shape[-2]
        kb = self._kbuf
        if (
            kb is None
            or n + new > kb.shape[-2]
            or kb.shape[:2] != key_states.shape[:2]
            or kb.dtype != key_states.dtype
            or kb.device != key_states.device
        ):
            self._grow(n + new, key_states, value_states)
        self._kbuf[:, :, n : n + new] = key_states
        self._vbuf[:, :, n : n + new] = value_states
        self._len = n + new
        self.keys = self._kbuf[:, :, : self._len]
        self.values = self._vbuf[:, :, : self._len]
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self._len if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove > 0:
            raise ValueError(
                f"crop({tokens_to_remove}): a positive value is not supported; pass a negative number of "
                "trailing positions to remove"
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._len = max(0, self._len - abs(tokens_to_remove))
        self.keys = self._kbuf[:, :, : self._len]
        self.values = self._vbuf[:, :, : self._len]

    def reset(self) -> None:
        self._kbuf = self._vbuf = None
        self._len = 0
        super().reset()

    def batch_repeat_interleave(self, repeats: int) -> None:  # not used by Goose (batch 1); kept correct
        super().batch_repeat_interleave(repeats)
        self._adopt()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self._adopt()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        self._adopt()

    def _adopt(self) -> None:
        """After a parent method replaced ``keys`` / ``values``: they become the buffer."""
        if self.is_initialized and self.keys is not None and self.keys.numel():
            self._kbuf, self._vbuf = self.keys, self.values
            self._len = self.keys.shape[-2]


def with_headroom(cache):
    """``cache`` with each plain ``DynamicLayer`` (exactly that class, still empty) replaced by a
    :class:`HeadroomLayer`; returns the cache."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return cache
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            layers[i] = HeadroomLayer()
    return cache


# ---------------------------------------------------------------------------------------------
# Sliding-window layers (transformers' DynamicSlidingWindowLayer, e.g. Gemma-3's local layers)
#
# Such a layer holds the last ``window - 1`` positions. By default its ``update`` drops the oldest
# rows as soon as a forward appends new ones, so the rows a rejected tree pushed out would be lost,
# and its ``crop`` refuses to roll back once the window is full. ``Cache.activate_past_recording()``
# (public; transformers' assisted decoding calls it) makes ``update`` keep every row until the next
# ``crop``, and ``crop(-k)`` then drops the k trailing rows and keeps the last ``window - 1`` of the
# rest: after the commit the layer holds exactly the rows, and counts exactly the positions, that
# one-token-at-a-time decoding would have left. Beyond those public methods and ``get_mask_sizes``,
# Goose reads only each layer's ``keys`` / ``values`` and their length (:func:`pass_rows_start`);
# tests/test_sliding_window.py checks the behaviour this relies on.


def has_sliding_layers(cache) -> bool:
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()) or ())


def keep_rows_for_rollback(cache) -> None:
    """Sliding layers keep a forward's rows until the commit's ``crop`` (no-op for other layers)."""
    if has_sliding_layers(cache):
        cache.activate_past_recording()


def pass_rows_start(layer, num_rows: int) -> int:
    """Where the rows of the last forward (``num_rows`` of them) begin in ``layer.keys``: after the
    ``past`` committed positions in a full layer, after the (at most ``window - 1``) held ones in a
    sliding layer that keeps rows for roll-back."""
    return int(layer.keys.shape[-2]) - num_rows
