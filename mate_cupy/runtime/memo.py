"""A bounded memo for pure functions of a call's signature (validation results).

A CUDA call's validation reads only its arrays' metadata (:meth:`Call.signature`) and its
options, never their values, so equal keys give equal problems: memoising it changes
which work a call repeats, never its result or the path it takes. Failures are not
stored (the exception propagates before ``put``), so a bad call is checked, and refused,
every time.
"""
from __future__ import annotations


class BoundedMemo:
    """``key -> value`` holding at most ``capacity`` entries (the oldest is dropped first)."""

    __slots__ = ("capacity", "_items", "get")

    def __init__(self, capacity: int = 256):
        self.capacity = int(capacity)
        self._items: dict = {}
        #: ``get(key)``: the value stored under ``key``, else None (the dict's own lookup).
        self.get = self._items.get

    def put(self, key, value) -> None:
        items = self._items
        if key not in items and len(items) >= self.capacity:
            del items[next(iter(items))]
        items[key] = value

    def __len__(self) -> int:
        return len(self._items)

    def clear(self) -> None:
        self._items.clear()
