"""The decode loop's key/value cache: transformers' dynamic cache, written in place.

transformers' ``DynamicLayer`` concatenates every step's keys and values onto the cache, copying the whole cache
at every decode step. :class:`DecodeLayer` keeps the same numbers in buffers with room for the remaining steps
and returns views of them, so a step writes only its own position.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import Tensor
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class DecodeLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` with the same keys and values, kept where the decode reads them cheaply.

    - The keys and values are written into buffers with room for ``reserve`` more positions, and returned as
      views of them: no step copies the whole cache again (``DynamicLayer`` concatenates at every step).
    - Under autocast the keys arrive in float32 (rotary's float32 cos/sin promote them) beside values in the
      autocast dtype, and attention casts the whole key cache down again at every step; here each key is
      stored in the values' dtype once, the cast attention would make. Attention then gets the same numbers.
    """

    def __init__(self, reserve: int) -> None:
        super().__init__()
        self.reserve = reserve
        self.buffers: tuple[Tensor, Tensor] | None = None

    def update(self, key_states: Tensor, value_states: Tensor, *args: Any, **kwargs: Any) -> tuple[Tensor, Tensor]:
        device_type = key_states.device.type
        if (key_states.dtype != value_states.dtype and torch.is_autocast_enabled(device_type)
                and value_states.dtype == torch.get_autocast_dtype(device_type)):
            key_states = key_states.to(value_states.dtype)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        length = self.get_seq_length()
        end = length + key_states.shape[-2]
        if not self._writes_in_place(key_states, value_states, end):
            shape = (*key_states.shape[:2], end + self.reserve)
            keys = key_states.new_empty(*shape, key_states.shape[-1])
            values = value_states.new_empty(*shape, value_states.shape[-1])
            if length:
                keys[..., :length, :] = self.keys
                values[..., :length, :] = self.values
            self.buffers = (keys, values)
        keys, values = self.buffers
        keys[..., length:end, :] = key_states
        values[..., length:end, :] = value_states
        self.keys, self.values = keys[..., :end, :], values[..., :end, :]
        return self.keys, self.values

    def _writes_in_place(self, key_states: Tensor, value_states: Tensor, end: int) -> bool:
        """Whether the cached keys and values are the leading part of buffers that hold ``end`` positions (not
        after ``batch_select_indices`` and the like, which put new tensors in their place)."""
        if self.buffers is None:
            return False
        keys, values = self.buffers
        return (self.keys.data_ptr() == keys.data_ptr() and self.values.data_ptr() == values.data_ptr()
                and keys.shape[:2] == key_states.shape[:2] and keys.shape[-2] >= end
                and keys.dtype == key_states.dtype and values.dtype == value_states.dtype)

def decode_cache(reserve: int) -> DynamicCache:
    """An empty key/value cache of :class:`DecodeLayer` layers, each keeping room for ``reserve`` positions
    past the ones it holds when it (re)allocates (the decode's ``max_new_tokens``)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = partial(DecodeLayer, reserve)
    return cache
