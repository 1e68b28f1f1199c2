"""The continuous batch's KV cache: one preallocated row per slot, written in place."""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotKVCache(Cache):
    """Keys and values of up to ``slots`` sequences, one preallocated row per slot; a sequence
    of length L occupies columns 0..L-1 of its row. Before a decode forward, ``begin_step``
    says how many rows take part and where each writes its new token; the model's attention
    layers then call ``update``, which writes in place and returns views (no copies)."""

    def __init__(self, slots: int, capacity: int):
        super().__init__(layers=[])
        self.slots, self.capacity = slots, capacity
        self.key_rows: list[torch.Tensor] = []    # per layer [slots, kv_heads, capacity, head_dim]
        self.value_rows: list[torch.Tensor] = []
        self.rows, self.width = 0, 0
        self.row_index = self.write_at = None

    def put(self, slot: int, layer_kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Writes a prompt's per-layer (keys, values), each [kv_heads, length, head_dim], into a
        slot; the first write sizes the buffers from them."""
        if not self.key_rows:  # zeros, not empty: masked columns must still be finite (0 * NaN = NaN)
            for k, v in layer_kv:
                self.key_rows.append(k.new_zeros(self.slots, k.shape[0], self.capacity, k.shape[2]))
                self.value_rows.append(v.new_zeros(self.slots, v.shape[0], self.capacity, v.shape[2]))
        for (k, v), key_row, value_row in zip(layer_kv, self.key_rows, self.value_rows):
            key_row[slot, :, :k.shape[1]] = k
            value_row[slot, :, :v.shape[1]] = v

    def grow(self, capacity: int) -> None:
        """Makes room for sequences up to ``capacity`` tokens, keeping what every row holds
        (a longer prompt joining sequences in flight)."""
        if capacity <= self.capacity:
            return
        for rows in (self.key_rows, self.value_rows):
            for i, old in enumerate(rows):
                rows[i] = old.new_zeros(*old.shape[:2], capacity, old.shape[3])
                rows[i][:, :, :self.capacity] = old
        self.capacity = capacity

    def move(self, src: int, dst: int, length: int) -> None:
        for buffer in (*self.key_rows, *self.value_rows):
            buffer[dst, :, :length] = buffer[src, :, :length]

    def begin_step(self, lengths: torch.Tensor, width: int) -> None:
        """The next forward feeds one token to each of rows 0..len(lengths)-1, written at column
        lengths[r]; attention then spans columns 0..width-1 (the mask hides each row's tail)."""
        self.rows, self.width = len(lengths), width
        self.row_index, self.write_at = torch.arange(len(lengths), device=lengths.device), lengths

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        keys, values = self.key_rows[layer_idx], self.value_rows[layer_idx]
        keys[self.row_index, :, self.write_at] = key_states[:, :, 0]
        values[self.row_index, :, self.write_at] = value_states[:, :, 0]
        return keys[:self.rows, :, :self.width], values[:self.rows, :, :self.width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width
