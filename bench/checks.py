"""Cheap correctness checks for the bench: float32 torch references on sampled rows.

The bench flags a fast-but-wrong kernel; the exhaustive checks against the
float64 NumPy references live in ``tests/``. Every impl of a case (ours and the
peers) is compared with the same reference, so a peer set up wrongly by the
bench shows up too. Errors are normalised: ``||out - ref|| / ||ref||`` over the
finite reference entries (``inf`` when non-finite entries disagree).
"""
from __future__ import annotations

import math


def rel_err(out, ref) -> float:
    import torch

    out = out.detach().to(torch.float32)
    ref = ref.detach().to(torch.float32)
    if out.shape != ref.shape:
        raise ValueError(f"shape mismatch: {tuple(out.shape)} vs reference {tuple(ref.shape)}")
    fin = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(out), fin):
        return math.inf
    if not torch.equal(out[~fin], ref[~fin]):
        return math.inf
    num = float(torch.linalg.vector_norm((out - ref)[fin]))
    den = float(torch.linalg.vector_norm(ref[fin]))
    return num / den if den > 0 else num


def sample_rows(total: int, n: int, device, seed: int = 0):
    """``n`` distinct row ids spread over ``[0, total)`` (always the first and last)."""
    import torch

    n = min(n, total)
    if n <= 2:
        return torch.arange(n, device=device)
    g = torch.Generator(device="cpu").manual_seed(seed)
    mid = torch.randperm(total - 2, generator=g)[: n - 2] + 1
    rows = torch.cat([torch.tensor([0, total - 1]), mid]).sort().values
    return rows.to(device)


def attention_rows(q_rows, keys, values, q_pos, kv_len, causal: bool, scale: float, key_pos=None):
    """Reference attention for a few query rows.

    q_rows [R, Hq, D]; keys, values [R, Lk, Hkv, D] or [Lk, Hkv, D] (shared);
    q_pos [R] absolute positions; kv_len [R] or int; key_pos [R, Lk] or [Lk]
    (default ``arange(Lk)``; ``-1`` marks a padding key). Returns out [R, Hq, D] float32.
    """
    import torch

    R, hq, d = q_rows.shape
    shared = keys.dim() == 3
    lk, hkv = (keys.shape[0], keys.shape[1]) if shared else (keys.shape[1], keys.shape[2])
    r = hq // hkv
    q = q_rows.float().view(R, hkv, r, d)
    k = keys.float()
    v = values.float()
    if shared:
        s = torch.einsum("ngrd,lgd->ngrl", q, k)
    else:
        s = torch.einsum("ngrd,nlgd->ngrl", q, k)
    s = s * scale
    if key_pos is None:
        key_pos = torch.arange(lk, device=q.device)
    kp = key_pos if key_pos.dim() == 2 else key_pos[None, :].expand(R, lk)
    kvl = kv_len if isinstance(kv_len, torch.Tensor) else torch.full((R,), int(kv_len), device=q.device)
    ok = (kp >= 0) & (kp < kvl[:, None])
    if causal:
        ok = ok & (kp <= q_pos[:, None])
    s = s.masked_fill(~ok[:, None, None, :], -math.inf)
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    denom = p.sum(-1, keepdim=True)
    p = p / torch.where(denom > 0, denom, torch.ones_like(denom))
    if shared:
        o = torch.einsum("ngrl,lgd->ngrd", p, v)
    else:
        o = torch.einsum("ngrl,nlgd->ngrd", p, v)
    return o.reshape(R, hq, d)


def block_max_rows(q_rows, keys, q_pos, kv_len: int, causal: bool, n_tiles: int, block: int = 128):
    """Reference per-128-key-block max of raw ``q . k`` for a few rows: [R, Hq, n_tiles] float32."""
    import torch

    R, hq, d = q_rows.shape
    lk, hkv = keys.shape[0], keys.shape[1]
    r = hq // hkv
    s = torch.einsum("ngrd,lgd->ngrl", q_rows.float().view(R, hkv, r, d), keys.float()).reshape(R, hq, lk)
    kp = torch.arange(lk, device=s.device)
    ok = (kp[None, :] < kv_len).expand(R, lk)
    if causal:
        ok = ok & (kp[None, :] <= q_pos[:, None])
    s = s.masked_fill(~ok[:, None, :], -math.inf)
    pad = n_tiles * block - lk
    if pad > 0:
        s = torch.nn.functional.pad(s, (0, pad), value=-math.inf)
    return s[..., : n_tiles * block].reshape(R, hq, n_tiles, block).amax(-1)


def topk_mismatch(ids, ref_ids) -> float:
    """Fraction of rows whose selected id sets differ (both [..., k]; -1 padding allowed)."""
    import torch

    a = ids.to(torch.int64).sort(-1).values
    b = ref_ids.to(torch.int64).sort(-1).values
    if a.shape != b.shape:
        raise ValueError(f"shape mismatch: {tuple(a.shape)} vs reference {tuple(b.shape)}")
    bad = (a != b).any(-1)
    return float(bad.float().mean()) if bad.numel() else 0.0


def _l2norm(x):
    import torch

    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def kda_step(S, q, k, v, graw, braw, A_log, dt_bias, lower_bound: float, scale: float):
    """One KDA token for a batch (SPEC sections 7/8; gate and beta sigmoid in kernel, l2norm on).

    S [N, HV, V, K] float32 (updated and returned); q, k [N, H, K]; v [N, HV, V];
    graw [N, HV, K] raw gate; braw [N, HV] beta logits; A_log [HV]; dt_bias [HV, K].
    Returns (o [N, HV, V], S).
    """
    import torch

    hv, h = v.shape[1], q.shape[1]
    r = hv // h
    qh = _l2norm(q.float()).repeat_interleave(r, dim=1)
    kh = _l2norm(k.float()).repeat_interleave(r, dim=1)
    x = graw.float() + dt_bias.float().view(hv, -1)
    gk = lower_bound * torch.sigmoid(torch.exp(A_log.float()).view(hv, 1) * x)
    beta = torch.sigmoid(braw.float())
    S = S * torch.exp(gk)[:, :, None, :]
    pred = torch.einsum("nhvk,nhk->nhv", S, kh)
    S = S + (beta[..., None] * (v.float() - pred))[..., None] * kh[:, :, None, :]
    o = torch.einsum("nhvk,nhk->nhv", S, qh) * scale
    return o, S


def kda_prefix(q, k, v, g, beta, A_log, dt_bias, starts, steps: int, lower_bound: float, scale: float):
    """Recurrent KDA over the first ``steps`` tokens of each sequence from a zero state.

    q, k [Ttot, H, K], v, g [Ttot, HV, *], beta [Ttot, HV] (packed tokens);
    starts [N] first token of each sequence. Returns o [N, steps, HV, V] float32.
    """
    import torch

    n, hv, vd, kd = starts.numel(), v.shape[1], v.shape[2], q.shape[2]
    S = torch.zeros(n, hv, vd, kd, dtype=torch.float32, device=q.device)
    outs = []
    for t in range(steps):
        rows = starts + t
        o, S = kda_step(S, q[rows], k[rows], v[rows], g[rows], beta[rows], A_log, dt_bias, lower_bound, scale)
        outs.append(o)
    return torch.stack(outs, dim=1)
