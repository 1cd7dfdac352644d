"""The rollout engine's KV cache and the forward over it: preallocated buffers, ragged rows, and
logits for each row's last column only.

    cache = KVCache(model.config, capacity=prompt_len + max_new_tokens)   # capacity: a hint
    forward = CachedForward(model)
    ids, fed = right_aligned(token_lists, pad_id, device)   # each row's new tokens, (B, W) each
    logits = forward(ids, torch.cat([mask, fed], 1), cache)             # -> (B, V)
    cache.add_rows(prefix, n)                          # n rows that start from a one-row prefix cache
    cache.batch_select_indices(index)                  # keep, reorder or copy rows
    mask = pack_left(cache, mask)                      # cut the columns that are holes in every row

`KVCache` is a drop-in for transformers' DynamicCache in a model forward. DynamicCache grows by
torch.cat, a copy of the whole past at every decode step; KVCache writes only the new columns into
buffers that grow GROW_COLUMNS at a time, and adds the row operations above. It holds
full-attention layers only (Llama, Qwen2, SmolLM2).

Rows are ragged: the (B, S) attention mask marks real tokens 1 and holes 0, and every forward
passes position ids computed from it (cumsum - 1): a token's position is the number of real tokens
before it in its own row, the position a fresh forward over the row's tokens gives it, so holes
change no logit. Shapes: B rows, S cache columns, W tokens fed in one forward, V vocabulary.
"""
import copy

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

import lora

# What the transformers 5.x forward asks of a cache: update(keys, values, layer) -> the keys and
# values to attend, in the order of the mask's columns; get_mask_sizes / get_query_offset /
# get_seq_length -> the length before this forward (asked once, before any layer updates);
# subclassing Cache and CacheLayerMixin gives the rest (the is_sliding lists, isinstance checks).
GROW_COLUMNS = 256    # columns a KVLayer adds when it is full


class KVLayer(CacheLayerMixin):
    """One layer's keys and values in preallocated (rows allocated, kv_heads, capacity, head_dim)
    buffers, of which the first `rows` rows and `length` columns are valid; `update` returns views
    of the valid part. Dropped rows leave their memory allocated, for rows that join later."""

    is_sliding = False
    is_compileable = False       # True would make transformers build a mask at every decode step

    def __init__(self, capacity: int = 0, dtype=None):
        super().__init__()
        self.rows = 0                    # valid rows (the batch) in the buffers
        self.length = 0                  # valid columns (tokens) in the buffers
        self.min_capacity, self.store_dtype = capacity, dtype   # columns (a hint); None: the keys' dtype

    def lazy_initialization(self, key_states, value_states):
        self.device, self.dtype = key_states.device, self.store_dtype or key_states.dtype
        self.rows, capacity = key_states.shape[0], max(self.min_capacity, key_states.shape[-2], 16)
        self.keys, self.values = (self._empty(key_states, self.rows, capacity),
                                  self._empty(value_states, self.rows, capacity))
        self.is_initialized = True

    def _empty(self, like, rows, capacity):
        return torch.empty((rows, like.shape[1], capacity, like.shape[-1]), dtype=self.dtype,
                           device=like.device)

    def _reserve(self, rows, columns):
        """Make room for `rows` rows and `columns` columns, keeping the valid part. Columns grow by
        GROW_COLUMNS at a time, not by doubling: at most GROW_COLUMNS columns stand empty."""
        allocated, capacity = self.keys.shape[0], self.keys.shape[-2]
        if rows <= allocated and columns <= capacity:
            return
        rows, capacity = max(rows, allocated), capacity if columns <= capacity else columns + GROW_COLUMNS
        for name in ("keys", "values"):
            old, new = getattr(self, name), self._empty(getattr(self, name), rows, capacity)
            new[:self.rows, :, :self.length].copy_(old[:self.rows, :, :self.length])
            setattr(self, name, new)

    def update(self, key_states, value_states, *args, **kwargs):
        """Write the new (B, kv_heads, W, head_dim) states after the valid part and return the
        (B, kv_heads, length, head_dim) views to attend: W columns written, nothing else copied.
        The views are strided; SDPA reads them as they are."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.length, self.length + key_states.shape[-2]
        self._reserve(self.rows, end)
        self.keys[:self.rows, :, start:end].copy_(key_states)
        self.values[:self.rows, :, start:end].copy_(value_states)
        self.length = end
        return self.keys[:self.rows, :, :end], self.values[:self.rows, :, :end]

    def get_mask_sizes(self, query_length):
        return self.length + query_length, 0       # (kv_length, kv_offset), as DynamicLayer

    def get_seq_length(self):
        return self.length

    def get_max_length(self):
        return -1                                  # grows without bound

    def add_rows(self, source: "KVLayer", count: int):
        """`count` new rows after the valid ones, each a copy of `source`'s first row in its first
        source.length columns and zeros (holes, which the mask hides) after; in rows dropped earlier
        when there are enough, so a batch that keeps its size allocates nothing."""
        if not self.is_initialized:
            self.lazy_initialization(source.keys[:0, :, :0], source.values[:0, :, :0])
        length, first, end = max(self.length, source.length), self.rows, self.rows + count
        self._reserve(end, length)
        for name in ("keys", "values"):
            buf = getattr(self, name)
            buf[first:end, :, :source.length] = getattr(source, name)[:1, :, :source.length]
            buf[first:end, :, source.length:length] = 0
        self.rows, self.length = end, length

    def pack(self, order, width):
        """Keep `width` columns, row b's taken from its columns order[b] (B, width), in that order."""
        rows = torch.arange(len(order), device=order.device)[:, None]                # (B, 1)
        for name in ("keys", "values"):
            buf = getattr(self, name)
            picked = buf[rows, :, order.to(buf.device)]                              # a (B, width, H, D) copy
            buf[:len(order), :, :width] = picked.transpose(1, 2)
        self.length = width

    def batch_select_indices(self, indices):
        """Keep rows `indices`, in that order, compacted in place into the first len(indices) rows; an
        index given twice copies its row (rows with the same history share one forward)."""
        self._reserve(len(indices), self.length)
        for name in ("keys", "values"):
            buf = getattr(self, name)
            # gathered first
            buf[:len(indices), :, :self.length] = buf[indices.to(buf.device), :, :self.length]
        self.rows = len(indices)


