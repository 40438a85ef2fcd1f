"""`ModelRunner`: the engine's forward passes. A step's windows of tokens (a prompt past its cached blocks, or a
decode step's last token) become one batched forward over their KV-cache rows, left-padded to a common width, with
the masks, the adapters and, in exact mode, the filler rows that keep each matmul rounding as the trainer's does (a
model with recurrent layers forwards each sequence on its own, from its own state).

The engine (engine.py) decides which rows run; this module only computes their logits. Both run on the engine thread.
"""

import collections

import torch

from tandem.kernels import exact_attention
from tandem.model import architecture
from tandem.serve.kv_cache import SequenceStates, SlotKVCache
from tandem.serve.lora import AdapterSet

RECOMPUTE_ROWS = 16
"""Running sequences whose cache is computed again in one forward after a weight update."""


def filler_adapters(adapters: list[str | None], width: int, min_rows: int) -> list[str | None]:
    """The adapters of the filler sequences exact decoding adds: every matmul must see at least `min_rows` rows,
    the base layers' (all sequences) and each adapter's LoRA product (only its own sequences) alike."""
    need = -(-min_rows // width)
    counts = collections.Counter(a for a in adapters if a)
    fillers = [name for name, count in counts.items() for _ in range(need - count)]
    return fillers + [None] * (need - len(adapters) - len(fillers))


class ModelRunner:
    """Forwards windows of several cache rows at once. `model` may be replaced (an adapter load: peft wraps it), so it
    is read at every forward."""

    def __init__(
        self,
        model: torch.nn.Module,
        cache: SlotKVCache | SequenceStates,
        *,
        max_model_len: int,
        min_rows: int,
        exact: bool,
        adapters: AdapterSet | None,
    ):
        self.model, self.cache, self.adapters = model, cache, adapters
        self.max_model_len, self.min_rows, self.exact = max_model_len, min_rows, exact
        """`min_rows`: rows every matmul gets, filler sequences added where a step has fewer (engine._min_rows)."""
        self.device = next(model.parameters()).device

    def recompute(self, histories: list[list[int]], adapters: list[str | None], in_use: set[str]) -> None:
        """The keys and values of rows 0..len(histories)-1 computed again from their whole histories, as a prefill
        (after a weight update), RECOMPUTE_ROWS rows a forward to bound its memory."""
        for start in range(0, len(histories), RECOMPUTE_ROWS):
            stop = min(start + RECOMPUTE_ROWS, len(histories))
            rows = histories[start:stop]
            self.window_forward(rows, [len(h) for h in rows], slice(start, stop), adapters[start:stop], in_use)

    def window_forward(
        self,
        windows: list[list[int]],
        totals: list[int],
        rows: slice,
        adapters: list[str | None],
        in_use: set[str],
        all_logits: bool = False,
    ) -> torch.Tensor:
        """Forward the last tokens of several sequences at once, left-padded to a common width.

        `windows[b]` are the final tokens of a sequence `totals[b]` tokens long, written to cache positions
        totals[b]-len .. totals[b]-1 of row rows.start+b. Pad columns write to scratch positions past the
        sequence, the row's last position once they run out (overwritten later, never attended), so padded
        batches need no special layout. `in_use`: the adapters of the running rows, which loading another keeps.
        """
        cache = self.cache
        if isinstance(cache, SequenceStates):
            return self._sequence_forward(cache, windows, totals, rows, adapters, in_use, all_logits)
        width = max(len(w) for w in windows)
        fillers = filler_adapters(adapters, width, self.min_rows)
        if fillers:  # too few rows for the long-forward matmul path: add filler sequences in free cache rows
            cache.ensure_rows(rows.stop + len(fillers))
            windows, totals = windows + [[0]] * len(fillers), totals + [1] * len(fillers)
            rows, adapters = slice(rows.start, rows.stop + len(fillers)), adapters + fillers
        ids, positions = [], []
        for tokens, total in zip(windows, totals):
            pad = width - len(tokens)
            ids.append([0] * pad + tokens)
            scratch = [min(p, self.max_model_len - 1) for p in range(total, total + pad)]
            positions.append(scratch + list(range(total - len(tokens), total)))
        input_ids, write_pos = torch.tensor(ids), torch.tensor(positions)
        kv_len = int(write_pos.max()) + 1
        if self.exact:  # short key blocks take another matmul path too; the extra keys are masked out
            kv_len = min(max(kv_len, exact_attention.MATMUL_KEYS), self.max_model_len)
        keys = torch.arange(kv_len)
        mask = (keys[None, None, :] <= write_pos[:, :, None]) & (
            keys[None, None, :] < torch.tensor(totals)[:, None, None]
        )
        return self._forward(
            cache,
            input_ids.to(self.device),
            write_pos.to(self.device),
            kv_len,
            mask[:, None].to(self.device),
            rows,
            adapters,
            in_use,
            all_logits,
        )

    def _forward(
        self,
        cache: SlotKVCache,
        input_ids,
        write_pos,
        kv_len,
        mask,
        rows: slice,
        adapters: list[str | None],
        in_use: set[str],
        all_logits: bool,
    ) -> torch.Tensor:
        """One model forward over cache rows `rows`; float32 logits of every position or of the last one(s)."""
        cache.begin(rows, write_pos, kv_len)

        def windowed(layer_type: str, window: int | None) -> torch.Tensor:  # query minus key position below the window
            distance = write_pos[:, None, :, None] - torch.arange(kv_len, device=self.device)
            return exact_attention.model_mask(mask & (distance < window) if window else mask, self.model)

        masks = architecture.layer_masks(self.model.config, windowed)
        kwargs = self._adapter_kwargs(adapters, in_use)
        out = self.model(
            input_ids=input_ids,
            position_ids=write_pos,
            attention_mask=masks,
            cache=cache,
            use_cache=True,
            logits_to_keep=0 if all_logits else self._positions_to_keep(input_ids.shape[0]),
            **kwargs,
        )
        return out.logits.float()

    def _sequence_forward(
        self,
        states: SequenceStates,
        windows: list[list[int]],
        totals: list[int],
        rows: slice,
        adapters: list[str | None],
        in_use: set[str],
        all_logits: bool,
    ) -> torch.Tensor:
        """`window_forward` for a model with recurrent layers: each sequence forwarded on its own from its own state,
        the logits left-padded to a common width as a batched window's are."""
        logits = []
        for row, window, total, adapter in zip(range(rows.start, rows.stop), windows, totals, adapters):
            kwargs = self._adapter_kwargs([adapter], in_use)  # may wrap self.model: read it after
            logits.append(states.forward(self.model, row, window, total, all_logits, **kwargs))
        width = max(len(part) for part in logits)
        return torch.stack([torch.nn.functional.pad(part, (0, 0, width - len(part), 0)) for part in logits]).float()

    def _adapter_kwargs(self, adapters: list[str | None], in_use: set[str]) -> dict:
        """The forward's `adapter_names` for these rows' adapters, loading any not loaded yet ({} without adapters)."""
        wanted = {a for a in adapters if a}
        if self.adapters is None or not (wanted or self.adapters.active):
            return {}
        self.model = self.adapters.ensure_loaded(self.model, wanted, in_use)
        return {"adapter_names": self.adapters.names_for(adapters)}

    def _positions_to_keep(self, rows: int) -> int:
        """Positions whose logits we compute: the last one, or enough for the lm_head matmul to have `min_rows` rows
        (the caller guarantees rows x width >= min_rows)."""
        return -(-self.min_rows // rows)
