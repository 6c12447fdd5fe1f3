"""The three ways the plugin changes a vLLM class, each idempotent and marked.

Every patch in :data:`.patches.PATCHES` changes vLLM only through these
functions, so that every changed member carries :data:`MARK`: the
touch-point table (:mod:`.touchpoints`) looks under it for vLLM's original,
and its completeness test finds every member the plugin changed.  This module
imports nothing from vLLM or from the rest of the package, so any adapter
module can use it without importing the patch registry.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

#: Attribute (on functions) or ``Field.metadata`` key (on dataclass fields)
#: set on everything the plugin installed into vLLM.
MARK = "_vllm_output_rate_patch"


def is_ours(obj: Any) -> bool:
    """Whether ``obj`` (a function, a static/class method) was installed by the plugin."""
    return bool(getattr(getattr(obj, "__func__", obj), MARK, False))


def unwrap(func: Any) -> Any:
    """vLLM's own callable under the plugin's wrappers (via ``__wrapped__``)."""
    while is_ours(func) and hasattr(func, "__wrapped__"):
        func = func.__wrapped__
    return func


def wrap(owner: type, name: str, make: Callable[[Callable], Callable]) -> None:
    """Replace ``owner.name`` (defined by ``owner`` itself) by ``make(original)``, once.

    A static or class method stays one; the replacement keeps the original as
    ``__wrapped__`` and its name and docstring.
    """
    current = owner.__dict__[name]
    inner = current.__func__ if isinstance(current, (staticmethod, classmethod)) else current
    if is_ours(inner):
        return
    replacement = make(inner)
    functools.update_wrapper(replacement, inner)
    setattr(replacement, MARK, True)
    if isinstance(current, staticmethod):
        replacement = staticmethod(replacement)
    elif isinstance(current, classmethod):
        replacement = classmethod(replacement)
    setattr(owner, name, replacement)


def add_method(owner: type, name: str, func: Callable) -> None:
    """Give ``owner`` a method vLLM does not define, once.

    Refuses to shadow a member of vLLM's own: a vLLM that starts using the
    name must fail loudly here, not lose its member.
    """
    current = getattr(owner, name, None)
    if current is not None:
        if is_ours(current):
            return
        raise RuntimeError(f"{owner.__name__}.{name} already exists in this vLLM")
    setattr(func, MARK, True)
    setattr(owner, name, func)


def add_field(owner: type, name: str, annotation: Any, default: Any) -> None:
    """Add an optional field to the vLLM dataclass ``owner``, once.

    For code that only reads the field and encoders that walk
    ``dataclasses.fields`` (vLLM's msgpack serialiser does): instances vLLM
    creates see ``default`` through the class attribute, since their
    ``__init__`` was generated before the field existed.
    """
    fields = owner.__dataclass_fields__
    if name in fields:
        if fields[name].metadata.get(MARK):
            return
        raise RuntimeError(f"{owner.__name__}.{name} is already a field of this vLLM")
    spec = dataclasses.field(default=default, metadata={MARK: True})
    spec.name = name
    spec.type = annotation
    # What @dataclass sets on each of its own fields; dataclasses.fields()
    # lists only fields marked so.
    spec._field_type = dataclasses._FIELD  # type: ignore[attr-defined]
    fields[name] = spec
    owner.__annotations__[name] = annotation
    setattr(owner, name, default)


def field_is_ours(owner: type, name: str) -> bool:
    spec = getattr(owner, "__dataclass_fields__", {}).get(name)
    return spec is not None and bool(spec.metadata.get(MARK))


__all__ = ["MARK", "add_field", "add_method", "field_is_ours", "is_ours", "unwrap", "wrap"]