class KVCache(Cache):
    """A preallocated KV cache of KVLayers, one a decoder layer, passed to the model's forward."""

    def __init__(self, config, capacity: int = 0, dtype=None):
        config = config.get_text_config(decoder=True)
        kinds = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        assert all(k == "full_attention" for k in kinds), \
            f"KVCache holds full-attention layers only, not {sorted(set(kinds))}"
        super().__init__(layers=[KVLayer(capacity, dtype) for _ in range(config.num_hidden_layers)])

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return self.layers[layer_idx].update(key_states, value_states)

    def add_rows(self, source: "KVCache", count: int):
        for layer, from_layer in zip(self.layers, source.layers):
            layer.add_rows(from_layer, count)

    def pack(self, order, width):
        for layer in self.layers:
            layer.pack(order, width)

    def get_query_offset(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].length + query_length, 0


def pack_left(cache, mask):
    """Move each row's real columns to the left, in order, and cut the columns that are now holes in
    every row. A column's key already holds its position (rotary), and positions come from the mask
    (cumsum - 1), so no token's position or attention changes. Returns the new mask."""
    real = mask.sum(1)                                                              # (B,)
    width = int(real.max()) if len(mask) else 0     # no rows left: every column goes
    if width == mask.shape[1]:
        return mask
    order = torch.sort(1 - mask, dim=1, stable=True).indices[:, :width]       # (B, width): real columns first
    cache.pack(order, width)
    return (torch.arange(width, device=mask.device) < real[:, None]).long()


def right_aligned(chunks, pad_id, device):
    """B token lists as one (B, W) batch, right-aligned with holes (mask 0) on the left, so the last
    column holds every row's newest real token (a row with nothing to feed: all holes).
    Returns (ids, mask), each (B, W)."""
    W = max(map(len, chunks))
    ids = torch.full((len(chunks), W), pad_id, dtype=torch.long)                      # (B, W)
    mask = torch.zeros((len(chunks), W), dtype=torch.long)                            # (B, W)
    for b, chunk in enumerate(chunks):
        if chunk:
            ids[b, W - len(chunk):] = torch.tensor(chunk)
            mask[b, W - len(chunk):] = 1
    return ids.to(device), mask.to(device)


class CachedForward:
    """One forward of the decoder body over new tokens and the cache, then the lm_head on each row's
    last column only: full-vocabulary logits are never made for a whole prompt or tool result.
    dtype: the head in that precision (a copy; None: the model's own)."""

    def __init__(self, model, dtype=None):
        self.body, self.head = model.base_model, model.get_output_embeddings()
        if dtype is not None and self.head.weight.dtype != dtype:
            self.head = copy.deepcopy(self.head).to(dtype)
        self.cache_arg = lora.cache_keyword(self.body)

    def __call__(self, ids, mask, cache):
        """ids (B, W) new tokens, mask (B, S+W) over cache + new columns -> logits (B, V) fp32 of
        each row's last column."""
        W = ids.shape[1]
        positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -W:]   # (B, W): real tokens before each, in its row
        hidden = self.body(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                           **{self.cache_arg: cache}).last_hidden_state                     # (B, W, H)
        return self.head(hidden[:, -1].to(self.head.weight.dtype)).float()                  # (B, V)
