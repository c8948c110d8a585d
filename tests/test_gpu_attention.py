"""The attention kernels (``run_attention``) against the float64 references.

CPU tests pin the launcher to the kernel source (parameter order and types, shared
memory layout, tile and split choices). GPU tests (``-m gpu``) call
``run_attention`` directly on CuPy arrays: fresh random inputs, outputs poisoned
with NaN before every launch, every element compared. The CUDA-graph test captures
a static plan through the public API with torch tensors and replays it with new
runtime lengths.
"""
from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import rel_err, to_f64
from msa_cases import BF16, FP8, make_problem, random_selection

from mate_cupy.msa import attention_kernels as ak
from mate_cupy.reference import msa as R

F16 = np.dtype(np.float16)
TOL = {BF16: 1e-2, F16: 5e-3, FP8: 4e-2}
LSE_TOL = 1e-3
SRC = Path(ak.__file__).resolve().parent.parent / "cuda_src" / ak.SOURCE


# ============================================================================ CPU: launcher vs source


def _c_params(kernel: str, src: Path = SRC, macros: dict = {}) -> list:
    """(name, kind) of each parameter of ``kernel`` in ``src``, ``macros`` expanded first."""
    text = src.read_text()
    m = re.search(r"\b" + kernel + r"\s*\((.*?)\)\s*\{", text, re.S)
    assert m, kernel
    decls = m.group(1)
    for name, body in macros.items():
        decls = decls.replace(name, body)
    params = []
    for decl in decls.split(","):
        decl = " ".join(decl.replace("__restrict__", "").split())
        name = decl.split()[-1].lstrip("*")
        if "*" in decl:
            kind = "ptr"
        elif decl.startswith("long long"):
            kind = "i64"
        elif decl.startswith("int"):
            kind = "i32"
        elif decl.startswith("float"):
            kind = "f32"
        else:
            raise AssertionError(decl)
        params.append((name, kind))
    return params


@pytest.mark.parametrize("kernel,params", [("msa_attention_fwd_kernel", ak.FWD_PARAMS),
                                           ("msa_attention_merge_kernel", ak.MERGE_PARAMS)])
def test_launcher_arguments_match_kernel_signature(kernel, params):
    assert _c_params(kernel) == list(params)


def _gather_params(kernel: str) -> list:
    """Parameter kinds of a kernel of attention_gather.cu (GATHER_GEOMETRY_ARGS expanded)."""
    src = SRC.parent / "attention_gather.cu"
    geo = re.search(r"#define GATHER_GEOMETRY_ARGS(.*?)\n\n", src.read_text(), re.S).group(1).replace("\\\n", " ")
    return [kind for _, kind in _c_params(kernel, src, {"GATHER_GEOMETRY_ARGS": geo})]


def test_gather_launcher_arguments_match_kernel_signatures(monkeypatch):
    """Every launch of run_gather passes each kernel its parameters in order and type."""
    from mate_cupy.msa import gather_kernels as gk

    launches = []
    monkeypatch.setattr(gk, "launch", lambda kern, grid, block, args, shared_mem=0, stream=None:
                        launches.append((kern, grid, block, args, shared_mem)))
    monkeypatch.setattr(gk, "get_kernel", lambda spec, name: name)
    monkeypatch.setattr(gk, "_counts", lambda keys: np.zeros(keys, np.int32))
    total_q, hkv, width = 40, 2, 16
    arr = lambda *shape: np.zeros(shape, np.float32)  # noqa: E731
    i32 = lambda n: np.zeros(n, np.int32)  # noqa: E731
    gk.run_gather(q=arr(total_q, 32, 128), k=arr(3, 128, hkv, 128), v=arr(3, 128, hkv, 128),
                  out=arr(total_q, 32, 128), lse=None, cu_seqlens_q=i32(3), qo_lens=i32(2), kv_lens=i32(2),
                  qo_offset=i32(2), page_list=np.zeros((2, 3), np.int32), page_indptr=None, page_list_len=3,
                  kv_block_indexes=np.zeros((total_q, hkv, width), np.int32), q_strides=(4096, 128),
                  k_strides=(32768, 256, 128), v_strides=(32768, 256, 128), out_strides=(4096, 128), kv_extent=3,
                  num_heads_kv=hkv, batch=2, max_seqlen_q=30, max_seqlen_k=300, causal=True, scale_log2=0.1,
                  dtype_code=1, num_sms=132, stream=None, workspace_cached=True,
                  workspace=np.empty(gk.workspace_bytes(total_q=total_q, num_heads_kv=hkv, width=width, batch=2,
                                                        max_seqlen_q=30, max_seqlen_k=300), np.uint8))
    assert [x[0] for x in launches] == list(gk.KERNELS)
    for kern, grid, block, args, smem in launches:
        kinds = _gather_params(kern)
        assert len(args) == len(kinds), kern
        for a, kind in zip(args, kinds):
            if kind == "ptr":
                assert isinstance(a, (np.ndarray, np.uintp)), (kern, type(a))
            else:
                assert type(a) is {"i32": np.int32, "i64": np.int64, "f32": np.float32}[kind], (kern, kind, a)
    attn = launches[3]
    assert attn[1] == (min(132, attn[1][0]),) and attn[2] == (128 * gk.WGS,) and attn[4] == gk.ATTN_SMEM
    assert gk.ATTN_SMEM <= ak.SMEM_LIMIT


