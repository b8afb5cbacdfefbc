"""Workflow templates per tenant and their versions: what `POST /v1/workflows` (or an inline spec)
registers, bounded by the tenant's limits and expired when unused; a replaced version stays readable
for the clients that started on it."""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvflow_ray.core.graph import WorkflowSpec, parse_spec
from kvflow_ray.router.errors import TenantLimitError, UnknownWorkflowError
from kvflow_ray.router.limits import TenantLimits
from kvflow_ray.router.store import BufferedStore, check_name

OLD_VERSIONS_IN_MEMORY = 1024  # replaced template versions kept parsed (the store keeps them for the state TTL)


def _digest(spec: Mapping[str, Any]) -> bytes:
    return hashlib.blake2b(json.dumps(spec, sort_keys=True).encode(), digest_size=16).digest()


def version_id(spec: WorkflowSpec) -> str:
    """`name@digest`: the id of one version of a template (spec names never contain '@')."""
    return f"{spec.name}@{_digest(spec.to_dict()).hex()[:16]}"


@dataclass
class Template:
    """A tenant's current template: its parsed spec and version id, the digest of the request body
    that registered it (re-sending that body writes nothing), when it was last used, and when its
    store copy's idle TTL was last renewed."""

    spec: WorkflowSpec
    version: str
    sent: bytes | None
    used_at: float
    renewed_at: float


