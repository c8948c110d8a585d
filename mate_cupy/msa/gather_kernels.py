"""Launcher of the block-stationary sparse prefill (``cuda_src/attention_gather.cu``).

The prefill tile ``"gather"`` of block-sparse attention (a plan's
``prefill_tile="gather"``, ``run_attention(prefill_tile="gather")`` or
``MATE_CUPY_ATTN_SPARSE_TILE=gather``): for block lists chosen per query token (MSA's
top-k selection), every (request, query window, KV head, block) gathers the queries that
listed the block, so each K/V block is loaded once per window and every MMA row is a query
that picked the block; per (query, slot) partial outputs are then merged.
On lists shared by whole query tiles the default tile is expected to be faster (the
partials' round trip through DRAM alone is most of its time; docs/attention.md), and the
launcher cannot tell the two apart without reading device data: it is opt-in.

It applies on sm_90 to fp16/bf16, head dim 128, 16 query heads per KV head, page size 128,
prefill (not ``sparse_decode``); any other call takes the default tile. Workspace (the
attention launchers' per-device cache, grown geometrically and reused, so a warm-up call
makes a captured call allocation-free; or the caller's): fp16 O and an lse per (query,
KV head, list slot) and 16 heads, 4.2 KB per entry (8.7 GB at 32768 queries x 4 KV heads
x 16 slots), plus the pair lists.
"""
from __future__ import annotations

import numpy as np

from .._launch_cache import launch, note_const
from ..jit import get_kernel, register

GATHER_TILE = "gather"
SOURCE = "attention_gather.cu"
KERNELS = ("msa_gather_count_kernel", "msa_gather_scan_kernel", "msa_gather_scatter_kernel",
           "msa_gather_attn_kernel", "msa_gather_merge_kernel")
WIN = 2048  # queries per window (kWin)
CAP = 512  # queries per work item (kCap)
#: dtype code (0 fp16, 1 bf16) -> registered variant
SPECS = {code: register(SOURCE, KERNELS, min_sm=90, GATHER_DTYPE=code, GATHER_WIN=WIN, GATHER_CAP=CAP)
         for code in (0, 1)}
WGS = 3  # warpgroups of the attention kernel (kWGs)
D, BLOCK, GROUP = 128, 128, 16
ATTN_SMEM = 2 * BLOCK * D * 2 + 2 * WGS * 64 * D * 2 + 1024
MAX_KEYS = 1 << 20  # keys (request x window x KV head x block) one scan CTA handles
MAX_WIDTH = 128  # list slots per (query, KV head) the merge handles (kMaxWidth)
_ALIGN = 256


def applies(*, cc: int, dtype_code: int, head_dim: int, group: int, page_size: int, sparse_decode: bool,
            batch: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_kv: int, total_q: int,
            width: int) -> bool:
    """Whether the gather tile runs this call (else the default tile does)."""
    if cc != 90 or dtype_code not in (0, 1) or head_dim != D or group != GROUP or page_size != BLOCK:
        return False
    if sparse_decode or batch <= 0 or max_seqlen_q <= 0 or not 0 < width <= MAX_WIDTH:
        return False
    if total_q * num_heads_kv * width >= 2**31:
        return False
    return n_keys(batch, max_seqlen_q, max_seqlen_k, num_heads_kv) <= MAX_KEYS


