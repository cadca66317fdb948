"""A map from tensors (by identity) to values that does not keep its keys alive.

Same semantics as ``torch.utils.weak.WeakIdKeyDictionary`` for what the parameter-entry tracer
needs (``in``, ``[]``, ``get``, assignment; an entry disappears when its tensor is freed), but a
lookup is one ``dict`` access by ``id(t)`` and one weak-reference call, where
``WeakIdKeyDictionary`` builds a new ``WeakIdRef`` object for every lookup. The tracer looks up
every tensor of every op of the forward (hundreds per ViT forward), so this is host time saved on
each step (docs/engine.md, "CUDA").

An id can be reused by a new tensor once the old one is freed; every lookup therefore checks that
the stored weak reference still points at the very tensor asked about, and the reference's callback
drops the entry when its tensor dies.
"""
from __future__ import annotations

import weakref
from typing import Any, Dict, Tuple

_MISSING = object()


class TensorMap:
    """``{tensor: value}`` by identity, holding the tensors weakly."""

    __slots__ = ("_entries", "__weakref__")

    def __init__(self) -> None:
        self._entries: Dict[int, Tuple[weakref.ref, Any]] = {}

    def _lookup(self, t) -> Any:
        entry = self._entries.get(id(t))
        if entry is None or entry[0]() is not t:
            return _MISSING
        return entry[1]

    def __contains__(self, t) -> bool:
        return self._lookup(t) is not _MISSING

    def __getitem__(self, t) -> Any:
        value = self._lookup(t)
        if value is _MISSING:
            raise KeyError(f"tensor {id(t):#x} is not in this map")
        return value

    def get(self, t, default: Any = None) -> Any:
        value = self._lookup(t)
        return default if value is _MISSING else value

    def __setitem__(self, t, value: Any) -> None:
        key = id(t)
        entries = self._entries

        # the tensor died: forget it (unless the id was reused)
        def drop(ref, key=key, entries=entries):
            entry = entries.get(key)
            if entry is not None and entry[0] is ref:
                del entries[key]

        entries[key] = (weakref.ref(t, drop), value)

    def empty(self) -> bool:
        """True when no live tensor is in the map (an entry leaves with its tensor), in O(1)."""
        return not self._entries

    def __len__(self) -> int:
        return sum(1 for ref, _ in self._entries.values() if ref() is not None)
