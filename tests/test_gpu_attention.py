"""The attention kernels through their launcher, against the float64 references.

CPU tests pin the launcher to the kernel source (parameter lists, shared-memory layout,
the registered variants being exactly the ones the configuration can pick, tile and split
choices) and check fragment/swizzle models of the MMA paths. GPU tests (``-m gpu``) build
an :class:`AttentionProblem` directly, take its configuration from ``select_config`` (or a
named tile's from ``tile_config``) and launch ``run_attention`` on CuPy arrays: fresh random
inputs, outputs poisoned with NaN before every launch, every element compared. The
CUDA-graph test captures a static plan through the public API with torch tensors and
replays it with new runtime lengths.
"""
from __future__ import annotations

import dataclasses
import math
import re
from pathlib import Path

import numpy as np
import pytest
from helpers import kernel_params, rel_err, signed_rows, to_f64, torch_side_stream
from msa_cases import BF16, FP8, make_problem, random_selection

from mate_cupy.msa import attention_launch as al
from mate_cupy.msa import execute, gather_launch
from mate_cupy.reference import msa as R
from mate_cupy.runtime.interop import wrap

F16 = np.dtype(np.float16)
TOL = {BF16: 1e-2, F16: 5e-3, FP8: 4e-2}
LSE_TOL = 1e-3
SRC = Path(al.__file__).resolve().parent.parent / "cuda_src" / al.SOURCE


# ============================================================================ CPU: launcher vs source


def _c_params(kernel: str) -> list:
    """(name, kind) of each parameter of ``kernel`` in attention_fwd.cu."""
    return kernel_params(SRC, kernel)


@pytest.mark.parametrize("kernel,params", [("msa_attention_fwd_kernel", al.FWD_PARAMS),
                                           ("msa_attention_merge_kernel", al.MERGE_PARAMS)])
def test_kernel_params_match_kernel_signature(kernel, params):
    assert _c_params(kernel) == list(params.params)


def _problem(**kw):
    base = dict(kv_mode=al.KV_DENSE, batch=1, total_q=8192, num_heads_q=64, num_heads_kv=8, head_dim=128,
                dtype_code=al.DTYPE_BF16, max_seqlen_q=8192, max_seqlen_k=8192, page_size=0, list_width=0,
                causal=True, sparse_decode=False, num_kv_splits=-1, gather=False)
    base.update(kw)
    if base["kv_mode"] == al.KV_SPARSE:
        base["page_size"], base["list_width"] = 128, base["list_width"] or 16
    return al.AttentionProblem(**base)


def _config(cc=90, sm=132, **kw):
    return al.select_config(_problem(**kw), sm, cc)


