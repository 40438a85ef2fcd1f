"""A slot KV cache: one fixed-length row per running sequence, rows 0..n-1 always the live ones.

transformers' attention layers call `update(key, value, layer_idx)` on whatever cache object the
model is given; this one writes each new key/value at that row's own position (rows differ in
length) and hands back the live rows' keys up to `kv_len`. The engine builds the attention mask in
cache-position space, so padded and ragged batches need no special layout.
"""

import torch


class SlotKVCache:
    def __init__(self, num_layers: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: torch.device):
        self.shape = (kv_heads, max_len, head_dim)
        self.keys = [torch.zeros(0, *self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(0, *self.shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.rows = slice(0, 0)
        self.write_pos = torch.zeros(0, 0, dtype=torch.long)
        self.kv_len = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[0]

    def ensure_rows(self, n: int) -> None:
        """Grow the buffers (doubling) so that at least `n` rows exist."""
        if n <= self.capacity:
            return
        new = max(n, 2 * self.capacity, 4)
        for buffers in (self.keys, self.values):
            for i, old in enumerate(buffers):
                grown = torch.zeros(new, *self.shape, dtype=old.dtype, device=old.device)
                grown[: old.shape[0]] = old
                buffers[i] = grown

    def begin(self, rows: slice, write_pos: torch.Tensor, kv_len: int) -> None:
        """Set where the next forward writes: `write_pos[b, t]` is the cache position of input token t of row b."""
        self.rows, self.write_pos, self.kv_len = rows, write_pos, kv_len

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, **_) -> tuple[torch.Tensor, torch.Tensor]:
        batch = torch.arange(self.rows.start, self.rows.stop, device=key.device)[:, None]
        self.keys[layer_idx][batch, :, self.write_pos] = key.transpose(1, 2).to(self.keys[layer_idx].dtype)
        self.values[layer_idx][batch, :, self.write_pos] = value.transpose(1, 2).to(self.values[layer_idx].dtype)
        return self.keys[layer_idx][self.rows, :, : self.kv_len], self.values[layer_idx][self.rows, :, : self.kv_len]

    def copy_row(self, src: int, dst: int, length: int) -> None:
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                buffer[dst, :, :length] = buffer[src, :, :length]

    def read(self, row: int, start: int, stop: int) -> torch.Tensor:
        """A copy of positions start..stop-1 of a row, every layer: `[2 (keys, values), layers, kv_heads, stop - start, head_dim]`."""
        return torch.stack([torch.stack([buffer[row, :, start:stop] for buffer in buffers]) for buffers in (self.keys, self.values)])

    def write(self, row: int, kv: torch.Tensor) -> None:
        """Put `kv`, shaped as `read` returns it, at positions 0.. of a row."""
        length = kv.shape[3]
        for layer, (keys, values) in enumerate(zip(self.keys, self.values)):
            keys[row, :, :length] = kv[0, layer]
            values[row, :, :length] = kv[1, layer]
