"""Public KDA (Kimi Delta Attention) API: the fused chunk forward and the recurrent decode step.

Both ops take any DLPack array (CuPy, torch, JAX; NumPy runs the float64 reference)
and return results in the framework of ``q``. The semantics are those of
``docs/semantics.md`` (section KDA); shapes and layouts are spelled in each docstring.
"""
from __future__ import annotations

from ._logging import mate_api
from .kda import chunk as _chunk
from .kda.chunk import chunk_kda_workspace_bytes
from .kda import decode as _decode

__all__ = ["chunk_kda", "chunk_kda_workspace_bytes", "gated_delta_rule_decode"]


@mate_api
def chunk_kda(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              A_log=None, dt_bias=None, lower_bound=-5.0, use_qk_l2norm_in_kernel=True, output=None,
              final_state=None, workspace=None):
    """Chunked KDA forward (prefill) over whole sequences.

    Per sequence and value head ``hv`` (q/k head ``hv // (HV // H)``), token by token, with a
    state ``S [V, K]`` (V-first)::

        qh, kh = l2norm(q), l2norm(k)        (if use_qk_l2norm_in_kernel; eps 1e-6 inside the sqrt)
        gk = lower_bound * sigmoid(exp(A_log[hv]) * (g + dt_bias[hv]))   with A_log/dt_bias
           = g                                                            without (log-space decay)
        S  = S * exp(gk)[None, :]
        S  = S + sigmoid(beta) * (v - S @ kh)[:, None] * kh[None, :]
        o  = (S @ qh) * scale

    Args:
        q, k: ``[B, T, H, 128]`` float16/bfloat16, ``H >= 1``; varlen: ``[S, H, 128]`` or ``[1, S, H, 128]``.
        v, g: ``[B, T, HV, 128]`` (varlen alike), q's dtype; ``HV % H == 0``, ``HV <= 65535``.
        beta: ``[B, T, HV]`` logits (varlen ``[S, HV]`` or ``[1, S, HV]``), q's dtype.
        scale: defaults to ``128 ** -0.5``.
        initial_state: ``[N, HV, 128, 128]`` (``[N, HV, V, K]``) float32 or q's dtype, or None (zeros).
        output_final_state: also return the final state ``[N, HV, V, K]`` (default False).
        cu_seqlens: ``[N+1]`` int32/int64 offsets for varlen (``cu[0] == 0``, non-decreasing,
            ``cu[-1] == S``; checked for host inputs, not read on the host for CUDA inputs,
            where the kernels clamp every offset into ``[0, S]``).
        A_log: ``[HV]`` and dt_bias ``[HV, 128]`` or ``[HV*128]``, both or neither (float; float32 preferred).
        lower_bound: gate lower bound with ``A_log``/``dt_bias`` (default -5.0).
        use_qk_l2norm_in_kernel: L2-normalise q and k (default True).
        output: preallocated output, v's shape and q's dtype; written in place and returned.
        final_state: preallocated ``[N, HV, 128, 128]``, used when ``output_final_state``
            (ignored otherwise); written in place and returned.
        workspace: CUDA scratch of at least :func:`chunk_kda_workspace_bytes` bytes on q's
            device: a ``mate_cupy.Workspace`` or any contiguous, 16-byte aligned CUDA array
            (default None: allocated per call through q's framework, e.g. torch's caching
            allocator). Host inputs take none.

    Returns:
        ``output`` (v's shape, q's dtype; ``[S, HV, 128]`` when q was given 3-D), or
        ``(output, final_state)`` when ``output_final_state``. The final state's dtype is
        the preallocated ``final_state``'s, else ``initial_state``'s, else q's; a bf16/fp16
        state is widened on load and rounded once on store.

    CUDA inputs run the chunk kernels on the caller's stream with no host synchronisation.
    Arrays that are not contiguous or not aligned for the kernels' vector accesses (16 bytes
    for q, k, v, g; 4 for ``output``; 8/4 for float32/bfloat16 states), non-float32
    ``A_log``/``dt_bias`` and float16 states go through contiguous float32 or same-dtype
    copies; with none of those and ``output``, ``final_state`` (when returned) and
    ``workspace`` given, a call allocates nothing. Host (NumPy, CPU torch) inputs run the
    float64 reference and store in the output dtypes.

    Raises:
        ValueError: shapes (rank, head dim 128, no q/k head, mismatched B/T/heads, beta,
            states, gate parameters, ``cu_seqlens`` rank; host inputs: ``cu_seqlens``
            offsets), devices, a workspace that is too small, not contiguous, misaligned, on
            another device or given with host inputs.
        TypeError: dtypes (q not fp16/bf16, k/v/g/beta/output not q's dtype, states not
            float32 or q's dtype, mismatched state dtypes, non-integer ``cu_seqlens``).
        NotImplementedError: more than 65535 value heads or 2**31 - 1 chunk slots; a CUDA
            device whose shared memory per block cannot hold the recurrence kernel (compute
            capability other than 8.0, 8.7, 9.0, 10.x, 11.0).
    """
    return _chunk.chunk_kda(
        q=q, k=k, v=v, g=g, beta=beta, scale=scale, initial_state=initial_state,
        output_final_state=output_final_state, cu_seqlens=cu_seqlens, A_log=A_log, dt_bias=dt_bias,
        lower_bound=lower_bound, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, output=output,
        final_state=final_state, workspace=workspace)