class Templates:
    """The tenants' templates, in memory (the store holds their durable copies). A template unused for
    `ttl_s` is dropped; registrations that change one are rate limited per tenant."""

    def __init__(self, store: BufferedStore, limits: TenantLimits, ttl_s: float, *, copy: bool = False) -> None:
        """`copy`: an ingress replica's copy of the router actor's templates (`adopt`ed from it): it
        never writes the store, and it notes which templates it used (`take_used`), so the actor,
        which owns them, keeps them alive."""
        self.store = store
        self.copy = copy
        self._used: set[tuple[str, str]] = set()  # (tenant, name) used since `take_used` (copies only)
        self.limits = limits
        self.spec_limits = limits.spec_limits()
        self.ttl_s = ttl_s
        # per tenant: current templates, least recently used first (idle ones leave from the front)
        self.current: dict[str, OrderedDict[str, Template]] = {}
        # replaced template versions live clients may still use, by (tenant, name@version)
        # (kept, like their store copies, for the state TTL after they were replaced; oldest first)
        self.old_versions: OrderedDict[tuple[str, str], tuple[float, WorkflowSpec]] = OrderedDict()
        self._write_tokens: dict[str, tuple[float, float]] = {}  # tenant -> (tokens, at)

    def load(self) -> None:
        """What the store holds, once, at (re)start."""
        if self.copy:
            return
        now = time.monotonic()
        for tenant, name, raw in self.store.template_items():
            spec = parse_spec(raw)
            if "@" in name:  # a replaced version kept for its live clients
                self._remember_version(tenant, name, spec)
            else:
                self.current.setdefault(tenant, OrderedDict())[name] = Template(spec, version_id(spec), None, now, now)

    def reconcile(self) -> int:
        """Queue every template and kept version for the store; how many writes."""
        writes = 0
        if self.copy:
            return writes
        for tenant, templates in self.current.items():
            for name, template in templates.items():
                self.store.put_template(tenant, name, template.spec.to_dict(), ttl_s=self.ttl_s)
                writes += 1
        for (tenant, version), (_kept_at, spec) in self.old_versions.items():
            self.store.put_template(tenant, version, spec.to_dict(), ttl_s=self.store.ttl_s)
            writes += 1
        return writes

    def put(self, tenant: str, spec: Mapping[str, Any]) -> WorkflowSpec:
        """Register (or re-register) a template from the network: within the tenant's limits, and
        without touching the filesystem (`prompt_file` is refused). Re-sending the same spec (an
        inline `workflow_spec` on every call) writes nothing."""
        check_name("tenant", tenant)
        if self._write_tokens_left(tenant) < 1:  # a spent budget answers before any parsing
            try:
                return self._unchanged(tenant, spec)
            except KeyError:
                raise self._write_limit() from None
        parsed = parse_spec(dict(spec), limits=self.spec_limits)  # raises SpecError naming the field
        templates = self.current.setdefault(tenant, OrderedDict())
        current = templates.get(parsed.name)
        if current is not None and current.spec.to_dict() == parsed.to_dict():
            current.sent = _digest(spec)
            self._use(tenant, current)
            return current.spec
        if current is None and len(templates) >= self.limits.max_templates:
            self._expire(tenant)
            if len(templates) >= self.limits.max_templates:
                raise TenantLimitError("max_templates", f"tenant has {len(templates)} workflow templates, the "
                                                        "most allowed")
        self.store.check()
        self._take_write_token(tenant)
        if current is not None:  # live clients keep the version they started with (`spec_of`)
            self.store.put_template(tenant, current.version, current.spec.to_dict(), ttl_s=self.store.ttl_s)
            self._remember_version(tenant, current.version, current.spec)
        now = time.monotonic()
        template = templates[parsed.name] = Template(parsed, version_id(parsed), _digest(spec), now, now)
        templates.move_to_end(parsed.name)
        self.store.put_template(tenant, parsed.name, parsed.to_dict(), ttl_s=self.ttl_s)
        return template.spec

    def adopt(self, tenant: str, raw: Mapping[str, Any], version: str) -> WorkflowSpec:
        """A copy takes the owner's current version of a template (checked there already); the version
        it replaces stays readable for the clients that started on it."""
        templates = self.current.setdefault(tenant, OrderedDict())
        current = templates.get(str(raw.get("name")))
        if current is not None and current.version == version:
            return current.spec
        spec = parse_spec(dict(raw))
        if current is not None:
            self._remember_version(tenant, current.version, current.spec)
        now = time.monotonic()
        templates[spec.name] = Template(spec, version, None, now, now)
        return spec

    def exported(self, tenant: str, name: str) -> dict[str, Any]:
        """The current template and its version, for a copy to `adopt` (marked used)."""
        template = self.get(tenant, name)
        return {"spec": template.spec.to_dict(), "version": template.version}

    def take_used(self) -> list[tuple[str, str]]:
        """The templates a copy used since the last take (to tell the owner)."""
        used, self._used = self._used, set()
        return sorted(used)

    def untake_used(self, used: Iterable[tuple[str, str]]) -> None:
        """Taken, but the owner never heard: told with the next take."""
        self._used.update((tenant, name) for tenant, name in used)

    def touch(self, used: list[tuple[str, str]]) -> None:
        """Templates a copy used: they stay alive here (the owner) as if used here."""
        for tenant, name in used:
            template = self.current.get(tenant, {}).get(name)
            if template is not None:
                self._use(tenant, template)

    def get(self, tenant: str, name: str) -> Template:
        """The tenant's current template `name`, marked used."""
        check_name("workflow", name)
        template = self.current.get(check_name("tenant", tenant), {}).get(name)
        if template is None:
            raise UnknownWorkflowError(f"unknown workflow {name!r} (register it with POST /v1/workflows)")
        self._use(tenant, template)
        return template

    def spec_of(self, tenant: str, name: str, version: str | None) -> WorkflowSpec:
        """The template version a client started with: the current one unless it changed since."""
        template = self.get(tenant, name)
        if version is None or version == template.version:
            return template.spec
        kept = self.old_versions.get((tenant, version))
        old = kept[1] if kept is not None else None
        if old is None:  # beyond the memory bound: the store keeps it for the state TTL
            try:
                raw = self.store.get_template(tenant, version)
            except Exception:  # the store is down: the client runs on the current version
                raw = None
            if raw is None:
                return template.spec
            old = parse_spec(raw)
            self._remember_version(tenant, version, old)
        return old

    def expire(self) -> None:
        """Drop every tenant's templates unused for the TTL, and replaced versions past the state TTL."""
        for tenant in list(self.current):
            self._expire(tenant)
        horizon = time.monotonic() - self.store.ttl_s
        while self.old_versions and next(iter(self.old_versions.values()))[0] < horizon:
            self.old_versions.popitem(last=False)

    def count(self) -> int:
        return sum(map(len, self.current.values()))

    def _remember_version(self, tenant: str, version: str, spec: WorkflowSpec) -> None:
        self.old_versions[(tenant, version)] = (time.monotonic(), spec)
        self.old_versions.move_to_end((tenant, version))
        while len(self.old_versions) > OLD_VERSIONS_IN_MEMORY:
            self.old_versions.popitem(last=False)

    def _use(self, tenant: str, template: Template) -> None:
        """A template was used: it is the tenant's most recent, and its store copy's idle TTL is renewed
        (at most every quarter TTL, so a hot template costs no write per call)."""
        now = time.monotonic()
        template.used_at = now
        self.current[tenant].move_to_end(template.spec.name)
        if self.copy:
            self._used.add((tenant, template.spec.name))
        elif now - template.renewed_at > self.ttl_s / 4:
            template.renewed_at = now
            self.store.put_template(tenant, template.spec.name, template.spec.to_dict(), ttl_s=self.ttl_s)

    def _expire(self, tenant: str) -> int:
        """Drop the tenant's templates unused for the TTL (oldest first; O(what expired)). A client uses
        its template on every call and expires itself after the shorter state TTL, so no live client
        loses its template."""
        templates = self.current.get(tenant)
        horizon = time.monotonic() - self.ttl_s
        expired = 0
        while templates:
            name, template = next(iter(templates.items()))
            if template.used_at > horizon:
                break
            del templates[name]
            if not self.copy:
                self.store.delete_template(tenant, name)
            expired += 1
        return expired

    def _write_tokens_left(self, tenant: str) -> float:
        """The tenant's template-write bucket now (`template_writes_per_s`, `template_write_burst`)."""
        rate = self.limits.template_writes_per_s
        burst = float(self.limits.template_write_burst)
        now = time.monotonic()
        tokens, at = self._write_tokens.get(tenant, (burst, now))
        tokens = min(burst, tokens + (now - at) * rate)
        self._write_tokens[tenant] = (tokens, now)
        return tokens

    def _take_write_token(self, tenant: str) -> None:
        tokens = self._write_tokens_left(tenant)
        if tokens < 1:
            raise self._write_limit()
        self._write_tokens[tenant] = (tokens - 1, time.monotonic())

    def _write_limit(self) -> TenantLimitError:
        return TenantLimitError("template_writes_per_s", "workflow registrations are limited to "
                                f"{self.limits.template_writes_per_s:g} per second per tenant")

    def _unchanged(self, tenant: str, spec: Mapping[str, Any]) -> WorkflowSpec:
        """The registered template when `spec` is exactly what registered it (KeyError otherwise): no
        parsing, so a tenant out of write budget can still re-send what it registered."""
        name = spec.get("name")
        current = self.current.get(tenant, {}).get(name) if isinstance(name, str) else None
        if current is None or current.sent != _digest(spec):
            raise KeyError(name)
        self._use(tenant, current)
        return current.spec