def test_every_variant_fits_shared_memory_and_occupancy():
    for (d, code, tile, kv), spec in al.SPECS.items():
        shape = al.tile_shape(tile, d, code)
        lay = al.smem_layout(shape, d, code, kv)
        defines = dict(spec.defines)
        assert defines["ATT_SMEM_FIXED"] == str(lay["fixed"]) and defines["ATT_KV"] == str(kv)
        assert defines["ATT_WS"] == str(int(shape.producer))
        if shape.producer:  # setmaxnreg: multiples of 8 within the launch allocation (168 x 384)
            p, c = al.WS_REGISTERS[kv]
            assert (defines["ATT_WS_PRODUCER_REGS"], defines["ATT_WS_CONSUMER_REGS"]) == (str(p), str(c))
            assert 128 * p + 256 * c <= 168 * 384 and p % 8 == 0 and c % 8 == 0
        else:
            assert "ATT_WS_PRODUCER_REGS" not in defines
        pad = al.WG_PAD if shape.producer else 0
        if kv == al.KV_SPARSE:
            assert d == execute.SPARSE_HEAD_DIM
            if shape.producer:  # its union scratch grows with the requests: test_select_config_choices
                extra = al.sparse_smem_bytes(9, 16, al.union_words(32768))[0]  # MiniMax-M3's lists at 32K
            else:  # the widest sparse lists (W = 64) with the smallest group (8)
                extra = al.sparse_smem_bytes((shape.rows - 1) // 8 + 2, 64)[0]
                assert lay["union_blocks"] * al.SPARSE_BLOCK >= execute.SPARSE_MAX_SEQLEN_K, spec.name
        else:
            extra = 0
        assert lay["fixed"] + pad + extra <= al.SMEM_LIMIT, spec.name
        if shape.producer:
            assert spec.min_sm == 90 and code in (0, 1) and d in (64, 128)
            # tiles on 1024-byte boundaries (the hardware swizzle keys on address bits 7-9)
            assert lay["q"] % 1024 == 0 and (2 * shape.block_n * d * 2) % 1024 == 0
        if tile == "prefill" and d <= 128:
            assert 2 * (lay["fixed"] + 1024) <= al.SMEM_PER_SM, spec.name  # two CTAs per SM
        # the e4m3 PV product needs 32 keys per warp, the 16-bit one 16
        assert shape.block_n // shape.warps_n % (32 if code == 2 else 16) == 0


def test_ws_shared_layout_matches_the_kernel():
    """The host's view of a warp-specialised tile's barrier region (ws_bar_bytes) is the
    kernel's formula, and its sparse lists add a second membership buffer and a union
    scratch of one bit per block of the longest request."""
    text = (SRC.parent / "attention" / "mainloop_sm90.cuh").read_text()
    body = text[text.index("constexpr int ws_bar_bytes("):]
    body = body[:body.index("}")]
    assert "return 4 * stages * 8 + 16 + 80 + (kv == 1 ? stages * 128 : kv == 2 ? 4 * stages : 0) + 16;" in body
    assert al.ws_bar_bytes(3, al.KV_DENSE) == 208 and al.ws_bar_bytes(3, al.KV_PAGED) == 592
    assert al.ws_bar_bytes(2, al.KV_SPARSE) == 184
    assert [al.union_words(k) for k in (1, 128, 129, 4096, 4097, 32768, 1 << 25)] == [1, 1, 1, 1, 2, 8, 8192]
    _, qwords = al.sparse_smem_bytes(9, 16)
    assert al.sparse_smem_bytes(9, 16, 8)[0] - al.sparse_smem_bytes(9, 16)[0] == 4 * (9 * qwords + 2 * 8)


def test_registered_variants_are_exactly_the_ones_the_configuration_picks():
    picked = set()
    for kv in (al.KV_DENSE, al.KV_PAGED, al.KV_SPARSE):
        dims = (execute.SPARSE_HEAD_DIM,) if kv == al.KV_SPARSE else execute.HEAD_DIMS
        groups = execute.SPARSE_GQA_RATIOS if kv == al.KV_SPARSE else (1, 8, 16)
        for d in dims:
            for code in execute.DTYPE_CODES.values():
                for cc in (80, 89, 90):
                    if code == al.DTYPE_E4M3 and cc < 89:
                        continue
                    for group in groups:
                        for max_q in (1, 64, 8192):
                            for causal in (True, False):
                                for sparse_decode in ((False, True) if kv == al.KV_SPARSE else (False,)):
                                    cfg = _config(cc=cc, kv_mode=kv, head_dim=d, dtype_code=code,
                                                  num_heads_q=8 * group, max_seqlen_q=max_q, total_q=max_q,
                                                  causal=causal, sparse_decode=sparse_decode)
                                    picked.add((d, code, cfg.tile, kv))
                                    assert cfg.spec is al.SPECS[(d, code, cfg.tile, kv)]
                                    assert cfg.spec.min_sm <= cc
    assert picked == set(al.SPECS)


def test_select_config_choices():
    # the H200 choices of the measured classes (docs/attention.md)
    # dense D 128: the warp-specialised tile, causal or not, any group and length
    assert _config().tile == "ws2n128s3"  # causal S8192, group 8
    assert _config(batch=16, max_seqlen_q=1024, max_seqlen_k=1024, total_q=16384).tile == "ws2n128s3"
    assert _config(num_heads_kv=4, max_seqlen_q=32768, max_seqlen_k=32768, total_q=32768).tile == "ws2n128s3"
    assert _config(causal=False).tile == "ws2n128s3" and _config(head_dim=64).tile == "ws2n128s3"
    g = _config()
    assert g.threads == 384 and g.grid == (132, 1, 1) and g.row_tiles == 8192 * 8 // 128 and g.splits == 1
    # L2 sections: requests x KV heads whose K/V (2 x keys x 256 bytes each) fit in 50 MiB
    assert g.l2_section == 8  # all 8 heads (32 MiB)
    assert _config(batch=16, max_seqlen_q=1024, max_seqlen_k=1024, total_q=16384).l2_section == 64
    assert _config(num_heads_kv=4, max_seqlen_q=32768, max_seqlen_k=32768, total_q=32768).l2_section == 2
    assert _config(max_seqlen_k=1 << 20).l2_section == 1 and _config(cc=80).l2_section == 0
    # paged prefill: the same tile, its producer looking the pages up
    paged = dict(kv_mode=al.KV_PAGED, page_size=64)
    assert _config(**paged).tile == _config(causal=False, **paged).tile == al.WS_TILE
    assert _config(batch=16, max_seqlen_q=1024, max_seqlen_k=1024, total_q=16384, **paged).tile == al.WS_TILE
    assert _config(head_dim=64, **paged).tile == al.WS_TILE
    # block-sparse prefill on the query tiles: three stages where the lists and the union
    # scratch leave room (MiniMax-M3's lists up to 128K keys), else two, else the mma.sync tile
    sparse = dict(kv_mode=al.KV_SPARSE, page_size=128, num_heads_kv=4)
    g = _config(**sparse)
    assert g.tile == al.WS_TILE and g.threads == 384 and g.grid == (132, 1, 1) and g.union_words == 2
    assert g.shared_mem <= al.SMEM_LIMIT
    assert _config(**{**sparse, "max_seqlen_k": 131072}).tile == al.WS_TILE
    g = _config(**{**sparse, "max_seqlen_k": 1 << 20})
    assert g.tile == al.WS_SPARSE_TILE and g.union_words == 256
    assert _config(**{**sparse, "list_width": 64}).tile == al.WS_SPARSE_TILE
    assert _config(**{**sparse, "num_heads_kv": 8}).tile == al.WS_SPARSE_TILE  # group 8: 17 queries' lists
    assert _config(**{**sparse, "max_seqlen_k": 1 << 25, "list_width": 64}).tile == "prefill"
    # the mma.sync tile where the warpgroup tiles do not run
    assert _config(cc=80).tile == "prefill" and _config(head_dim=256).tile == "prefill"
    assert _config(dtype_code=al.DTYPE_E4M3).tile == "prefill"
    g = _config(cc=80)
    assert g.splits == 1 and g.grid == (8192 * 8 // 128, 1, 8) and g.threads == 128
    # single-token decode packs the 8 heads of a group into one 16-row tile
    g = _config(batch=64, max_seqlen_q=1, total_q=64)
    assert g.tile == "decode" and g.grid[:2] == (1, 64) and g.splits == 1
    # too few CTAs to fill the GPU: split the keys (workspace for the partials)
    g = _config(batch=8, max_seqlen_q=1, total_q=8, max_seqlen_k=65536)
    assert g.splits > 1 and g.grid[2] == 8 * g.splits
    assert g.workspace_bytes == al.split_workspace_bytes(8, 64, 128, g.splits) > 0
    assert _config(batch=8, max_seqlen_q=1, total_q=8, max_seqlen_k=65536, num_kv_splits=5).splits == 5
    assert _config(batch=8, max_seqlen_q=1, total_q=8, max_seqlen_k=65536, num_kv_splits=1).splits == 1
    assert _config(batch=8, max_seqlen_q=1, total_q=8, max_seqlen_k=65536, num_kv_splits=1).workspace_bytes == 0
    # fewer SMs (a plan's usable_SM_count): more splits
    assert (_config(sm=16, batch=8, max_seqlen_q=1, total_q=8, max_seqlen_k=65536).splits
            <= _config(sm=132, batch=8, max_seqlen_q=1, total_q=8, max_seqlen_k=65536).splits)
    # Hkv * splits stays a valid grid dimension
    g = _config(batch=1, max_seqlen_q=1, total_q=1, num_heads_q=40000, num_heads_kv=40000, max_seqlen_k=1 << 20,
                num_kv_splits=64)
    assert g.grid[2] <= al.MAX_GRID_YZ
    # block-sparse: the warp-specialised tile for prefill, the decode tile for decode plans
    g = _config(kv_mode=al.KV_SPARSE, num_heads_kv=4, max_seqlen_q=32768, max_seqlen_k=32768, total_q=32768)
    assert g.tile == al.WS_TILE and g.nq_cap == 9 and g.qmask_words == (9 * 16 + 31) // 32
    assert _config(kv_mode=al.KV_SPARSE, cc=80).tile == "prefill"
    assert _config(kv_mode=al.KV_SPARSE, dtype_code=al.DTYPE_E4M3).tile == "prefill"
    assert _config(kv_mode=al.KV_SPARSE, sparse_decode=True, max_seqlen_q=4, total_q=4).tile == "decode"
    # nothing to do
    assert _config(total_q=0).tile == "" and _config(batch=0).tile == ""


def test_gather_is_chosen_by_the_plan_where_it_applies():
    base = dict(kv_mode=al.KV_SPARSE, num_heads_kv=4, max_seqlen_q=32768, max_seqlen_k=32768, total_q=32768)
    assert _config(**base).tile == al.WS_TILE
    g = _config(gather=True, **base)
    assert g.tile == al.GATHER and g.workspace_bytes == gather_launch.workspace_bytes(
        total_q=32768, num_heads_kv=4, width=16, batch=1, max_seqlen_q=32768, max_seqlen_k=32768)
    assert al.config_specs(g, al.DTYPE_BF16) == (gather_launch.SPECS[al.DTYPE_BF16],)
    # where the gather kernels do not apply the query tile runs
    assert _config(gather=True, **{**base, "num_heads_kv": 8}).tile == al.WS_SPARSE_TILE  # 8 heads per KV head
    assert _config(gather=True, cc=80, **base).tile == "prefill"
    assert _config(gather=True, sparse_decode=True, **base).tile == "decode"
    assert _config(gather=True, dtype_code=al.DTYPE_E4M3, **base).tile == "prefill"
    assert _config(gather=True, kv_mode=al.KV_PAGED, page_size=128, num_heads_kv=4).tile != al.GATHER


def test_select_config_is_pure_and_cached():
    p = _problem()
    a, b = al.select_config(p, 132, 90), al.select_config(_problem(), 132, 90)
    assert a is b  # frozen problems hash by value
    assert al.tile_config(p, a.tile, 132) == a
    text = Path(al.__file__).read_text()
    assert "environ" not in text and "getenv" not in text


def test_run_attention_packs_values_in_parameter_order(monkeypatch):
    """Each value lands in the kernel parameter of its name (CPU: the launch is recorded)."""
    from types import SimpleNamespace as A

    launches = []
    monkeypatch.setattr(al, "launch", lambda kern, grid, block, params, values, shared_mem=0, stream=0:
                        launches.append((kern, grid, block, params, values, shared_mem, stream)))
    p = _problem(kv_mode=al.KV_PAGED, page_size=64, batch=2, total_q=2, max_seqlen_q=1, max_seqlen_k=65536)
    cfg = al.select_config(p, 132, 90)
    assert cfg.splits > 1 and cfg.workspace_bytes
    ptr = {n: A(ptr=1000 * (i + 1)) for i, n in enumerate(["q", "k", "v", "out", "lse", "cu_q", "qo", "kv", "off",
                                                           "table"])}
    al.run_attention(p, cfg, (ptr["q"], ptr["k"], ptr["v"], ptr["out"], ptr["lse"]),
                     (ptr["cu_q"], ptr["qo"], ptr["kv"], ptr["off"], None), (ptr["table"], None, 1024, None),
                     ((8192, 128), (8192, 128), (1, 2, 3), (4, 5, 6), 77), (0.5, 1.0), 1 << 20, 0, 0xAB,
                     kernels=("fwd", "merge"))
    (kern, grid, block, params, values, smem, stream), merge = launches
    assert kern == "fwd" and params is al.FWD_PARAMS and stream == 0xAB and smem == cfg.shared_mem
    got = dict(zip(params.names, values))
    assert (got["q"], got["k"], got["v"], got["out"], got["lse"]) == (1000, 2000, 3000, 4000, 5000)
    assert (got["cu_seqlens_q"], got["qo_lens"], got["kv_lens"], got["qo_offset"]) == (6000, 7000, 8000, 9000)
    assert (got["cu_seqlens_k"], got["page_list"], got["page_indptr"], got["block_lists"]) == (0, 10000, 0, 0)
    assert (got["k_page_stride"], got["k_slot_stride"], got["k_head_stride"]) == (1, 2, 3)
    assert (got["v_page_stride"], got["v_slot_stride"], got["v_head_stride"]) == (4, 5, 6)
    assert (got["kv_extent"], got["page_list_len"], got["page_size_log2"], got["group"]) == (77, 1024, 6, 8)
    assert (got["num_splits"], got["scale_log2"], got["out_scale"]) == (cfg.splits, 0.5, 1.0)
    assert got["ws_o"] == 1 << 20 and got["ws_lse"] == (1 << 20) + cfg.splits * 2 * 64 * 128 * 4
    assert len(values) == len(params)
    mvals = dict(zip(merge[3].names, merge[4]))
    assert merge[0] == "merge" and merge[3] is al.MERGE_PARAMS and len(merge[4]) == len(al.MERGE_PARAMS)
    assert (mvals["ws_o"], mvals["out"], mvals["lse"], mvals["num_splits"]) == (1 << 20, 4000, 5000, cfg.splits)
    assert merge[1] == cfg.merge_grid == (-(-64 // 4), 2)


def test_tensor_maps_of_the_dense_warp_specialised_tile():
    from mate_cupy.jit.tensor_map import NO_MAP, TensorMap

    def problem(kv, hq, hkv, d=128):
        return al.AttentionProblem(kv, 2, 300, hq, hkv, d, al.DTYPE_BF16, 200, 900, 0 if kv == al.KV_DENSE else 64,
                                   0, True, False, -1, False)

    p = problem(al.KV_DENSE, 64, 8)
    cfg = al.select_config(p, 132, 90)
    assert cfg.tile == al.WS_TILE
    # q: a view with a padded head and token stride
    qm, km, vm = al.tensor_maps(p, cfg, 0x1000, 0x2000, 0x3000, (64 * 256, 256), (0, 1024, 128), (0, 1024, 128), 1000)
    assert qm == TensorMap(0x1000, 9, (128, 64, 300), (512, 64 * 512), (64, 8, 16))
    assert km == TensorMap(0x2000, 9, (128, 8, 1000), (256, 2048), (64, 1, 128))
    # one KV head, whose head stride the validation leaves free: the map takes the packed one
    p1 = problem(al.KV_DENSE, 4, 1, 64)
    cfg1 = al.select_config(p1, 132, 90)
    qm, km, vm = al.tensor_maps(p1, cfg1, 0x1000, 0x2000, 0x3000, (4 * 64, 64), (0, 64, 7), (0, 64, 64), 1000)
    assert qm.box == (64, 4, 32) and km.strides == (128, 128) and vm.strides == (128, 128)
    # group 3 does not divide the tile's 128 rows: Q is copied by rows, K/V still by boxes
    p3 = problem(al.KV_DENSE, 6, 2)
    qm, km, _ = al.tensor_maps(p3, al.select_config(p3, 132, 90), 1, 2, 3, (768, 128), (0, 256, 128), (0, 256, 128), 9)
    assert qm == NO_MAP and isinstance(km, TensorMap)
    assert al.tensor_maps(p, cfg, 1, 2, 3, (768, 128), (0, 256, 128), (0, 256, 128), 0)[1:] == (NO_MAP, NO_MAP)
    # paged, pages of 64 (NHD) and 256 (HND): one box per page, at most 128 slots; pages under 8 by cp.async
    pp = problem(al.KV_PAGED, 64, 8)
    cfg_p = al.select_config(pp, 132, 90)
    qm, km, vm = al.tensor_maps(pp, cfg_p, 1, 0x2000, 0x3000, (8192, 128), (64 * 1024, 1024, 128),
                                (64 * 1024, 1024, 128), 9)
    assert km == TensorMap(0x2000, 9, (128, 8, 64, 9), (256, 2048, 128 * 1024), (64, 1, 64, 1))
    p256 = dataclasses.replace(pp, page_size=256)
    km = al.tensor_maps(p256, al.select_config(p256, 132, 90), 1, 2, 3, (8192, 128), (256 * 1024, 128, 256 * 128),
                        (256 * 1024, 128, 256 * 128), 9)[1]
    assert km.dims == (128, 8, 256, 9) and km.strides == (64 * 1024, 256, 512 * 1024) and km.box == (64, 1, 128, 1)
    p4 = dataclasses.replace(pp, page_size=4)
    assert al.tensor_maps(p4, al.select_config(p4, 132, 90), 1, 2, 3, (8192, 128), (512, 128, 16), (512, 128, 16),
                          9)[1:] == (NO_MAP, NO_MAP)
    # block-sparse: K/V by pages of 128, Q as the others; the other tiles take none
    ps = dataclasses.replace(pp, kv_mode=al.KV_SPARSE, page_size=128, list_width=16)
    qm, km, _ = al.tensor_maps(ps, al.select_config(ps, 132, 90), 1, 2, 3, (8192, 128), (128 * 1024, 1024, 128),
                               (128 * 1024, 1024, 128), 9)
    assert qm.box == (64, 8, 16) and km.dims == (128, 8, 128, 9) and km.box == (64, 1, 128, 1)
    assert al.tensor_maps(p, al.select_config(p, 132, 80), 1, 2, 3, (8192, 128), (1, 2, 3), (1, 2, 3), 9) == \
        (NO_MAP,) * 3  # sm_80: the mma.sync tile


def test_split_choice_is_monotone_in_occupancy():
    assert al.choose_splits(1000, 100, 132, 2) == 1
    assert al.choose_splits(64, 1, 132, 2) == 1
    s = al.choose_splits(64, 512, 132, 2)
    assert 2 <= s <= al.MAX_SPLITS and 64 * s >= 0.8 * 264 * 0.85


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
    kernel = (SRC.parent / "attention" / "mainloop_sm90.cuh").read_text()
    # Q/K descriptors: SBO 1024 (8-row groups); V: the same, transposed (imm-trans-b = 1)
    assert kernel.count("wg_desc(") == 3 and kernel.count(", 16, 1024)") == 3
    # immediates after scale-d: RS "1, 1, TRANS" (WgmmaRS: B transposed, as V; WgmmaRSKMajor:
    # B K-major); SS 16-bit K-major "1, 1, 0, 0"; SS e4m3 (no transpose operands, always
    # K-major) "1, 1"
    assert 'p, 1, 1, " #TRANS ";' in text and 'p, " IMM ";' in text
    rs = re.findall(r'^MATE_WG_RS(64|128)\((\w+), (\w+), "(\w+)", (\d)\)', text, re.M)
    assert {(n, name, trans) for n, name, _, _, trans in rs} == {
        ("64", "WgmmaRS", "1"), ("64", "WgmmaRSKMajor", "0"), ("128", "WgmmaRSKMajor", "0")}, rs
    assert len(rs) == 6  # f16 and bf16 each
    ss = re.findall(r'^MATE_WG_SS\((\d+), (\d+), (\w+), "(\w+)", "([\d, ]+)"', text, re.M)
    assert {(ty, k, imm) for _, k, _, ty, imm in ss} == {("f16", "16", "1, 1, 0, 0"), ("bf16", "16", "1, 1, 0, 0"),
                                                         ("e4m3", "32", "1, 1")}, ss




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


def _el(a) -> tuple:
    return tuple(s // a.itemsize for s in a.strides)


def _run(p, *, causal=True, qo_offset=None, kv_lens=None, source="dense", sel=None, sm_scale=None,
         k_scale=1.0, v_scale=1.0, splits=-1, sparse_decode=False, table=None, with_lse=True, q=None, out=None,
         tile=None, gather=False, k=None, v=None):
    """Configure and launch the problem's attention pass; returns (out, lse) as device arrays.

    ``tile`` names a query tile (``tile_config``); by default ``select_config`` chooses, with
    ``gather`` the plan option of that name.
    """
    import cupy

    from mate_cupy.runtime.device import device_info

    fp8 = p.q.dtype == FP8
    d = p.q.shape[2]
    offs = (p.kv - p.qo) if qo_offset is None else np.asarray(qo_offset)
    kvl = p.kv if kv_lens is None else np.asarray(kv_lens)
    q = _cp(p.q) if q is None else q
    out = _poison(p.q.shape, BF16 if fp8 else p.q.dtype) if out is None else out
    lse = _poison((p.total_q, p.hq), np.float32) if with_lse else None
    if source == "dense":
        k = _cp(p.k) if k is None else k
        v = _cp(p.v) if v is None else v
        kv_mode, page_size = al.KV_DENSE, 0
        ks, vs = _el(k), _el(v)
        k_strides, v_strides = (0, ks[0], ks[1]), (0, vs[0], vs[1])
        page_list = page_indptr = None
        page_list_len = 0
    else:
        k, v = _cp(p.k_cache), _cp(p.v_cache)
        kv_mode, page_size = (al.KV_SPARSE if sel is not None else al.KV_PAGED), p.page_size
        ks, vs = _el(k), _el(v)
        if p.layout == "NHD":
            k_strides, v_strides = ks[:3], vs[:3]
        else:
            k_strides, v_strides = (ks[0], ks[2], ks[1]), (vs[0], vs[2], vs[1])
        tbl = p.page_table if table is None else table
        if source == "table":
            page_list, page_indptr, page_list_len = _cp(tbl), None, tbl.shape[1]
        else:
            counts = -(-kvl.astype(np.int64) // p.page_size)
            indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
            flat = np.concatenate([tbl[b, :c] for b, c in enumerate(counts)] + [np.zeros(0, np.int32)])
            page_list, page_indptr, page_list_len = _cp(flat.astype(np.int32)), _cp(indptr), flat.shape[0]
    code = {BF16: al.DTYPE_BF16, F16: al.DTYPE_FP16, FP8: al.DTYPE_E4M3}[p.q.dtype]
    problem = al.AttentionProblem(
        kv_mode, len(p.qo), p.total_q, p.hq, p.hkv, d, code, int(p.qo.max()), int(kvl.max()), page_size,
        0 if sel is None else sel.shape[2], causal, sparse_decode, splits, gather)
    sm, cc = device_info()
    config = al.select_config(problem, sm, cc) if tile is None else al.tile_config(problem, tile, sm)
    if config.shared_mem > al.SMEM_LIMIT:  # a forced tile whose lists leave it no room
        pytest.skip(f"{tile}: {config.shared_mem} bytes of shared memory for these lists")
    ws = cupy.empty(max(1, config.workspace_bytes), dtype=np.uint8)
    scale = 1.0 / math.sqrt(d) if sm_scale is None else sm_scale

    def arg(name, a):
        return None if a is None else wrap(name, a)

    al.run_attention(
        problem, config, (arg("q", q), arg("k", k), arg("v", v), arg("out", out), arg("lse", lse)),
        (arg("cu_q", _cp(p.cu_q)), arg("qo", _cp(p.qo)), arg("kv", _cp(kvl.astype(np.int32))),
         arg("off", _cp(offs.astype(np.int32))), arg("cu_k", _cp(p.cu_k)) if source == "dense" else None),
        (arg("pages", page_list), arg("indptr", page_indptr), page_list_len,
         None if sel is None else arg("sel", _cp(sel))),
        (_el(q)[:2], _el(out)[:2], k_strides, v_strides, k.shape[0]),
        (scale * execute.LOG2E * (k_scale if fp8 else 1.0), v_scale if fp8 else 1.0),
        ws.data.ptr, cupy.cuda.Device().id, cupy.cuda.get_current_stream().ptr)
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
@pytest.mark.parametrize("tile", ["prefill", al.WS_TILE])
def test_paged_cache_without_pages(rng, tile):
    # a cache of zero pages: every page id is out of range, every key inadmissible (the
    # warp-specialised tile has no tensor map to load from and copies nothing)
    p = make_problem(rng, [200, 60], [500, 300], 8, 1, 128, page_size=64)
    p.k_cache, p.v_cache = p.k_cache[:0], p.v_cache[:0]
    out, lse = _run(p, source="table", tile=tile)
    assert np.all(to_f64(out) == 0.0), f"{tile}: rows without admissible keys must be 0"
    assert np.all(to_f64(lse) == -np.inf), f"{tile}: rows without admissible keys have lse -inf"


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [-1, 6])
def test_paged_decode_split_kv(rng, splits):
    p = make_problem(rng, [1] * 5, [8192, 3000, 1, 0, 777], 64, 8, 128, page_size=64)
    out, lse = _run(p, source="table", splits=splits)
    _check(out, lse, _paged_ref(p), BF16, f"paged decode splits={splits}")




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
@pytest.mark.parametrize("hq,hkv", [(32, 4), (32, 2)], ids=["r8", "r16"])
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
@pytest.mark.parametrize("splits", [-1, 1])
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


# ============================================================================ GPU: every registered query tile

# The query tiles per KV mode (each reached by select_config for some inputs; forced here).
DENSE_TILES = ["prefill", al.WS_TILE]
PAGED_TILES = ["prefill", al.WS_TILE]
SPARSE_TILES = ["prefill", al.WS_TILE, al.WS_SPARSE_TILE]


def _tile_dims(tile, kv=al.KV_DENSE):
    """The head dims (of 64 and 128) tile ``tile`` is registered for, in KV mode ``kv``."""
    return [d for d in (64, 128) if (d, al.DTYPE_BF16, tile, kv) in al.SPECS]


@pytest.mark.gpu
@pytest.mark.parametrize("tile,d", [(t, d) for t in DENSE_TILES for d in _tile_dims(t)])
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (32, 4), (32, 2)], ids=["r1", "r8", "r16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_dense_varlen_query_tiles(rng, tile, d, dtype, hq, hkv, causal):
    p = make_problem(rng, QO, KV, hq, hkv, d, dtype=dtype)
    out, lse = _run(p, causal=causal, tile=tile)
    _check(out, lse, _dense_ref(p, causal=causal), dtype, f"{tile} dense d{d} r{hq // hkv}")


NEGATIVE_SM_SCALE = 1.0


def _signed_problem(rng, page_size=0):
    """Scores of one sign per (query, 128-key block): q rows of one sign in runs of 3 tokens,
    keys positive in the even 128-key blocks of their request and negative in the odd ones.
    Rows of the second request (one block) see only negative scores when their sign is -;
    the first request's negative rows see a negative first block and a positive second one.
    q is scaled by 4 and run with a softmax scale of 1 (NEGATIVE_SM_SCALE), so a row's scores in
    one block spread over more than 128 in the exponent: a maximum taken too low overflows."""
    from msa_cases import paginate

    p = make_problem(rng, [200, 50], [700, 100], 32, 2, 128)
    q_sign = 4.0 * np.where(np.arange(p.q.shape[0]) // 3 % 2 == 0, 1.0, -1.0)
    k_sign = np.where((np.arange(p.k.shape[0]) - np.repeat(p.cu_k[:-1], p.kv)) // 128 % 2 == 0, 1.0, -1.0)
    p = dataclasses.replace(p, q=signed_rows(p.q, q_sign), k=signed_rows(p.k, k_sign))
    if page_size:
        paginate(rng, p, page_size)
    return p


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [None] + [t for t in DENSE_TILES if 128 in _tile_dims(t)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_rows_with_negative_scores(rng, tile, causal):
    # the row maxima of the softmax run on bit patterns where a row's running maximum or a
    # score is >= 0 (common/float_max.cuh) and on floats elsewhere: rows negative throughout,
    # rows negative for their first key tile only, and positive rows, in the same warps; the
    # jump from a negative block to a positive one moves a lazily rescaled running max
    p = _signed_problem(rng)
    out, lse = _run(p, causal=causal, tile=tile, sm_scale=NEGATIVE_SM_SCALE)
    _check(out, lse, _dense_ref(p, causal=causal, sm_scale=NEGATIVE_SM_SCALE), BF16,
           f"{tile} negative scores causal={causal}")


@pytest.mark.gpu
def test_gather_rows_with_negative_scores(rng):
    # the gather tile's one-block softmax on the same scores (per-token lists, 16 heads per KV head)
    p = _signed_problem(rng, page_size=128)
    sel = random_selection(rng, p, 4)
    out, lse = _run(p, source="table", sel=sel, gather=True, sm_scale=NEGATIVE_SM_SCALE)
    _check(out, lse, _sparse_ref(p, sel, sm_scale=NEGATIVE_SM_SCALE), BF16, "gather negative scores")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [t for t in DENSE_TILES if 128 in _tile_dims(t)])
def test_query_tiles_offsets_views_and_splits(rng, tile):
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


# The warp-specialised tile: request lengths around its 128-row / 128-key tiles (1, 127,
# 129, a request with no keys, an empty one, more keys than queries), GQA 1 to 16.
WS_QO = [1, 127, 129, 0, 700, 300, 129]
WS_KV = [1, 127, 129, 50, 1000, 0, 700]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [BF16, F16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 8, 12, 16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ws_tile_lengths_and_groups(rng, dtype, group, d, causal):
    # groups 3 and 12 do not divide the 128-row tile: Q by cp.async rows, not TMA boxes
    p = make_problem(rng, WS_QO, WS_KV, 2 * group, 2, d, dtype=dtype)
    out, lse = _run(p, causal=causal, tile=al.WS_TILE)
    _check(out, lse, _dense_ref(p, causal=causal), dtype, f"{al.WS_TILE} d{d} group {group}")


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_ws_tile_never_reads_keys_outside_the_request(rng, d):
    # K/V rows between and after the requests are NaN, and k/v are views with a padded
    # head stride: a key tile reaching past its request must not bring those rows in
    # (the partial last tile is zero-filled; NaN * 0 would poison the output)
    p = make_problem(rng, [200, 77, 129, 300], [300, 77, 129, 333], 16, 2, d)
    gap = 37
    cu = np.concatenate([[0], np.cumsum(p.kv + gap)]).astype(np.int32)
    kb = np.full((int(cu[-1]), 2, 2 * d), np.nan, np.float32).astype(BF16)
    vb = kb.copy()
    for b in range(len(p.kv)):
        kb[cu[b]:cu[b] + p.kv[b], :, :d] = p.k[p.cu_k[b]:p.cu_k[b + 1]]
        vb[cu[b]:cu[b] + p.kv[b], :, :d] = p.v[p.cu_k[b]:p.cu_k[b + 1]]
    gapped = dataclasses.replace(p, cu_k=cu)
    k, v = _cp(kb)[:, :, :d], _cp(vb)[:, :, :d]
    for causal in (True, False):
        out, lse = _run(gapped, causal=causal, tile=al.WS_TILE, k=k, v=v)
        _check(out, lse, _dense_ref(p, causal=causal), BF16, f"{al.WS_TILE} d{d} NaN between requests")


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_ws_tile_long_requests(rng, causal):
    # many key tiles per CTA: the ring wraps many times, both consumer warpgroups busy
    p = make_problem(rng, [1500, 900], [1500, 2200], 16, 2, 128)
    out, lse = _run(p, causal=causal)
    _check(out, lse, _dense_ref(p, causal=causal), BF16, f"{al.WS_TILE} long")
    offs = np.array([-300, 1000], np.int64)
    kvl = np.array([1400, 1900], np.int32)
    out, lse = _run(p, causal=causal, qo_offset=offs, kv_lens=kvl, splits=2)
    _check(out, lse, _dense_ref(p, causal=causal, qo_offset=offs, kv_lens=kvl), BF16, f"{al.WS_TILE} long split")


@pytest.mark.gpu
@pytest.mark.parametrize("source,splits", [("dense", -1), ("dense", 3), ("csr", -1), ("sparse", -1)])
def test_ws_tile_identical_run_to_run(rng, source, splits):
    # the persistent schedule, the reduction order and the split-KV merge are fixed: two
    # launches on the same inputs (fresh NaN-poisoned outputs) give the same bits
    p = make_problem(rng, [700, 129, 1, 300], [1500, 300, 700, 300], 16, 2, 128, page_size=128)
    sel = random_selection(rng, p, 16) if source == "sparse" else None
    kw = dict(source="table" if source == "sparse" else source, sel=sel, splits=splits, tile=al.WS_TILE)
    out1, lse1 = _run(p, **kw)
    out2, lse2 = _run(p, **kw)
    assert not np.isnan(to_f64(out1)).any(), f"{source}: rows left unwritten"
    assert np.array_equal(out1.get().view(np.uint16), out2.get().view(np.uint16)), f"{source}: out differs"
    assert np.array_equal(lse1.get().view(np.uint32), lse2.get().view(np.uint32)), f"{source}: lse differs"


@pytest.mark.gpu
@pytest.mark.parametrize("source", ["dense", "csr"])
@pytest.mark.parametrize("splits,section", [(1, 2), (2, 4)])
def test_ws_tile_l2_sections(rng, monkeypatch, source, splits, section):
    # work items walked in L2 sections smaller than the grid, the last one partial
    # (3 requests x 3 KV heads x splits triples), with a smaller L2 budget
    p = make_problem(rng, [700, 300, 1100], [1500, 300, 2200], 6, 3, 128, page_size=64)
    monkeypatch.setattr(al, "L2_BYTES", 5 * 2200 * 128 * 2)  # 2.5 requests' K/V of 2200 keys
    problem = al.AttentionProblem(al.KV_DENSE, 3, p.total_q, 6, 3, 128, al.DTYPE_BF16, 1100, 2200, 0, 0,
                                  True, False, splits, False)
    assert al.tile_config(problem, al.WS_TILE, 132).l2_section == section
    out, lse = _run(p, source=source, splits=splits, tile=al.WS_TILE)
    ref = _dense_ref(p) if source == "dense" else _paged_ref(p)
    _check(out, lse, ref, BF16, f"{al.WS_TILE} {source} L2 sections of {section}")


@pytest.mark.gpu
@pytest.mark.parametrize("group", [1, 4, 16])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("page_size,layout,source", [(16, "NHD", "table"), (64, "HND", "csr")])
def test_ws_tile_paged_lengths_and_groups(rng, group, d, page_size, layout, source):
    # the warp-specialised tile over a paged cache: the producer's per-row page lookups,
    # keys on invalid pages flagged per key (pages of 16 keys: every lane's flag word varies)
    p = make_problem(rng, WS_QO, WS_KV, 2 * group, 2, d, page_size=page_size, layout=layout)
    out, lse = _run(p, source=source, tile=al.WS_TILE)
    _check(out, lse, _paged_ref(p), BF16, f"{al.WS_TILE} paged d{d} group {group} page {page_size}")
    table = p.page_table.copy()
    table[4, 3] = p.k_cache.shape[0] + 7  # invalid ids inside and at the start of a request: masked
    table[4, 40 * 16 // page_size] = -2
    table[6, 0] = -1
    out, lse = _run(p, source="table", table=table, tile=al.WS_TILE)
    _check(out, lse, _paged_ref(p, table=table), BF16, f"{al.WS_TILE} paged invalid ids page {page_size}")


@pytest.mark.gpu
@pytest.mark.parametrize("tile", PAGED_TILES)
@pytest.mark.parametrize("page_size,layout,source", [(16, "NHD", "table"), (64, "HND", "csr"), (128, "NHD", "csr"),
                                                     (256, "HND", "table")])
def test_paged_query_tiles(rng, tile, page_size, layout, source):
    p = make_problem(rng, [1, 90, 0, 200], [700, 90, 33, 450], 16, 2, 128, page_size=page_size, layout=layout)
    out, lse = _run(p, source=source, tile=tile)
    _check(out, lse, _paged_ref(p), BF16, f"{tile} paged {page_size} {layout} {source}")
    if page_size == 64:
        table = p.page_table.copy()
        table[3, 1] = p.k_cache.shape[0] + 5  # invalid ids: masked
        table[1, 0] = -3
        out, lse = _run(p, source="table", table=table, tile=tile)
        _check(out, lse, _paged_ref(p, table=table), BF16, f"{tile} paged invalid ids")


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


@pytest.mark.gpu
@pytest.mark.parametrize("tile", [al.WS_TILE, al.WS_SPARSE_TILE])
@pytest.mark.parametrize("splits", [1, 3])
def test_ws_sparse_tile_many_items(rng, splits, tile):
    # more work items than CTAs (each CTA builds several unions, the membership buffers
    # alternate), per-token lists with padding and out-of-range ids, split-KV
    p = make_problem(rng, [2000, 300, 0, 1], [6000, 300, 10, 700], 16, 1, 128, page_size=128)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    out, lse = _run(p, source="table", sel=sel, splits=splits, tile=tile)
    _check(out, lse, _sparse_ref(p, sel), BF16, f"{tile} many items splits {splits}")


@pytest.mark.gpu
def test_ws_sparse_tile_many_list_entries(rng):
    # GQA 2: 64 queries per item, 1024 list entries (8 per producer thread), about two items
    # per CTA, unions of 0 to 150 blocks
    p = make_problem(rng, [17000, 5, 0, 200], [20000, 5, 10, 200], 2, 1, 128, page_size=128)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    out, lse = _run(p, source="csr", sel=sel, tile=al.WS_SPARSE_TILE)
    _check(out, lse, _sparse_ref(p, sel), BF16, "ws sparse tile, many list entries")


@pytest.mark.gpu
@pytest.mark.parametrize("group", [6, 12])
def test_ws_sparse_tile_groups_off_the_tile(rng, group):
    # a group that does not divide the 128-row tile: the Q tile by the producer warpgroup's
    # cp.async rows instead of TMA boxes (the kernel takes any group; the plans take 8 and 16)
    p = make_problem(rng, [700, 129, 1], [1500, 300, 700], 2 * group, 2, 128, page_size=128)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    for tile in (al.WS_TILE, al.WS_SPARSE_TILE):
        out, lse = _run(p, source="table", sel=sel, tile=tile)
        _check(out, lse, _sparse_ref(p, sel), BF16, f"{tile} group {group}")


@pytest.mark.gpu
def test_sparse_fp8_mma_sync_tile(rng):
    p = make_problem(rng, [200, 40], [700, 40], 16, 1, 128, dtype=FP8, page_size=128)
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    out, lse = _run(p, source="table", sel=sel, k_scale=0.7, v_scale=1.3)
    _check(out, lse, _sparse_ref(p, sel, k_scale=0.7, v_scale=1.3), FP8, "sparse fp8 prefill tile")


# ============================================================================ GPU: the gather tile


def _spy_gather(monkeypatch):
    """Count the calls that take the gather kernels."""
    calls = []
    real = gather_launch.run_gather
    monkeypatch.setattr(gather_launch, "run_gather", lambda **kw: (calls.append(1), real(**kw)))
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
    out, lse = _run(p, source=source, sel=sel, gather=True)
    assert calls, "the gather kernels did not run"
    _check(out, lse, _sparse_ref(p, sel), dtype, f"gather {source} {layout}")
    # A block listed twice (invalid input) counts once, as in the query-tile kernel.
    sel[::7, :, 1] = sel[::7, :, 0]
    out_g, lse_g = _run(p, source=source, sel=sel, gather=True)
    out_d, lse_d = _run(p, source=source, sel=sel)
    assert rel_err(to_f64(out_g), to_f64(out_d)) <= TOL[np.dtype(dtype)]
    lse_g, lse_d = to_f64(lse_g), to_f64(lse_d)
    fin = np.isfinite(lse_d)
    assert np.array_equal(np.isfinite(lse_g), fin) and np.max(np.abs(lse_g[fin] - lse_d[fin])) <= LSE_TOL


@pytest.mark.gpu
def test_sparse_prefill_gather_non_causal_and_wide_lists(rng, monkeypatch):
    p = make_problem(rng, [2100], [2300], 32, 2, 128, page_size=128)
    sel = random_selection(rng, p, 24)
    calls = _spy_gather(monkeypatch)
    out, lse = _run(p, source="table", sel=sel, gather=True, causal=False)
    assert calls
    _check(out, lse, _sparse_ref(p, sel, causal=False), BF16, "gather non-causal, 24-wide lists")


@pytest.mark.gpu
def test_sparse_prefill_gather_windows_and_split_items(rng, monkeypatch):
    """Causal lists over two query windows, with block 0 in every list: that key's queries
    exceed a work item and split into several items."""
    nq = gather_launch.MIN_WIN + 450
    p = make_problem(rng, [nq], [nq + 200], 64, 4, 128, page_size=128)
    sel = random_selection(rng, p, 16)
    sel[:, :, 0] = 0
    assert nq > gather_launch.CAP
    calls = _spy_gather(monkeypatch)
    out, lse = _run(p, source="table", sel=sel, gather=True)
    assert calls
    _check(out, lse, _sparse_ref(p, sel), BF16, "gather two windows, split items")


@pytest.mark.gpu
def test_sparse_prefill_gather_falls_back_where_it_does_not_apply(rng, monkeypatch):
    p = make_problem(rng, [200, 70], [900, 70], 32, 4, 128, page_size=128)  # 8 query heads per KV head
    sel = _corrupt(rng, random_selection(rng, p, 16), p)
    calls = _spy_gather(monkeypatch)
    out, lse = _run(p, source="table", sel=sel, gather=True)
    assert not calls
    _check(out, lse, _sparse_ref(p, sel), BF16, "gather fallback r8")


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
    side = torch_side_stream()
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