@mate_api
def gated_delta_rule_decode(q, k, v, state, A_log, a, dt_bias, num_accepted_tokens, cu_seqlens, b,
                            state_indices=None, scale=None, output=None, use_qk_l2norm=None, lower_bound=None,
                            use_gate_in_kernel=None, use_lower_bound=None, apply_beta_sigmoid=None,
                            allow_neg_eigval=None, use_initial_state=None, state_v_first=None, is_varlen=None,
                            store_final_state=False, inplace_final_state=False, state_dtype=None):
    """Recurrent gated delta rule step for serving (decode, multi-token, speculative).

    Per token, as in :func:`chunk_kda`, except the gate and the update strength:

    * ``use_gate_in_kernel`` (default True): ``x = a + dt_bias`` (no bias when None),
      ``A = A_log[hv]`` (0 when None); ``gk = lower_bound * sigmoid(exp(A) * x)`` when
      ``use_lower_bound`` (default False), else ``gk = -exp(A) * softplus(x)``. Otherwise ``gk = a``.
    * ``b`` as given; ``sigmoid(b)`` when ``apply_beta_sigmoid``; doubled when ``allow_neg_eigval``.

    Args:
        q, k: ``[B, T, H, K]`` float16/bfloat16 (varlen: ``[1, total_tokens, H, K]``), K = 128.
        v: ``[B, T, HV, V]``, q's dtype; ``HV % H == 0``.
        state: pool ``[P, HV, V, K]`` (``state_v_first``, default) or ``[P, HV, K, V]``,
            float32 or bfloat16; may be None when neither ``use_initial_state`` nor
            ``inplace_final_state``. A bf16 state is rounded after every token. K-first
            pools need V to be a multiple of 4 (float32) / 8 (bfloat16).
        A_log: ``[HV]`` float32 or None (0). a: ``[B, T, HV, K]`` float16/bfloat16/float32.
        dt_bias: ``[HV, K]`` float32/bfloat16 or None.
        num_accepted_tokens: ``[N]`` int32/int64 or None: speculative decoding, the initial
            state of sequence ``n`` is slot ``state_indices[n, num_accepted_tokens[n] - 1]``.
        cu_seqlens: ``[N+1]`` int32/int64 for varlen (``is_varlen`` defaults to its presence).
        b: ``[B, T, HV]`` (per head) or ``[B, T, HV, V]`` (per value channel), fp16/bf16/fp32.
        state_indices: None (sequence ``n`` uses slot ``n``), ``[N]`` (one slot per sequence)
            or ``[N, C]`` (slot per token: the state after token ``t`` goes to
            ``state_indices[n, t]``; the initial state comes from column 0). Negative
            entries are padding: zero output, no state read or written.
        scale: defaults to ``K ** -0.5``. output: preallocated ``[B, T, HV, V]``
            float16/bfloat16/float32 (default q's dtype), written in place and returned.
        use_qk_l2norm: default True. lower_bound: default -5.0.
        use_initial_state: default True (False starts from zeros).
        store_final_state: return the state after each sequence's last token, a new
            ``[N, HV, V, K]`` (K-first: ``[N, HV, K, V]``) array of the state dtype.
        inplace_final_state: write states into the ``state`` pool (see ``state_indices``);
            the returned final state is then the ``state`` object itself.
        state_dtype: float32 or bfloat16 (NumPy dtype, name or torch dtype); default the
            state's dtype, else float32.

    Returns:
        ``(output, final_state)``: ``final_state`` is the pool when in place, the new array
        when ``store_final_state``, else None.

    CUDA inputs run one decode kernel on the caller's stream with no host synchronisation
    (slots and offsets are not read on the host: out-of-pool slots are padding). q/k/v/a/b
    may have any non-negative strides with a contiguous last dimension; other layouts, and
    non-contiguous ``A_log``/``dt_bias``/index arrays/``output``/pool, go through contiguous
    copies (a copied pool is copied back after an in-place update). With none of those and
    ``output`` given, a call allocates nothing but the returned final state.

    Raises:
        ValueError: shapes, devices, ``state_dtype``, ``A_log``/``dt_bias`` dtypes,
            ``state_indices``/``num_accepted_tokens`` shape or dtype and their combination
            with in-place/speculative/varlen decode, missing ``state``, pool too small, a
            CUDA pool used by the kernel that is not 16-byte aligned; host inputs also:
            ``cu_seqlens`` offsets, slots outside the pool, accepted counts outside ``[1, C]``.
        TypeError: k/v not q's dtype, ``a``/``b`` dtypes, non-integer ``cu_seqlens``.
        NotImplementedError: q not fp16/bf16, unsupported output dtype, K != 128, a K-first
            V that is not a multiple of 4 (float32 state) / 8 (bfloat16), shapes beyond the
            kernels' 32-bit indexing.
    """
    call, problem = _decode.validate(
        q=q, k=k, v=v, state=state, A_log=A_log, a=a, dt_bias=dt_bias, num_accepted_tokens=num_accepted_tokens,
        cu_seqlens=cu_seqlens, b=b, state_indices=state_indices, scale=scale, output=output,
        use_qk_l2norm=use_qk_l2norm, lower_bound=lower_bound, use_gate_in_kernel=use_gate_in_kernel,
        use_lower_bound=use_lower_bound, apply_beta_sigmoid=apply_beta_sigmoid, allow_neg_eigval=allow_neg_eigval,
        use_initial_state=use_initial_state, state_v_first=state_v_first, is_varlen=is_varlen,
        store_final_state=store_final_state, inplace_final_state=inplace_final_state, state_dtype=state_dtype)
    return _decode.run(call, problem)
