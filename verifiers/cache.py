"""The key/value cache of tree passes (docs/speed.md, "Tree passes: attention and the cache").

:class:`HeadroomLayer` appends in place where ``DynamicLayer.update`` copies the whole layer with ``torch.cat``;
``keys`` and ``values`` are views of the filled part of a buffer with room to grow, so whatever reads the cache
(attention, the commit's gather, ``crop``) sees the same values, and the logits are unchanged to the bit
(tests/test_kernels.py). Sliding-window layers keep a pass's rows until the commit's crop (below).
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
        kb = key_states.new_empty((*key_states.shape[:2], cap, key_states.shape[-1]))
        vb = value_states.new_empty((*value_states.shape[:2], cap, value_states.shape[-1]))
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
    """``cache`` with each plain, still empty ``DynamicLayer`` replaced by a :class:`HeadroomLayer`."""
    layers = getattr(cache, "layers", None)
    if not isinstance(layers, list):
        return cache
    for i, layer in enumerate(layers):
        if type(layer) is DynamicLayer and not layer.is_initialized:
            layers[i] = HeadroomLayer()
    return cache


# Sliding-window layers (transformers' DynamicSlidingWindowLayer) hold the last ``window - 1`` positions and by
# default drop the oldest rows as soon as a forward appends, losing what a rejected tree pushed out.
# ``Cache.activate_past_recording()`` (public; assisted decoding uses it) keeps every row until the next ``crop``,
# and ``crop(-k)`` then drops the k trailing rows and keeps the last ``window - 1`` of the rest: exactly what
# one-token decoding would have left. tests/test_sliding_window.py checks the behaviour this relies on.


def has_sliding_layers(cache) -> bool:
    return any(getattr(layer, "is_sliding", False) for layer in getattr(cache, "layers", ()) or ())


def keep_rows_for_rollback(cache) -> None:
    """Sliding layers keep a forward's rows until the commit's ``crop`` (no-op for other layers)."""
    if has_sliding_layers(cache):
        cache.activate_past_recording()


def pass_rows_start(layer, num_rows: int) -> int:
    """Where the last forward's ``num_rows`` rows begin in ``layer.keys``: after the committed positions it holds
    (all of them in a full layer, at most ``window - 1`` in a sliding one)."""
    return int(layer.keys.shape[-2]) - num_rows
