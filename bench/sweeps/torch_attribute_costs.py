"""What reading a torch tensor's metadata costs on this host: the per-call floor of a
prepared call (``runtime.interop.torch_cuda_addresses`` reads device, dtype, shape,
contiguity and the data pointer of each array).

Usage: ``PYTHONPATH=. python bench/sweeps/torch_attribute_costs.py OUTDIR`` (a CUDA GPU).
Prints and writes ``OUTDIR/torch_attribute_costs.txt``: nanoseconds per attribute read on
a CPU and a CUDA bf16 tensor (least of 3 timings of 200,000 reads), microseconds of
``torch_cuda_addresses`` over 10 tensors and 2 Nones (a decode step's arrays), of torch's
current-stream getter and of CuPy's current device.
"""
from __future__ import annotations

import os
import sys
import timeit

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _ns(fn, n: int = 200_000) -> float:
    return round(min(timeit.repeat(fn, number=n, repeat=3)) / n * 1e9, 1)


def main() -> int:
    import torch

    from mate_cupy.runtime import interop

    outdir = sys.argv[1]
    os.makedirs(outdir, exist_ok=True)
    lines = []
    for dev in ("cpu", "cuda"):
        t = torch.randn(1, 1, 16, 128, device=dev, dtype=torch.bfloat16)
        reads = {"data_ptr": t.data_ptr, "get_device": t.get_device, "stride": t.stride, "shape": lambda: t.shape,
                 "dtype": lambda: t.dtype, "is_contiguous": t.is_contiguous, "device": lambda: t.device,
                 "__class__": lambda: t.__class__}
        lines.append(f"{dev} ns: " + str({name: _ns(fn) for name, fn in reads.items()}))
    arrays = tuple(torch.randn(1, 1, 16, 128, device="cuda", dtype=torch.bfloat16) for _ in range(10)) + (None, None)
    interop.wrap("x", arrays[0])  # registers torch's tensor type for the fast path
    lines.append(f"torch_cuda_addresses(12) us: {_ns(lambda: interop.torch_cuda_addresses(arrays), 20_000) / 1e3:.2f}")
    lines.append(f"raw stream us: {_ns(lambda: interop.torch_stream_ptr(0), 20_000) / 1e3:.3f}")
    lines.append(f"getDevice us: {_ns(interop.current_device, 20_000) / 1e3:.3f}")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    with open(os.path.join(outdir, "torch_attribute_costs.txt"), "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
