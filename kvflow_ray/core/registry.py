"""Policy registries: name -> factory, one per decision (eviction, prefetch, admission, routing).

Adding a policy is one class and one `register` call; every engine, the CLI's `--policies`, the serve
config and the SGLang plugin's `--radix-eviction-policy-config` build policies only through these,
so nothing outside a registry compares policy names.

A factory takes a `PolicyContext` (what the workflow layer offers a policy: the step book, an
offline trace) and keyword-only options with defaults; those keywords are the options the policy
takes, read from its signature, so they are declared once.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class PolicyContext:
    """What a policy may read besides its options. `book`: steps-to-execution and fixed prompts
    (`policies.StepBook`); `future`: the known future access sequence (`policies.FutureAccesses`,
    offline bounds only); `tree`: the replica's cache tree (`radix.RadixTree`; None where the engine
    keeps its own, as SGLang does); `clock`: the engine's clock in seconds; `sessions`: the replica's
    agent sessions in tool pauses (`sessions.SessionBook`)."""

    book: Any = None
    future: Any = None
    tree: Any = None
    clock: Any = None
    sessions: Any = None


@dataclass(frozen=True)
class Registered(Generic[T]):
    name: str
    factory: Callable[..., T]
    options: Mapping[str, Any]  # option -> default


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, Registered[T]] = {}

    def register(self, name: str, factory: Callable[..., T]) -> Callable[..., T]:
        """Register `factory(context, *, option=default, ...)` under `name` (returns it, so it can
        decorate). Re-registering a name replaces it (a test's toy policy, a plugin's variant)."""
        options = {p.name: p.default for p in inspect.signature(factory).parameters.values()
                   if p.kind is inspect.Parameter.KEYWORD_ONLY}
        missing = [k for k, v in options.items() if v is inspect.Parameter.empty]
        if missing:
            raise TypeError(f"{self.kind} policy {name!r}: options need defaults ({', '.join(missing)})")
        self._entries[name] = Registered(name, factory, options)
        return factory

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def get(self, name: str) -> Registered[T]:
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} policy {name!r} (known: {', '.join(self._entries)})") from None

    def check_options(self, name: str, options: Mapping[str, Any]) -> None:
        """Reject options the policy does not take (a user's typo must not pass silently)."""
        entry = self.get(name)
        unknown = sorted(set(options) - set(entry.options))
        if unknown:
            takes = ", ".join(entry.options) or "no options"
            raise ValueError(f"{self.kind} policy {name!r} does not take {', '.join(unknown)} (it takes {takes})")

    def create(self, name: str, context: PolicyContext | None = None, settings: Mapping[str, Any] | None = None,
               **options: Any) -> T:
        """Build policy `name`. `options` are checked (each must be one the policy takes);
        `settings` are an engine's settings offered to every policy (`horizon`, `max_inflight`):
        each policy takes those it declares and ignores the rest."""
        entry = self.get(name)
        self.check_options(name, options)
        chosen = {k: v for k, v in (settings or {}).items() if k in entry.options}
        chosen.update(options)
        return entry.factory(context or PolicyContext(), **chosen)

    def parse(self, spec: object, *, allowed: tuple[str, ...] | None = None, example: str = "") -> T:
        """Build from a short spec, `name` or `name:option=value,...` (numbers, typed as the option's
        default), as requests and configs name a policy. Raises ValueError naming what is wrong."""
        if not isinstance(spec, str) or len(spec) > 64:
            raise ValueError(f"{self.kind} must be a short string such as {example or repr(next(iter(self._entries)))}")
        name, _, params = spec.strip().partition(":")
        allowed = allowed if allowed is not None else self.names()
        if name not in allowed:
            raise ValueError(f"unknown {self.kind} {name!r}; choose one of {', '.join(allowed)}")
        defaults = self.get(name).options  # option -> default, whose type the value takes
        options: dict[str, Any] = {}
        for item in filter(None, params.split(",")):
            key, eq, value = (part.strip() for part in item.partition("="))
            if not eq or key not in defaults:
                takes = ", ".join(f"{k}=" for k in defaults) or "no parameters"
                raise ValueError(f"{self.kind} {name!r} takes {takes}, got {item!r}")
            try:
                number = type(defaults[key])(value)
            except ValueError:
                raise ValueError(f"{self.kind} parameter {key!r} must be a number, got {value!r}") from None
            if isinstance(number, float) and not math.isfinite(number):
                raise ValueError(f"{self.kind} parameter {key!r} must be finite")
            options[key] = number
        return self.create(name, **options)


__all__ = ["PolicyContext", "Registered", "Registry"]
