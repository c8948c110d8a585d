"""A second stream per (thread, device) for kernels that overlap the caller's stream.

Fork and join are event edges only (``cudaEventRecord`` / ``cudaStreamWaitEvent``): no host
synchronisation, and inside a stream capture the side stream joins the caller's graph. The
stream and its events are created once per thread and device and live as long as the
thread; nothing else is allocated.
"""
from __future__ import annotations

import threading

from .device import capture_tolerant

MAX_EDGES = 16  # events per side stream: fork edges of one launch sequence, plus the join
_local = threading.local()


class SideStream:
    """A non-blocking stream of the highest priority on one device, with reusable events.

    ``wait_for(stream, i)``: work queued next on this stream waits for everything queued so
    far on ``stream`` (event ``i``, ``0 <= i < MAX_EDGES - 1``; an event may be reused once
    its wait is queued). ``join(stream)``: ``stream`` waits for everything queued so far here.
    """

    def __init__(self, device: int):
        import cupy

        with cupy.cuda.Device(device), capture_tolerant():
            # priorities below the device's range are clamped to its highest
            self._stream = cupy.cuda.Stream(non_blocking=True, priority=-(1 << 10))
            self._events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(MAX_EDGES)]
        self.ptr = int(self._stream.ptr)

    def wait_for(self, stream: int, i: int) -> None:
        from cupy.cuda import runtime

        if not 0 <= i < MAX_EDGES - 1:
            raise ValueError(f"edge index must be in [0, {MAX_EDGES - 1}), got {i}")
        ev = self._events[i].ptr
        runtime.eventRecord(ev, stream)
        runtime.streamWaitEvent(self.ptr, ev, 0)

    def join(self, stream: int) -> None:
        from cupy.cuda import runtime

        ev = self._events[MAX_EDGES - 1].ptr
        runtime.eventRecord(ev, self.ptr)
        runtime.streamWaitEvent(stream, ev, 0)


def side_stream(device: int) -> SideStream:
    """This thread's :class:`SideStream` on ``device`` (created on first use)."""
    cache = getattr(_local, "streams", None)
    if cache is None:
        cache = _local.streams = {}
    s = cache.get(device)
    if s is None:
        s = cache[device] = SideStream(device)
    return s
