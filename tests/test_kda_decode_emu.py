"""The KDA decode kernels' own source (cuda_src/kda_decode.cu) on the CPU SIMT emulator
(tests/kda_decode_emu), launched as the launcher configures them (``decode_launch``), against
the token-by-token float64 driver of test_kda_decode.py.

Both state layouts and dtypes; ``[N]`` and ``[N, C]`` slots with accepted counts, padding
sequences and tokens; varlen with empty sequences; more tokens than one prologue holds (the
state parked in the stage); a partial last V-slice (per-lane cp.async instead of the bulk
copy); no initial state; V-first CTAs of one, two and four warps. Copies land at issue or at
the wait that retires them (a read without its wait). Outputs are poisoned with NaN.
MATE_CUPY_EMU_SANITIZE=1 builds with ASan/UBSan.
"""
from __future__ import annotations

import numpy as np
import pytest

from helpers import emulator_or_skip
from test_kda_decode import BF16, F32, decode_inputs, drive, rel

pytestmark = [pytest.mark.slow, pytest.mark.torch]


@pytest.fixture(scope="module")
def emu(tmp_path_factory):
    pytest.importorskip("torch")
    from kda_decode_emu import harness

    d = tmp_path_factory.mktemp("kda_decode_emu")
    return harness, emulator_or_skip(harness.build, d), d / "work"


def _slots_pad():
    return np.array([[0, -1, 1], [-1, 2, 3], [4, 5, 6], [7, 8, 9]], np.int32)


# (inputs, options, slot arrays, accepted counts)
CASES = {
    "slots-n": (dict(B=5, T=1, P=9, V=64), dict(inplace_final_state=True), lambda: np.array([3, 0, 8, 5, 1], np.int32),
                None),
    "slots-nc-accepted": (dict(B=4, T=3, P=12, V=32), dict(inplace_final_state=True), _slots_pad,
                          lambda: np.array([3, 1, 2, 3], np.int32)),  # sequence 1 reads slot -1: padding
    "slots-nc": (dict(B=4, T=3, P=10, V=32), dict(inplace_final_state=True), _slots_pad, None),
    "long": (dict(B=2, T=11, P=2, V=32), dict(store_final_state=True), None, None),
    "varlen": (dict(B=0, T=0, lens=[1, 0, 9, 3], P=16, V=32), dict(inplace_final_state=True),
               lambda: np.array([[2, 5, 6, 7], [0, 8, 9, 10], [3, 11, 12, 13], [1, 14, -1, 4]], np.int32), None),
    "partial-slice": (dict(B=3, T=2, P=3, V=40), dict(inplace_final_state=True), None, None),
    "no-initial-state": (dict(B=3, T=1, P=3, V=32), dict(use_initial_state=False, store_final_state=True), None,
                         None),
}


def _inputs(rng, name, sdt, v_first):
    kw, opts, si, na = CASES[name]
    x = decode_inputs(rng, **kw, state_dtype=sdt, state_v_first=v_first)
    x["num_accepted_tokens"] = None if na is None else na()
    opts = dict(opts, state_indices=None if si is None else si(), state_v_first=v_first, apply_beta_sigmoid=True)
    return x, opts


def _check(emu, rng, name, sdt, v_first, *, warps=None, lazy=False):
    harness, exe, work = emu
    x, opts = _inputs(rng, name, sdt, v_first)
    pool0 = x["state"].copy()
    ref_out, ref_pool, ref_final = drive(**{**x, "state": pool0}, **opts)
    out, final = harness.run_decode(exe, work, x, opts, warps=warps, lazy=lazy)
    assert not np.isnan(np.asarray(out, np.float32)).any(), "output elements left unwritten"
    assert rel(out, ref_out) < 1e-2
    padded = np.all(ref_out == 0, axis=(-1, -2))
    assert np.all(np.asarray(out, np.float64)[padded] == 0)
    tol = 1e-6 if sdt == F32 else 1e-2
    if opts.get("inplace_final_state"):
        assert rel(x["state"], ref_pool) < tol
    else:
        np.testing.assert_array_equal(x["state"], pool0)  # not written
    if ref_final is not None:
        assert rel(final, ref_final) < tol


@pytest.mark.parametrize("sdt", [F32, BF16], ids=["f32", "bf16"])
@pytest.mark.parametrize("v_first", [True, False], ids=["vfirst", "kfirst"])
@pytest.mark.parametrize("name", list(CASES))
def test_launcher_config_matches_driver(emu, rng, name, sdt, v_first):
    """select_config's launch."""
    _check(emu, rng, name, sdt, v_first)


@pytest.mark.parametrize("lazy", [False, True], ids=["eager", "lazy"])
@pytest.mark.parametrize("warps", [1, 2, 4], ids=lambda w: f"w{w}")
@pytest.mark.parametrize("name", ["slots-n", "slots-nc-accepted", "long", "partial-slice"])
def test_vfirst_warps_per_cta(emu, rng, name, warps, lazy):
    """V-first CTAs of ``warps`` warps (``decode_config``) on bf16 pools, copies landing at
    issue or at their wait."""
    _check(emu, rng, name, BF16, True, warps=warps, lazy=lazy)