def n_keys(batch: int, max_seqlen_q: int, max_seqlen_k: int, num_heads_kv: int) -> int:
    return batch * -(-max_seqlen_q // WIN) * num_heads_kv * max(1, -(-max_seqlen_k // BLOCK))


def workspace_layout(total_q: int, num_heads_kv: int, width: int, keys: int, max_pairs: int,
                     max_items: int) -> dict:
    """Byte offsets of the workspace parts (each 256-byte aligned) and the total."""
    parts = (("part_o", total_q * num_heads_kv * width * GROUP * D * 2),
             ("part_lse", total_q * num_heads_kv * width * GROUP * 4),
             ("cursors", keys * 4), ("items", max_items * 12), ("n_items", 8),
             ("pair_tok", max_pairs * 4), ("pair_slot", max_pairs * 4))
    off, lay = 0, {}
    for name, size in parts:
        lay[name] = (off, size)
        off += -(-size // _ALIGN) * _ALIGN
    lay["total"] = off
    return lay


# Zeroed int32 counters per device, newest last; older ones stay alive (queued kernels and
# recorded launches may still use them). The scan kernel zeroes what it used.
_COUNTS: dict = {}


def _counts(keys: int):
    import cupy

    bufs = _COUNTS.setdefault(cupy.cuda.Device().id, [])
    if bufs and bufs[-1].size >= keys:
        return bufs[-1]
    buf = cupy.zeros(max(keys, 2 * bufs[-1].size if bufs else 0, 1 << 12), dtype=np.int32)
    bufs.append(buf)
    return buf


def _bounds(total_q: int, num_heads_kv: int, width: int, batch: int, max_seqlen_q: int,
            max_seqlen_k: int) -> tuple:
    """(windows, blocks per request, keys, max pairs, max work items) of a call."""
    wins = -(-max_seqlen_q // WIN)
    nb_max = max(1, -(-max_seqlen_k // BLOCK))
    keys = n_keys(batch, max_seqlen_q, max_seqlen_k, num_heads_kv)
    max_pairs = min(total_q, batch * max_seqlen_q) * num_heads_kv * width
    max_items = max(1, min(-(-max_pairs // CAP) + min(keys, max_pairs), 2**31 - 1))
    return wins, nb_max, keys, max_pairs, max_items


def workspace_bytes(*, total_q: int, num_heads_kv: int, width: int, batch: int, max_seqlen_q: int,
                    max_seqlen_k: int) -> int:
    """Bytes of the workspace ``run_gather`` needs."""
    _, _, keys, max_pairs, max_items = _bounds(total_q, num_heads_kv, width, batch, max_seqlen_q, max_seqlen_k)
    return workspace_layout(total_q, num_heads_kv, width, keys, max_pairs, max_items)["total"]


def run_gather(*, q, k, v, out, lse, cu_seqlens_q, qo_lens, kv_lens, qo_offset, page_list, page_indptr,
               page_list_len: int, kv_block_indexes, q_strides, k_strides, v_strides, out_strides,
               kv_extent: int, num_heads_kv: int, batch: int, max_seqlen_q: int, max_seqlen_k: int,
               causal: bool, scale_log2: float, dtype_code: int, num_sms: int, workspace,
               workspace_cached: bool, stream) -> None:
    """Launch the five gather kernels (arguments checked by ``run_attention``): q [total_q,
    Hq, 128], k/v paged (page 128; strides (page, slot, head) in elements), out [total_q,
    Hq, 128] with strides ``out_strides``, lse [total_q, Hq] float32 or None,
    kv_block_indexes [total_q, Hkv, W] int32; ``workspace`` a uint8 array of at least
    :func:`workspace_bytes` (16-byte aligned; ``workspace_cached``: it outlives recorded
    launches)."""
    total_q = int(q.shape[0])
    width = int(kv_block_indexes.shape[2])
    hkv = int(num_heads_kv)
    wins, nb_max, keys, max_pairs, max_items = _bounds(total_q, hkv, width, batch, max_seqlen_q, max_seqlen_k)
    lay = workspace_layout(total_q, hkv, width, keys, max_pairs, max_items)
    counts = _counts(keys)

    def part(name, dtype):
        off, size = lay[name]
        return workspace[off:off + size].view(dtype)

    part_o, part_lse = part("part_o", np.float16), part("part_lse", np.float32)
    cursors, items, n_items = part("cursors", np.int32), part("items", np.int32), part("n_items", np.int32)
    pair_tok, pair_slot = part("pair_tok", np.int32), part("pair_slot", np.int32)
    n_total, work_counter = n_items[:1], n_items[1:]  # item count; the attention kernel's counter
    note_const(counts)
    if workspace_cached:
        note_const(part_o, part_lse, cursors, items, n_items, n_total, work_counter, pair_tok, pair_slot)

    null = np.uintp(0)
    geo = (kv_block_indexes, cu_seqlens_q, qo_lens, kv_lens, qo_offset, page_list,
           null if page_indptr is None else page_indptr, np.int32(page_list_len), np.int32(kv_extent),
           np.int32(total_q), np.int32(hkv), np.int32(width), np.int32(1 if causal else 0),
           np.int32(max_seqlen_q), np.int32(wins), np.int32(nb_max))
    spec = SPECS[int(dtype_code)]
    count_k, scan_k, scatter_k, attn_k, merge_k = (get_kernel(spec, name) for name in KERNELS)
    entries = (-(-max_seqlen_q * hkv * width // 256), batch)
    launch(count_k, entries, (256,), geo + (counts,), stream=stream)
    launch(scan_k, (1,), (1024,), (counts, cursors, items, n_items, np.int32(keys), np.int32(max_items),
                                    np.int32(max_pairs)), stream=stream)
    launch(scatter_k, entries, (256,), geo + (cursors, pair_tok, pair_slot, np.int32(max_pairs)), stream=stream)
    i64 = np.int64
    launch(attn_k, (max(1, min(max_items, num_sms)),), (128 * WGS,),  # persistent: one CTA per SM
           geo + (q, k, v, i64(q_strides[0]), i64(q_strides[1]), i64(k_strides[0]), i64(k_strides[1]),
                  i64(k_strides[2]), i64(v_strides[0]), i64(v_strides[1]), i64(v_strides[2]), items, n_total,
                  work_counter, pair_tok, pair_slot, part_o, part_lse, np.float32(scale_log2)),
           shared_mem=ATTN_SMEM, stream=stream)
    launch(merge_k, (max_seqlen_q, hkv, batch), (128,),
           geo + (part_o, part_lse, out, null if lse is None else lse, i64(out_strides[0]), i64(out_strides[1])),
           stream=stream)
