"""A table of extensions by name (growth directions, attention variants) and the decorator that fills it."""

from __future__ import annotations

from typing import Callable, TypeVar

T = TypeVar("T")


def registrar(table: dict[str, T], kind: str) -> Callable[[str], Callable[[T], T]]:
    """`register(name)`: a decorator that adds its function or class to `table` under `name`, once (a second
    object under a taken name is refused, so that two extensions cannot silently replace each other)."""

    def register(name: str) -> Callable[[T], T]:
        def add(obj: T) -> T:
            if name in table and table[name] is not obj:
                raise ValueError(f"{kind} {name!r} is already registered (by {table[name].__module__})")
            table[name] = obj
            return obj

        return add

    return register
