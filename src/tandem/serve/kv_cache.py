"""A slot KV cache: one row per running sequence, grown as sequences lengthen, rows 0..n-1 always the live ones.

transformers' attention layers call `update(key, value, layer_idx)` on whatever cache object the
model is given; this one writes each new key/value at that row's own position (rows differ in
length) and hands back the live rows' keys up to `kv_len`. The engine builds the attention mask in
cache-position space, so padded and ragged batches need no special layout.

`SequenceStates` stands in for it with models whose layers carry state across tokens (gated DeltaNet, Mamba).
"""

import copy

import torch

from tandem.kernels import exact_attention
from tandem.kernels.exact_attention import MIN_ROWS
from tandem.model import architecture


class KVShapes:
    """Records what each attention layer stores in a cache: handed to a forward of one token as its cache."""

    def __init__(self) -> None:
        self.layers: dict[int, tuple[int, int, int]] = {}
        """layer index -> (key-value heads, key width, value width)."""

    def update(
        self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, *_, **__
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self.layers[layer_idx] = (key.shape[1], key.shape[-1], value.shape[-1])
        return key, value


def kv_shapes(model: torch.nn.Module) -> KVShapes:
    """What `model`'s layers store, read from one token's forward rather than from its config: configs name heads and
    widths their own way (GPT-2 has no `num_key_value_heads`; DeepSeek-V3's latent attention keeps keys 192 wide and
    values 128)."""
    shapes, device = KVShapes(), next(model.parameters()).device
    attend = exact_attention.model_mask(torch.ones(1, 1, 1, 1, dtype=torch.bool, device=device), model)
    with torch.no_grad():  # position and mask given: the model asks the cache nothing else
        model(
            input_ids=torch.ones(1, 1, dtype=torch.long, device=device),
            position_ids=torch.zeros(1, 1, dtype=torch.long, device=device),
            attention_mask=architecture.layer_masks(model.config, lambda *_: attend),
            cache=shapes,
            use_cache=True,
        )
    return shapes


class SlotKVCache:
    """Keys and values of every layer in one tensor, `[2 (keys, values), layers, rows, kv_heads, length, width]`:
    copying a row is one copy, where a copy per layer and kind was ~10% of the demo server's engine time. Keys and values
    may differ in width (latent attention): the tensor is as wide as the wider, each read back at its own. Rows and
    length both grow by doubling as sequences need them: a cache of max_len positions per row zeroed 1 GiB for 512 short
    rows of the tiny model (2.1 s), one of the positions they reach 32 MiB."""

    def __init__(
        self,
        num_layers: int,
        kv_heads: int,
        key_dim: int,
        value_dim: int,
        max_len: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.kv = torch.zeros(2, num_layers, 0, kv_heads, 0, max(key_dim, value_dim), dtype=dtype, device=device)
        self.key_dim, self.value_dim = key_dim, value_dim
        self.max_len = max_len
        self.rows = slice(0, 0)
        self.write_pos = torch.zeros(0, 0, dtype=torch.long)
        self.kv_len = 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[2]

    def ensure_rows(self, n: int) -> None:
        """Grow the buffer so that at least `n` rows exist."""
        self._ensure(n, self.kv.shape[4])

    def _ensure(self, rows: int, length: int) -> None:
        """At least `rows` rows of at least `length` positions (each doubling when it grows, length up to max_len);
        what the rows held is kept, new space is zeros (masked keys must hold finite values: 0 x NaN is NaN)."""
        shape = list(self.kv.shape)
        if rows <= shape[2] and length <= shape[4]:
            return
        if rows > shape[2]:
            shape[2] = max(rows, 2 * shape[2], 4)
        if length > shape[4]:
            shape[4] = min(max(length, 2 * shape[4], 64), max(self.max_len, length))
        grown = self.kv.new_zeros(shape)
        grown[:, :, : self.kv.shape[2], :, : self.kv.shape[4]] = self.kv
        self.kv = grown

    def begin(self, rows: slice, write_pos: torch.Tensor, kv_len: int) -> None:
        """Set where the next forward writes: `write_pos[b, t]` is the cache position of input token t of row b, each
        below `kv_len`."""
        self._ensure(rows.stop, kv_len)
        self.rows, self.write_pos, self.kv_len = rows, write_pos, kv_len

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, **_) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.kv[0, layer_idx], self.kv[1, layer_idx]
        batch = torch.arange(self.rows.start, self.rows.stop, device=key.device)[:, None]
        keys[batch, :, self.write_pos, : self.key_dim] = key.transpose(1, 2).to(keys.dtype)
        values[batch, :, self.write_pos, : self.value_dim] = value.transpose(1, 2).to(values.dtype)
        return keys[self.rows, :, : self.kv_len, : self.key_dim], values[self.rows, :, : self.kv_len, : self.value_dim]

    def copy_row(self, source: int, targets: range, length: int) -> None:
        """Rows `targets` (not `source`) become copies of row `source` up to position `length`: one broadcast copy,
        6x faster than an indexed one."""
        self.kv[:, :, targets.start : targets.stop, :, :length] = self.kv[:, :, source : source + 1, :, :length]

    def read(self, row: int, start: int, stop: int) -> torch.Tensor:
        """A copy of positions start..stop-1 of a row, every layer: `[2 (keys, values), layers, kv_heads, stop - start, width]`."""
        return self.kv[:, :, row, :, start:stop].clone()

    def write(self, row: int, kv: torch.Tensor) -> None:
        """Put `kv`, shaped as `read` returns it, at positions 0.. of a row."""
        self._ensure(row + 1, kv.shape[3])
        self.kv[:, :, row, :, : kv.shape[3]] = kv


class SequenceStates:
    """Per-sequence state for models with layers that carry state from token to token (gated DeltaNet, Mamba), which
    no slot of keys and values can hold: each row has its tokens and transformers' own cache for them. With
    `reforward` (exact decoding) a row keeps no cache and every step forwards its whole sequence, as the trainer's
    forward does: a recurrent layer's one-token update rounds differently from its chunked form over the sequence."""

    def __init__(self, reforward: bool):
        self.reforward = reforward
        self.tokens: list[list[int]] = []
        self.caches: list = []

    def ensure_rows(self, n: int) -> None:
        """Make rows 0..n-1 exist."""
        while len(self.tokens) < n:
            self.tokens.append([])
            self.caches.append(None)

    def copy_row(self, source: int, targets: range, length: int) -> None:
        """Rows `targets` become copies of row `source` (all it has processed, `length` tokens)."""
        for target in targets:
            self.tokens[target] = self.tokens[source][:length]
            self.caches[target] = copy.deepcopy(self.caches[source])

    def forward(
        self, model: torch.nn.Module, row: int, window: list[int], total: int, all_logits: bool, **kwargs
    ) -> torch.Tensor:
        """Logits of the last position of `window` (of every one with `all_logits`), the last tokens of row `row`'s
        sequence, `total` tokens long; a window that is the whole sequence starts the row afresh."""
        if total == len(window):
            self.tokens[row], self.caches[row] = [], None
        tokens, device = self.tokens[row] + window, next(model.parameters()).device
        if self.reforward:  # matmuls of at least MIN_ROWS rows: fewer take another rounding path (exact_attention.py)
            n = len(tokens)
            start = max(min(n - len(window) if all_logits else n - 1, n - MIN_ROWS), 0)
            ids = torch.tensor([tokens + [0] * max(MIN_ROWS - n, 0)], device=device)
            keep = torch.arange(start, max(n, MIN_ROWS), device=device)
            logits = model(input_ids=ids, use_cache=False, logits_to_keep=keep, **kwargs).logits[0, : n - start]
        else:
            out = model(
                input_ids=torch.tensor([window], device=device),
                cache=self.caches[row],
                use_cache=True,
                logits_to_keep=0 if all_logits else 1,
                **kwargs,
            )
            logits, self.caches[row] = out.logits[0], out.cache
        self.tokens[row] = tokens
        return logits[-len(window) :] if all_logits else logits[-1:]