def test_every_variant_fits_shared_memory_and_occupancy():
    for (d, code, kind, kv), spec in ak._SPECS.items():
        cfg = ak.tile_config(kind, d, code)
        lay = ak.smem_layout(cfg, d, code)
        assert dict(spec.defines)["ATT_SMEM_FIXED"] == str(lay["fixed"])
        assert dict(spec.defines)["ATT_WGMMA"] == str(int(cfg.wgmma))
        pad = ak.WG_PAD if cfg.wgmma else 0
        extra = ak.sparse_smem_bytes(cfg.rows // 8 + 2, 16)[0] if kv == 2 else 0  # group >= 8, 16 blocks
        assert lay["fixed"] + pad + extra <= ak.SMEM_LIMIT, spec.name
        if cfg.wgmma:
            assert spec.min_sm == 90 and code in (0, 1) and d in (64, 128)
            # tiles on 1024-byte boundaries (the hardware swizzle keys on address bits 7-9)
            assert lay["q"] % 1024 == 0 and (2 * cfg.block_n * d * 2) % 1024 == 0
        if kind == "prefill" and d <= 128:
            assert 2 * (lay["fixed"] + 1024) <= ak.SMEM_PER_SM, spec.name  # two CTAs per SM
        # the e4m3 PV product needs 32 keys per warp, the 16-bit one 16
        assert cfg.block_n // cfg.warps_n % (32 if code == 2 else 16) == 0


def _geo(**kw):
    base = dict(batch=1, num_heads_kv=8, group=8, head_dim=128, dtype_code=1, max_seqlen_q=8192,
                max_seqlen_k=8192, sparse=False, sparse_decode=False, list_width=0, num_kv_splits=-1,
                num_sms=132)
    base.update(kw)
    return ak.launch_geometry(**base)


def test_launch_geometry_choices():
    # the default prefill tile on an H200, and the mma.sync tile everywhere else
    g = _geo()
    assert g.kind == ak.DEFAULT_PREFILL_TILE and g.splits == 1
    assert g.grid == (-(-8192 * 8 // g.cfg.rows), 1, 8)
    assert _geo(cc=80).kind == "prefill" and _geo(head_dim=256).kind == "prefill"
    g = _geo(prefill_tile="prefill")
    assert g.kind == "prefill" and g.splits == 1 and g.grid == (8192 * 8 // 128, 1, 8)
    # single-token decode packs the 8 heads of a group into one 16-row tile
    g = _geo(batch=64, max_seqlen_q=1)
    assert g.kind == "decode" and g.grid[:2] == (1, 64) and g.splits == 1
    # too few CTAs to fill the GPU: split the keys
    g = _geo(batch=8, max_seqlen_q=1, max_seqlen_k=65536)
    assert g.splits > 1 and g.grid[2] == 8 * g.splits
    assert _geo(batch=8, max_seqlen_q=1, max_seqlen_k=65536, num_kv_splits=5).splits == 5
    assert _geo(batch=8, max_seqlen_q=1, max_seqlen_k=65536, num_kv_splits=1).splits == 1
    # sparse: 128-row tiles for group >= 8, 16-row tiles otherwise or when asked for
    g = _geo(sparse=True, list_width=16, max_seqlen_q=32768, max_seqlen_k=32768, num_heads_kv=4, group=16,
             prefill_tile="prefill")
    assert g.kind == "prefill" and g.nq_cap == 9 and g.qmask_words == (9 * 16 + 31) // 32
    assert _geo(sparse=True, list_width=16, max_seqlen_q=32768, num_heads_kv=4, group=16).kind == ak.DEFAULT_SPARSE_TILE
    assert _geo(sparse=True, list_width=16, group=4).kind == "decode"
    assert _geo(sparse=True, list_width=16, sparse_decode=True, max_seqlen_q=4).kind == "decode"


def test_prefill_tile_choice():
    # named tiles apply only where they exist; unknown names are refused
    assert ak.choose_prefill_tile(None, head_dim=128, dtype_code=1, sparse=False, cc=90) == ak.DEFAULT_PREFILL_TILE
    assert ak.choose_prefill_tile("wg2n128s2", head_dim=128, dtype_code=1, sparse=False, cc=90) == "wg2n128s2"
    assert ak.choose_prefill_tile("wg2n128s2", head_dim=256, dtype_code=1, sparse=False, cc=90) != "wg2n128s2"
    assert ak.choose_prefill_tile("wg2n128s2", head_dim=128, dtype_code=2, sparse=False, cc=90) != "wg2n128s2"
    assert ak.choose_prefill_tile("wg2n128s2", head_dim=128, dtype_code=0, sparse=True, cc=80) != "wg2n128s2"
    assert ak.choose_prefill_tile("mma256", head_dim=128, dtype_code=1, sparse=False, cc=90) != "mma256"
    assert ak.choose_prefill_tile("mma256", head_dim=128, dtype_code=2, sparse=True, cc=90) == "mma256"
    with pytest.raises(ValueError, match="unknown attention prefill tile"):
        ak.choose_prefill_tile("wg9", head_dim=128, dtype_code=1, sparse=False, cc=90)
    for name in [n for n in ak.PREFILL_TILES if ak.tile_applies(n, 128, 1, False, 90)]:
        g = _geo(prefill_tile=name)
        cfg = ak.tile_config(name, 128, 1)
        assert g.cfg == cfg and g.grid == (-(-8192 * 8 // cfg.rows), 1, 8)
        assert g.smem == ak.smem_layout(cfg, 128, 1)["fixed"] + (ak.WG_PAD if cfg.wgmma else 0)
    # decode-sized calls never take a prefill tile
    assert _geo(batch=64, max_seqlen_q=1, prefill_tile="wg2n128s2").kind == "decode"
    g = _geo(sparse=True, list_width=16, max_seqlen_q=32768, max_seqlen_k=32768, num_heads_kv=4, group=16,
             prefill_tile="mma256")
    assert g.cfg.rows == 256 and g.nq_cap == 17


def _cute_tv(shape, stride, t, v):
    """Offset of (thread t, value v) in a CuTe TV layout ((4,8,4),(vshape)):((ts),(vs))."""
    (ts_shape, vs_shape), (ts_stride, vs_stride) = shape, stride
    off = 0
    for x, sh, st in ((t, ts_shape, ts_stride), (v, vs_shape, vs_stride)):
        for n, d in zip(sh, st):
            off += (x % n) * d
            x //= n
    return off


def test_wgmma_fragment_model():
    """The wgmma register layouts (CUTLASS CLayout_64xN / ALayout_64x16, column-major
    M x N offsets) give the per-warp mma.m16n8k16 layouts the kernel assumes: d[4i + j]
    is row 16w + g + 8(j//2), column 8i + 2t + j%2; the P packing of S (pa[kk][r] =
    pack(S[2kk + r//2][2(r%2)], S[2kk + r//2][2(r%2) + 1])) is the register A operand of
    key step kk; the epilogue reads O[d][j] at the same positions."""
    n = 128
    c_shape, c_stride = ((4, 8, 4), (2, 2, n // 8)), ((128, 1, 16), (64, 8, 512))
    a_shape, a_stride = ((4, 8, 4), (2, 2, 2)), ((128, 1, 16), (64, 8, 512))
    for tid in range(128):
        w, lane = tid // 32, tid % 32
        g, t = lane // 4, lane % 4
        for i in range(n // 8):
            for j in range(4):
                off = _cute_tv(c_shape, c_stride, tid, 4 * i + j)
                assert (off % 64, off // 64) == (16 * w + g + 8 * (j // 2), 8 * i + 2 * t + j % 2)
        for kk in range(n // 16):
            for r in range(4):
                for h in range(2):
                    # A element of register r, half h (value 2r + h), as a (row, k) pair
                    off = _cute_tv(a_shape, a_stride, tid, 2 * r + h)
                    want = (off % 64, 16 * kk + off // 64)
                    # what the kernel packs there: S accumulator (n8 tile, index)
                    i, j = 2 * kk + r // 2, 2 * (r % 2) + h
                    got = (16 * w + g + 8 * (j // 2), 8 * i + 2 * t + j % 2)
                    assert got == want


def _sw128(addr):
    """The 128-byte swizzle the hardware applies to a shared address: bits [4,7) ^= bits [7,10)."""
    return addr ^ (((addr >> 7) & 7) << 4)


def _column_block_offset(rows, row, col):
    """Byte offset of 16-bit element (row, col) in a ColumnBlockTile<rows> (attention_wgmma.cuh)."""
    c = col // 8
    return (c >> 3) * rows * 128 + row * 128 + (((c & 7) ^ (row & 7)) << 4) + (col % 8) * 2


@pytest.mark.parametrize("rows_q,bn,d", [(128, 128, 128), (128, 64, 128), (192, 64, 128), (128, 128, 64)])
def test_wgmma_shared_layout_model(rows_q, bn, d):
    """The bytes each wgmma reads (canonical SW128 layouts from the descriptors the kernel
    builds: K-major ((8,m),(8 chunks)) : ((128 B, SBO), (16 B)); MN-major ((8 chunks, n),
    (8, k)) : ((16 B, LBO), (128 B, SBO)), swizzled on absolute address bits) hold the
    elements the loaders wrote there (ColumnBlockTile offsets), for every k-step."""
    base = 3 * 1024 * 64  # any 1024-byte aligned shared address
    sbo = 1024
    # S = Q K^T: warpgroup wg reads Q rows 64wg.. (A) and all bn keys (B), 16 dims per k-step
    for ks in range(d // 16):
        for wg in range(rows_q // 64):
            start = base + wg * 64 * 128 + (ks >> 2) * rows_q * 128 + (ks & 3) * 32
            for m in range(64):
                for k in range(16):
                    hw = _sw128(start + (m // 8) * sbo + (m % 8) * 128 + 2 * k)
                    assert hw == base + _column_block_offset(rows_q, 64 * wg + m, 16 * ks + k)
        start = base + (ks >> 2) * bn * 128 + (ks & 3) * 32
        for nn in range(bn):
            for k in range(16):
                hw = _sw128(start + (nn // 8) * sbo + (nn % 8) * 128 + 2 * k)
                assert hw == base + _column_block_offset(bn, nn, 16 * ks + k)
    # O += P V: key step kk, 64-dim column block cb (N = 64, MN-major, transposed B)
    for kk in range(bn // 16):
        for cb in range(d // 64):
            start = base + cb * bn * 128 + kk * 2048
            for k in range(16):
                for nn in range(64):
                    hw = _sw128(start + (k // 8) * sbo + (k % 8) * 128 + 2 * nn)
                    assert hw == base + _column_block_offset(bn, 16 * kk + k, 64 * cb + nn)


def test_wgmma_descriptor_bits():
    """wg_desc field positions (CUTLASS GmmaDescriptor): start >> 4 at [0,14), LBO >> 4 at
    [16,30), SBO >> 4 at [32,46), base offset 0, layout type 1 (128-byte swizzle) at [62,64)."""
    text = (SRC.parent / "common" / "attention_wgmma.cuh").read_text()
    body = text[text.index("u64 wg_desc("):text.index("wg_desc_add")]
    assert "(saddr >> 4) & 0x3FFFu" in body and "(lbo >> 4) & 0x3FFFu) << 16" in body
    assert "(sbo >> 4) & 0x3FFFu) << 32" in body and "1ull << 62" in body
    kernel = SRC.read_text()
    # Q/K descriptors: SBO 1024 (8-row groups); V: the same, transposed (imm-trans-b = 1)
    assert kernel.count("wg_desc(") == 3 and kernel.count(", 16, 1024)") == 3
    assert "p, 1, 1, 1;" in text and "p, 1, 1, 0, 0;" in text


def test_split_choice_is_monotone_in_occupancy():
    assert ak.choose_splits(1000, 100, 132, 2) == 1
    assert ak.choose_splits(64, 1, 132, 2) == 1
    s = ak.choose_splits(64, 512, 132, 2)
    assert 2 <= s <= ak.MAX_SPLITS and 64 * s >= 0.8 * 264 * 0.85


def test_sparse_context_limit_is_refused():
    lay = ak.smem_layout(ak.tile_config("prefill", 128, 1), 128, 1)
    with pytest.raises(NotImplementedError, match="max_seqlen_k"):
        _geo(sparse=True, list_width=16, max_seqlen_k=lay["union_blocks"] * 128 + 1, prefill_tile="prefill")


def test_non_positive_scale_is_refused_before_launch():
    q = np.zeros((2, 4, 128), np.float16)
    kv = np.zeros((2, 4, 128), np.float16)
    ints = dict(cu_seqlens_q=np.array([0, 2], np.int32), qo_lens=np.array([2], np.int32),
                kv_lens=np.array([2], np.int32), qo_offset=np.array([0], np.int32),
                cu_seqlens_k=np.array([0, 2], np.int32))
    for scale in (0.0, -1.0, float("nan")):
        with pytest.raises(NotImplementedError, match="softmax scale"):
            ak.run_attention(q, kv, kv, np.zeros_like(q), None, **ints, max_seqlen_q=2, max_seqlen_k=2,
                             causal=True, sm_scale=scale)


def _byte_perm(x: int, y: int, sel: int) -> int:
    pool = [(x >> (8 * i)) & 0xFF for i in range(4)] + [(y >> (8 * i)) & 0xFF for i in range(4)]
    return sum(pool[(sel >> (4 * i)) & 0xF] << (8 * i) for i in range(4))


def test_e4m3_pv_fragment_model():
    """A model of the e4m3 O += P V step, built from the PTX fragment layouts.

    ldmatrix.x4.trans over 4 groups of 8 keys x 16 bytes, the byte permutes of
    ldsm_vt_e4m3, pack4_e4m3 of the S accumulators and mma.m16n8k32 must give
    P @ V, with the even/odd output dims that the epilogue stores.
    """
    rng = np.random.default_rng(0)
    P = rng.integers(0, 7, size=(16, 32))  # rows x keys (small ints: exact)
    V = rng.integers(0, 7, size=(32, 16))  # keys x dims of one 16-byte chunk
    reg = lambda b: sum(int(v) << (8 * i) for i, v in enumerate(b))  # noqa: E731
    byte = lambda r, j: (r >> (8 * j)) & 0xFF  # noqa: E731
    A = np.zeros((16, 32), np.int64)
    Be = np.zeros((32, 8), np.int64)
    Bo = np.zeros((32, 8), np.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        # S accumulators of n-tiles 0..3 (keys 8j..8j+7): c0,c1 row g, c2,c3 row g+8
        s = [[P[g, 8 * j + 2 * t], P[g, 8 * j + 2 * t + 1], P[g + 8, 8 * j + 2 * t], P[g + 8, 8 * j + 2 * t + 1]]
             for j in range(4)]
        pa = [reg([s[0][0], s[0][1], s[1][0], s[1][1]]), reg([s[0][2], s[0][3], s[1][2], s[1][3]]),
              reg([s[2][0], s[2][1], s[3][0], s[3][1]]), reg([s[2][2], s[2][3], s[3][2], s[3][3]])]
        # ldmatrix .trans, matrix m = keys 8m..8m+7: low half row 2t, high half row 2t+1, column pair g
        r = [reg([V[8 * m + 2 * t, 2 * g], V[8 * m + 2 * t, 2 * g + 1],
                  V[8 * m + 2 * t + 1, 2 * g], V[8 * m + 2 * t + 1, 2 * g + 1]]) for m in range(4)]
        even = [_byte_perm(r[0], r[1], 0x6420), _byte_perm(r[2], r[3], 0x6420)]
        odd = [_byte_perm(r[0], r[1], 0x7531), _byte_perm(r[2], r[3], 0x7531)]
        for i in range(4):  # A (m16n8k32, 8-bit): a_i byte j -> row g + 8(i%2), k 4t + j + 16(i//2)
            for j in range(4):
                A[g + 8 * (i % 2), 4 * t + j + 16 * (i // 2)] = byte(pa[i], j)
        for i in range(2):  # B: b_i byte j -> k 4t + j + 16 i, n g
            for j in range(4):
                Be[4 * t + j + 16 * i, g] = byte(even[i], j)
                Bo[4 * t + j + 16 * i, g] = byte(odd[i], j)
    De, Do = A @ Be, A @ Bo
    want = P @ V
    # epilogue: lane (g, t) stores {even c0, odd c0, even c1, odd c1} at dims 4t..4t+3 of row g
    got = np.zeros((16, 16), np.int64)
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for h in range(2):
            row = g + 8 * h
            got[row, 4 * t:4 * t + 4] = [De[row, 2 * t], Do[row, 2 * t], De[row, 2 * t + 1], Do[row, 2 * t + 1]]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("row_bytes", [64, 128, 256, 512])
def test_swizzled_lane_offsets_xor_identity(row_bytes):
    """lane offset ^ (32 * step) == swizzled offset of chunk 2*step + x (SwizzledTile, attention_tile.cuh)."""
    chunks = row_bytes // 16

    def chunk(row, c):
        return c ^ (row & 7) if chunks >= 8 else c ^ ((row >> 1) & 3)

    def offset(row, c):
        return row * row_bytes + chunk(row, c) * 16

    for row in range(64):
        for x in (0, 1):
            lane_off = row * row_bytes + ((16 * x) ^ (chunk(row, 0) * 16))
            for step in range(chunks // 2):
                assert lane_off ^ (32 * step) == offset(row, 2 * step + x)
        for c in range(chunks):  # e4m3 V: lane offset ^ (16 * c)
            assert (row * row_bytes + chunk(row, 0) * 16) ^ (16 * c) == offset(row, c)


# ============================================================================ GPU helpers


def _cp(x):
    import cupy

    x = np.asarray(x)
    if x.dtype == FP8:
        return cupy.asarray(x.view(np.uint8))
    return cupy.asarray(x)


def _poison(shape, dtype):
    """NaN-filled device array, made on the host (works for bf16 too)."""
    import cupy

    return cupy.asarray(np.full(shape, np.nan, dtype=np.float32).astype(dtype))


def _run(p, *, causal=True, qo_offset=None, kv_lens=None, source="dense", sel=None, sm_scale=None,
         k_scale=1.0, v_scale=1.0, splits=-1, sparse_decode=False, table=None, with_lse=True, q=None, out=None,
         max_seqlen_q=None, max_seqlen_k=None, tile=None):
    """Launch run_attention on the problem's arrays; returns (out, lse) as host arrays."""
    import cupy

    fp8 = p.q.dtype == FP8
    d = p.q.shape[2]
    offs = (p.kv - p.qo) if qo_offset is None else np.asarray(qo_offset)
    kvl = p.kv if kv_lens is None else np.asarray(kv_lens)
    q = _cp(p.q) if q is None else q
    out = _poison(p.q.shape, BF16 if fp8 else p.q.dtype) if out is None else out
    lse = _poison((p.total_q, p.hq), np.float32) if with_lse else None
    kw = dict(cu_seqlens_q=_cp(p.cu_q), qo_lens=_cp(p.qo), kv_lens=_cp(kvl.astype(np.int32)),
              qo_offset=_cp(offs.astype(np.int32)),
              max_seqlen_q=int(p.qo.max()) if max_seqlen_q is None else max_seqlen_q,
              max_seqlen_k=int(kvl.max()) if max_seqlen_k is None else max_seqlen_k, causal=causal,
              sm_scale=1.0 / math.sqrt(d) if sm_scale is None else sm_scale, k_scale=k_scale, v_scale=v_scale,
              is_fp8=fp8, num_kv_splits=splits, sparse_decode=sparse_decode, prefill_tile=tile)
    if source == "dense":
        k, v = _cp(p.k), _cp(p.v)
        kw.update(cu_seqlens_k=_cp(p.cu_k), page_size=0)
    else:
        k, v = _cp(p.k_cache), _cp(p.v_cache)
        kw.update(page_size=p.page_size, kv_layout=p.layout)
        tbl = p.page_table if table is None else table
        if source == "table":
            kw.update(page_table=_cp(tbl))
        else:
            counts = -(-kvl.astype(np.int64) // p.page_size)
            indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            flat = np.concatenate([tbl[b, :c] for b, c in enumerate(counts)] + [np.zeros(0, np.int32)])
            kw.update(kv_indices=_cp(flat.astype(np.int32)), kv_page_indptr=_cp(indptr))
    if sel is not None:
        kw.update(kv_block_indexes=_cp(sel))
    ak.run_attention(q, k, v, out, lse, **kw)
    cupy.cuda.get_current_stream().synchronize()
    return out, lse


def _check(out, lse, ref, dtype, what, check_lse=True):
    o = to_f64(out)
    ref_o, ref_l = ref
    err = rel_err(o, ref_o)
    assert err <= TOL[np.dtype(dtype)], f"{what}: out relative error {err:.3e}"
    if lse is not None and check_lse:
        l = to_f64(lse)
        fin = np.isfinite(ref_l)
        assert np.array_equal(np.isfinite(l), fin), f"{what}: lse finiteness differs"
        assert np.all(l[~fin] == -np.inf), f"{what}: rows without keys must have lse = -inf"
        if fin.any():
            e = np.max(np.abs(l[fin] - ref_l[fin]))
            assert e <= LSE_TOL, f"{what}: lse max abs error {e:.3e}"
    # rows without any admissible key are exact zeros
    empty = ~np.isfinite(ref_l)
    assert np.all(o[empty] == 0.0), f"{what}: rows without keys must be 0"


def _dense_ref(p, causal=True, qo_offset=None, kv_lens=None, **kw):
    offs = (p.kv - p.qo) if qo_offset is None else np.asarray(qo_offset)
    return R.dense_attention(p.q, p.k, p.v, p.cu_q, p.cu_k, qo_offset=offs, causal=causal,
                             kv_lens=None if kv_lens is None else np.asarray(kv_lens), **kw)


def _paged_ref(p, table=None, causal=True, kv_lens=None):
    kvl = p.kv if kv_lens is None else np.asarray(kv_lens)
    return R.paged_attention(p.q, p.k_cache, p.v_cache, p.cu_q, kvl, p.page_table if table is None else table,
                             qo_offset=(p.kv - p.qo), causal=causal, kv_layout=p.layout)


def _sparse_ref(p, sel, table=None, **kw):
    return R.sparse_attention(p.q, p.k_cache, p.v_cache, p.cu_q, p.kv, p.page_table if table is None else table,
                              sel, qo_offset=(p.kv - p.qo), kv_layout=p.layout, **kw)


# varlen batch: empty request, single tokens, lengths off the 64/128 tiles, kv shorter than q (offset < 0)
QO = [1, 0, 77, 300, 5, 130]
KV = [1, 9, 77, 420, 0, 100]
HEADS = [(4, 4), (16, 4), (32, 4), (32, 2)]  # GQA 1, 4, 8, 16


# ============================================================================ GPU: dense


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv", HEADS, ids=[f"r{a // b}" for a, b in HEADS])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense_varlen(rng, dtype, hq, hkv, d, causal):
    p = make_problem(rng, QO, KV, hq, hkv, d, dtype=dtype)
    out, lse = _run(p, causal=causal)
    _check(out, lse, _dense_ref(p, causal=causal), dtype, f"dense d{d} r{hq // hkv}")


@pytest.mark.gpu
def test_dense_offsets_and_short_kv_lens(rng):
    # explicit offsets (negative: leading rows see no key), kv_lens shorter than the rows in cu_seqlens_k
    p = make_problem(rng, [40, 200, 3], [300, 200, 50], 16, 2, 128)
    offs = np.array([-10, 0, 700], np.int64)
    kvl = np.array([250, 199, 50], np.int32)
    out, lse = _run(p, qo_offset=offs, kv_lens=kvl)
    _check(out, lse, _dense_ref(p, qo_offset=offs, kv_lens=kvl), BF16, "dense offsets")


@pytest.mark.gpu
def test_dense_without_lse_and_strided_views(rng):
    p = make_problem(rng, [70, 129], [70, 300], 8, 1, 128)
    # q and out are views with a padded token stride (head dim contiguous)
    qh = np.zeros((p.total_q, 8, 256), dtype=BF16)
    qh[:, :, :128] = p.q
    qbig = _cp(qh)
    obig = _poison((p.total_q, 8, 256), BF16)
    out, _ = _run(p, q=qbig[:, :, :128], out=obig[:, :, :128], with_lse=False)
    assert rel_err(to_f64(out), _dense_ref(p)[0]) <= TOL[BF16]
    assert np.isnan(to_f64(obig)[:, :, 128:]).all(), "the kernel wrote outside the out view"


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 7, -1])
def test_dense_decode_split_kv(rng, splits):
    p = make_problem(rng, [1] * 6, [2000, 1, 0, 513, 4096, 64], 32, 4, 128)
    out, lse = _run(p, splits=splits)
    _check(out, lse, _dense_ref(p), BF16, f"dense decode splits={splits}")


@pytest.mark.gpu
def test_prefill_split_kv(rng):
    # the prefill tile with a forced split and a merge
    p = make_problem(rng, [300, 17], [1000, 40], 8, 8, 64)
    out, lse = _run(p, splits=4)
    _check(out, lse, _dense_ref(p), BF16, "prefill splits=4")


# ============================================================================ GPU: paged


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("source", ["table", "csr"])
def test_paged(rng, page_size, layout, source):
    p = make_problem(rng, [1, 90, 0, 200], [700, 90, 33, 450], 16, 2, 128, page_size=page_size, layout=layout)
    out, lse = _run(p, source=source)
    _check(out, lse, _paged_ref(p), BF16, f"paged {page_size} {layout} {source}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 256])
@pytest.mark.parametrize("hq,hkv", [(8, 8), (32, 4)])
def test_paged_head_dims(rng, d, hq, hkv):
    p = make_problem(rng, [3, 150], [400, 150], hq, hkv, d, dtype=F16, page_size=32)
    out, lse = _run(p, source="table")
    _check(out, lse, _paged_ref(p), F16, f"paged d{d}")


@pytest.mark.gpu
def test_paged_invalid_page_ids_are_masked(rng):
    p = make_problem(rng, [1, 60], [500, 300], 8, 1, 128, page_size=64)
    table = p.page_table.copy()
    n_pages = p.k_cache.shape[0]
    table[0, 2] = n_pages + 5  # past the cache
    table[0, 5] = -3
    table[1, 1] = 2**31 - 1
    out, lse = _run(p, source="table", table=table)
    _check(out, lse, _paged_ref(p, table=table), BF16, "paged invalid ids")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [-1, 6])
def test_paged_decode_split_kv(rng, splits):
    p = make_problem(rng, [1] * 5, [8192, 3000, 1, 0, 777], 64, 8, 128, page_size=64)
    out, lse = _run(p, source="table", splits=splits)
    _check(out, lse, _paged_ref(p), BF16, f"paged decode splits={splits}")


# ============================================================================ GPU: block-sparse


def _corrupt(rng, sel, p):
    """Add -1 holes, ids past the request's blocks and far out-of-range ids."""
    sel = sel.copy()
    for row in range(sel.shape[0]):
        b = int(np.searchsorted(p.cu_q, row, side="right") - 1)
        nb = -(-int(p.kv[b]) // 128)
        for h in range(sel.shape[1]):
            free = np.flatnonzero(sel[row, h] < 0)
            if free.size and rng.random() < 0.5:
                sel[row, h, free[0]] = nb + int(rng.integers(0, 3))  # just past the end
            if free.size > 1 and rng.random() < 0.3:
                sel[row, h, free[1]] = 1 << 30
            if free.size > 2 and rng.random() < 0.3:
                sel[row, h, free[2]] = -7
    return sel


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv", [(32, 4), (32, 2), (8, 8), (16, 4)], ids=["r8", "r16", "r1", "r4"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_sparse_prefill_per_token_lists(rng, hq, hkv, layout):
    p = make_problem(rng, [300, 1, 70], [1200, 129, 70], hq, hkv, 128, page_size=128, layout=layout)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    out, lse = _run(p, source="table", sel=sel)
    _check(out, lse, _sparse_ref(p, sel), BF16, f"sparse r{hq // hkv} {layout}")


@pytest.mark.gpu
def test_sparse_same_blocks_per_query_tile(rng):
    # the benchmark pattern: every query of a 128-query tile lists the same blocks (unsorted here)
    p = make_problem(rng, [512], [4096], 32, 2, 128, page_size=128)
    sel = np.full((512, 2, 16), -1, np.int32)
    for t in range(4):
        for h in range(2):
            reach = (4096 - 512 + 128 * t) // 128 + 1
            blocks = rng.choice(reach, size=16, replace=False).astype(np.int32)
            sel[128 * t:128 * (t + 1), h] = blocks[::-1]
    out, lse = _run(p, source="table", sel=sel)
    _check(out, lse, _sparse_ref(p, sel), BF16, "sparse tile-shared lists")


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [-1, 1, 3])
@pytest.mark.parametrize("source", ["table", "csr"])
def test_sparse_decode(rng, splits, source):
    p = make_problem(rng, [1, 4, 1, 2], [5000, 300, 129, 1], 16, 1, 128, page_size=128)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    table = p.page_table.copy()
    table[0, 3] = 10**6  # a selected block may sit on an invalid page: skipped
    out, lse = _run(p, source=source, sel=sel, splits=splits, sparse_decode=True, table=table)
    _check(out, lse, _sparse_ref(p, sel, table=table), BF16, f"sparse decode {source} splits={splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("decode", [False, True], ids=["prefill", "decode"])
def test_sparse_fp8(rng, decode):
    qo = [2, 1, 3] if decode else [200, 40]
    kv = [900, 300, 129] if decode else [700, 40]
    p = make_problem(rng, qo, kv, 16, 1, 128, dtype=FP8, page_size=128)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    out, lse = _run(p, source="table", sel=sel, k_scale=0.7, v_scale=1.3, sparse_decode=decode)
    assert out.dtype == BF16
    _check(out, lse, _sparse_ref(p, sel, k_scale=0.7, v_scale=1.3), FP8, "sparse fp8")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fp8_dense_and_paged(rng, d):
    p = make_problem(rng, [1, 100], [300, 100], 16, 2, d, dtype=FP8, page_size=64)
    out, lse = _run(p, k_scale=0.5, v_scale=2.0)
    _check(out, lse, _dense_ref(p, k_scale=0.5, v_scale=2.0), FP8, f"fp8 dense d{d}")
    out, lse = _run(p, source="table", splits=2)
    _check(out, lse, _paged_ref(p), FP8, f"fp8 paged d{d}")


@pytest.mark.gpu
def test_split_workspace_is_reused(rng):
    p = make_problem(rng, [1, 1], [3000, 2000], 16, 2, 128)
    _run(p, splits=4)
    before = [b.data.ptr for b in ak._WORKSPACES.get(0, [])]
    out, lse = _run(p, splits=4)
    assert [b.data.ptr for b in ak._WORKSPACES.get(0, [])] == before
    _check(out, lse, _dense_ref(p), BF16, "reused workspace")


# ============================================================================ GPU: prefill tiles

WG_TILES = list(ak.WG_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("tile", WG_TILES)
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (32, 4), (32, 2)], ids=["r1", "r8", "r16"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense_varlen_wgmma_tiles(rng, tile, dtype, hq, hkv, d, causal):
    p = make_problem(rng, QO, KV, hq, hkv, d, dtype=dtype)
    out, lse = _run(p, causal=causal, tile=tile)
    _check(out, lse, _dense_ref(p, causal=causal), dtype, f"{tile} dense d{d} r{hq // hkv}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", WG_TILES)
def test_wgmma_tiles_offsets_views_and_splits(rng, tile):
    p = make_problem(rng, [40, 200, 3], [300, 200, 50], 16, 2, 128)
    offs = np.array([-10, 0, 700], np.int64)
    kvl = np.array([250, 199, 50], np.int32)
    out, lse = _run(p, qo_offset=offs, kv_lens=kvl, tile=tile)
    _check(out, lse, _dense_ref(p, qo_offset=offs, kv_lens=kvl), BF16, f"{tile} offsets")
    out, lse = _run(p, splits=3, tile=tile)
    _check(out, lse, _dense_ref(p), BF16, f"{tile} splits=3")
    p = make_problem(rng, [70, 129], [70, 300], 8, 1, 128)
    qh = np.zeros((p.total_q, 8, 256), dtype=BF16)
    qh[:, :, :128] = p.q
    obig = _poison((p.total_q, 8, 256), BF16)
    out, _ = _run(p, q=_cp(qh)[:, :, :128], out=obig[:, :, :128], with_lse=False, tile=tile)
    assert rel_err(to_f64(out), _dense_ref(p)[0]) <= TOL[BF16]
    assert np.isnan(to_f64(obig)[:, :, 128:]).all(), "the kernel wrote outside the out view"


@pytest.mark.gpu
@pytest.mark.parametrize("tile", WG_TILES)
@pytest.mark.parametrize("page_size,layout,source", [(16, "NHD", "table"), (64, "HND", "csr"), (128, "NHD", "csr"),
                                                     (256, "HND", "table")])
def test_paged_wgmma_tiles(rng, tile, page_size, layout, source):
    p = make_problem(rng, [1, 90, 0, 200], [700, 90, 33, 450], 16, 2, 128, page_size=page_size, layout=layout)
    out, lse = _run(p, source=source, tile=tile)
    _check(out, lse, _paged_ref(p), BF16, f"{tile} paged {page_size} {layout} {source}")
    if page_size == 64:
        table = p.page_table.copy()
        table[3, 1] = p.k_cache.shape[0] + 5  # invalid ids: masked
        table[1, 0] = -3
        out, lse = _run(p, source="table", table=table, tile=tile)
        _check(out, lse, _paged_ref(p, table=table), BF16, f"{tile} paged invalid ids")


SPARSE_TILES = list(ak.MMA256_TILES) + WG_TILES


@pytest.mark.gpu
@pytest.mark.parametrize("tile", SPARSE_TILES)
@pytest.mark.parametrize("hq,hkv,dtype", [(32, 4, BF16), (32, 2, BF16), (64, 4, F16)], ids=["r8", "r16", "r16h"])
def test_sparse_prefill_tiles_per_token_lists(rng, tile, hq, hkv, dtype):
    p = make_problem(rng, [300, 1, 70], [1200, 129, 70], hq, hkv, 128, dtype=dtype, page_size=128)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    out, lse = _run(p, source="table", sel=sel, tile=tile)
    _check(out, lse, _sparse_ref(p, sel), dtype, f"{tile} sparse r{hq // hkv}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", SPARSE_TILES)
def test_sparse_prefill_tiles_shared_blocks(rng, tile):
    p = make_problem(rng, [512], [4096], 32, 2, 128, page_size=128, layout="HND")
    sel = np.full((512, 2, 16), -1, np.int32)
    for t in range(4):
        for h in range(2):
            reach = (4096 - 512 + 128 * t) // 128 + 1
            sel[128 * t:128 * (t + 1), h] = rng.choice(reach, size=16, replace=False).astype(np.int32)
    out, lse = _run(p, source="table", sel=sel, tile=tile)
    _check(out, lse, _sparse_ref(p, sel), BF16, f"{tile} sparse tile-shared lists")


def _spy_gather(monkeypatch):
    """Count the calls that take the gather kernels."""
    from mate_cupy.msa import gather_kernels as gk

    calls = []
    real = gk.run_gather
    monkeypatch.setattr(gk, "run_gather", lambda **kw: (calls.append(1), real(**kw)))
    return calls


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["table", "csr"])
@pytest.mark.parametrize("layout,dtype", [("NHD", BF16), ("HND", F16)])
def test_sparse_prefill_gather_per_token_lists(rng, monkeypatch, source, layout, dtype):
    """The gather tile (block-stationary kernels) on per-token lists: a varlen batch with an
    empty request, a single token and lengths off the 128 blocks (kv longer than q: query
    offsets), ids that are -1, past the request, far out of range, negative or repeated."""
    p = make_problem(rng, [300, 0, 1, 70, 1100], [1200, 50, 129, 70, 1500], 64, 4, 128, dtype=dtype,
                     page_size=128, layout=layout)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    calls = _spy_gather(monkeypatch)
    out, lse = _run(p, source=source, sel=sel, tile="gather")
    assert calls, "the gather kernels did not run"
    _check(out, lse, _sparse_ref(p, sel), dtype, f"gather {source} {layout}")
    # A block listed twice (invalid input, SPEC 5) counts once, as in the query-tile kernel.
    sel[::7, :, 1] = sel[::7, :, 0]
    out_g, lse_g = _run(p, source=source, sel=sel, tile="gather")
    out_d, lse_d = _run(p, source=source, sel=sel)
    assert rel_err(to_f64(out_g), to_f64(out_d)) <= TOL[np.dtype(dtype)]
    fin = np.isfinite(lse_d)
    assert np.array_equal(np.isfinite(lse_g), fin) and np.max(np.abs(lse_g[fin] - lse_d[fin])) <= LSE_TOL


@pytest.mark.gpu
def test_sparse_prefill_gather_non_causal_and_wide_lists(rng, monkeypatch):
    p = make_problem(rng, [2100], [2300], 32, 2, 128, page_size=128)
    sel = random_selection(rng, p, 24)
    calls = _spy_gather(monkeypatch)
    out, lse = _run(p, source="table", sel=sel, tile="gather", causal=False)
    assert calls
    _check(out, lse, _sparse_ref(p, sel, causal=False), BF16, "gather non-causal, 24-wide lists")


@pytest.mark.gpu
def test_sparse_prefill_gather_windows_and_split_items(rng, monkeypatch):
    """Causal lists over two query windows (gk.WIN queries each), with block 0 in every list:
    that key's queries exceed a work item (gk.CAP) and split into several items."""
    from mate_cupy.msa import gather_kernels as gk

    nq = gk.WIN + 450
    p = make_problem(rng, [nq], [nq + 200], 64, 4, 128, page_size=128)
    sel = random_selection(rng, p, 16)
    sel[:, :, 0] = 0
    assert nq > gk.CAP
    calls = _spy_gather(monkeypatch)
    out, lse = _run(p, source="table", sel=sel, tile="gather")
    assert calls
    _check(out, lse, _sparse_ref(p, sel), BF16, "gather two windows, split items")


@pytest.mark.gpu
def test_sparse_prefill_gather_falls_back_where_it_does_not_apply(rng, monkeypatch):
    p = make_problem(rng, [200, 70], [900, 70], 32, 4, 128, page_size=128)  # 8 query heads per KV head
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    calls = _spy_gather(monkeypatch)
    out, lse = _run(p, source="table", sel=sel, tile="gather")
    assert not calls
    _check(out, lse, _sparse_ref(p, sel), BF16, "gather fallback r8")


def test_gather_applies_and_workspace_layout():
    from mate_cupy.msa import gather_kernels as gk

    base = dict(cc=90, dtype_code=1, head_dim=128, group=16, page_size=128, sparse_decode=False, batch=1,
                max_seqlen_q=32768, max_seqlen_k=32768, num_heads_kv=4, total_q=32768, width=16)
    assert gk.applies(**base)
    for change in (dict(cc=80), dict(dtype_code=2), dict(head_dim=64), dict(group=8), dict(sparse_decode=True),
                   dict(batch=4096, max_seqlen_k=1 << 20), dict(width=129)):
        assert not gk.applies(**{**base, **change}), change
    lay = gk.workspace_layout(100, 4, 16, 77, 6400, 200)
    ends = sorted((off, off + size) for name, (off, size) in ((n, x) for n, x in lay.items() if n != "total"))
    assert all(off % 256 == 0 for off, _ in ends)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:])) and ends[-1][1] <= lay["total"]
    assert lay["part_o"][1] == 100 * 4 * 16 * 16 * 128 * 2


@pytest.mark.gpu
def test_sparse_fp8_256_row_tile(rng):
    p = make_problem(rng, [200, 40], [700, 40], 16, 1, 128, dtype=FP8, page_size=128)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    out, lse = _run(p, source="table", sel=sel, k_scale=0.7, v_scale=1.3, tile="mma256")
    _check(out, lse, _sparse_ref(p, sel, k_scale=0.7, v_scale=1.3), FP8, "sparse fp8 mma256")


# ============================================================================ GPU: CUDA graph (torch)


@pytest.mark.gpu
@pytest.mark.torch
def test_static_paged_plan_captured_in_torch_graph_and_replayed(rng):
    """A static paged decode plan (split-KV) captured once, replayed with new lengths."""
    import torch

    import mate_cupy as mc

    hq, hkv, d, ps, B, max_k = 32, 4, 128, 64, 4, 4096
    info = mc.msa_plan(B, 1, max_k, hq, num_kv_heads=hkv, page_size=ps, total_seqlen_k=B * max_k,
                       num_kv_splits=-1)
    n_pages = B * max_k // ps
    dev = torch.device("cuda")
    kc = torch.from_numpy(rng.standard_normal((n_pages, ps, hkv, d)).astype(np.float32)).to(dev, torch.bfloat16)
    vc = torch.from_numpy(rng.standard_normal((n_pages, ps, hkv, d)).astype(np.float32)).to(dev, torch.bfloat16)
    q = torch.empty((B, hq, d), device=dev, dtype=torch.bfloat16)
    out = torch.empty((B, hq, d), device=dev, dtype=torch.bfloat16)
    lse = torch.empty((B, hq), device=dev, dtype=torch.float32)
    z = lambda n: torch.zeros(n, dtype=torch.int32, device=dev)  # noqa: E731
    md = mc.MsaRuntimeMetadata(qo_lens=z(B), kv_lens=z(B), qo_offset=z(B), cu_seqlens_q=z(B + 1),
                               cu_seqlens_k=z(B + 1), seqused_k=z(B))
    table = torch.zeros((B, max_k // ps), dtype=torch.int32, device=dev)

    def fill(kv):
        kv = np.asarray(kv, np.int32)
        perm = rng.permutation(n_pages).astype(np.int32)
        tbl = perm[: B * (max_k // ps)].reshape(B, max_k // ps)
        qh = rng.standard_normal((B, hq, d)).astype(np.float32)
        q.copy_(torch.from_numpy(qh).to(dev, torch.bfloat16))
        md.qo_lens.copy_(torch.ones(B, dtype=torch.int32))
        md.kv_lens.copy_(torch.from_numpy(kv))
        md.seqused_k.copy_(torch.from_numpy(kv))
        md.qo_offset.copy_(torch.from_numpy(kv - 1))
        md.cu_seqlens_q.copy_(torch.arange(B + 1, dtype=torch.int32))
        md.cu_seqlens_k.copy_(torch.from_numpy(np.concatenate([[0], np.cumsum(kv)]).astype(np.int32)))
        table.copy_(torch.from_numpy(tbl))
        return kv, tbl

    def reference(kv, tbl):
        qh = q.float().cpu().numpy()
        cu_q = np.arange(B + 1, dtype=np.int32)
        return R.paged_attention(qh, kc.float().cpu().numpy(), vc.float().cpu().numpy(), cu_q, kv, tbl,
                                 qo_offset=kv - 1, causal=True)

    def call():
        mc.msa(q, kc, vc, info, page_table=table, runtime_metadata=md, out=out, lse=lse)

    kv, tbl = fill([4096, 1, 2500, 700])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # warm-up: compiles, allocates the split workspace
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for lens in ([4096, 1, 2500, 700], [3, 4000, 128, 129]):
        kv, tbl = fill(lens)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = reference(kv, tbl)
        _check(out, lse, ref, BF16, f"graph replay kv={lens}")
