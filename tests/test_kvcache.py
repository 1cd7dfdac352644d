"""Tests for kvcache.py: the rollout engine's KV cache and the forward over it.

Every operation the engine does on the cache (rows joining from a prefix, drops, copies, holes,
packing, growth past the capacity) must leave each row's logits equal to a fresh forward over
that row's real tokens: the rollout records log-probs the update recomputes from scratch.
"""
import torch

import kvcache


def test_kv_cache_rows_join_drop_and_pack_equal_a_plain_forward(tiny_llama):
    """KVCache through the engine's operations: three rows join from a one-row prefix cache and are
    fed different rests of prompt (right-aligned, with holes), decode past the preallocated
    capacity (so it grows), one row is dropped, a hole column is fed, the cache is packed (hole
    columns cut), a third row joins after the pack, and a row is copied into a fourth (one row
    more than the cache holds: it grows). Every row's logits equal a fresh forward over that row's
    real tokens."""
    torch.manual_seed(0)
    forward = kvcache.CachedForward(tiny_llama)
    prefix_ids, rests = [5, 9, 300], [[41, 7, 88], [12], [6, 6]]
    prefix, cache = kvcache.KVCache(tiny_llama.config), kvcache.KVCache(tiny_llama.config, capacity=8)

    def check(logits, rows, fed):
        for b, row in enumerate(rows):
            if fed[b]:
                fresh = tiny_llama(input_ids=torch.tensor([row])).logits[0, -1]
                torch.testing.assert_close(logits[b], fresh, rtol=1e-4, atol=1e-4)

    with torch.no_grad():
        forward(torch.tensor([prefix_ids]), torch.ones(1, 3, dtype=torch.long), prefix)
        cache.add_rows(prefix, 3)
        rows = [prefix_ids + rest for rest in rests]
        ids = torch.tensor([rests[0], [0, 0] + rests[1], [0] + rests[2]])
        mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 1], [1, 1, 1, 0, 1, 1]])
        check(forward(ids, mask, cache), rows, [1, 1, 1])
        for step in range(12):
            new = torch.randint(0, 1000, (len(rows), 1))
            if step == 3:                               # drop row 1
                keep = torch.tensor([0, 2])
                cache.batch_select_indices(keep)
                mask, rows, new = mask[keep], [rows[i] for i in keep], new[keep]
            fed = torch.ones(len(rows), 1, dtype=torch.long)
            if step == 5:                               # a column of holes in every row
                fed[:] = 0
            if step == 6:                               # and one more in row 1 (which has one from its prompt)
                fed[1] = 0
            if step == 8:                               # pack: row 0 has one hole, so one column goes
                order = torch.sort(1 - mask, dim=1, stable=True).indices[:, :int(mask.sum(1).max())]
                cache.pack(order, order.shape[1])
                width = mask.shape[1]
                mask = (torch.arange(order.shape[1]) < mask.sum(1)[:, None]).long()
                assert width - mask.shape[1] == 1 and cache.get_seq_length() == mask.shape[1]
            if step == 9:                               # a new row joins: the prefix, then holes
                cache.add_rows(prefix, 1)
                joined = (torch.arange(mask.shape[1]) < 3).long()[None]
                mask, rows = torch.cat([mask, joined]), rows + [list(prefix_ids)]
                new, fed = torch.cat([new, torch.tensor([[77]])]), torch.cat([fed, torch.ones(1, 1, dtype=torch.long)])
            if step == 10:                              # row 1 copied into a new last row (a shared history)
                index = torch.tensor([0, 1, 2, 1])
                cache.batch_select_indices(index)
                mask, rows, fed = mask[index], [list(rows[i]) for i in index], fed[index]
                new = torch.randint(0, 1000, (len(rows), 1))
            mask = torch.cat([mask, fed], dim=1)
            logits = forward(new, mask, cache)
            for b, row in enumerate(rows):
                if fed[b]:
                    row.append(int(new[b]))
            check(logits, rows, fed[:, 0])
    assert cache.layers[0].keys.shape[-2] >= mask.shape[1] > 8, "the cache grew past its first capacity"


def test_a_bf16_cache_holds_half_the_bytes_and_rounds_logits_only_slightly(tiny_llama):
    """KVCache(dtype=torch.bfloat16), an evaluation's (engine.Sampling.cache_dtype): its buffers are
    bf16, half the bytes of the fp32 cache's, and attention reads them in bf16 (lora.sdpa_packed).
    Two rows fed a prompt in one forward (with a hole), then decoded token by token: every step's
    logits move from the fp32 cache's by bf16's rounding of keys, values and queries (8 bits of
    mantissa: about 1% of the logits' scale here), not more, and not by nothing."""
    torch.manual_seed(0)
    forward = kvcache.CachedForward(tiny_llama)
    caches = {dtype: kvcache.KVCache(tiny_llama.config, dtype=dtype) for dtype in (None, torch.bfloat16)}
    ids, mask = torch.tensor([[5, 9, 300, 41], [0, 12, 6, 6]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    gaps = []
    with torch.no_grad():
        for step in range(6):
            logits = {dtype: forward(ids, mask, cache) for dtype, cache in caches.items()}
            gaps.append(((logits[torch.bfloat16] - logits[None]).abs().max() / logits[None].abs().max()).item())
            ids = logits[None].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones(2, 1, dtype=torch.long)], 1)
    fp32, bf16 = caches[None].layers[0], caches[torch.bfloat16].layers[0]
    assert fp32.keys.dtype == torch.float32 and bf16.keys.dtype == bf16.values.dtype == torch.bfloat16
    assert bf16.keys.element_size() * 2 == fp32.keys.element_size() and bf16.keys.shape == fp32.keys.shape
    assert 0 < max(gaps) < 0.03, gaps
