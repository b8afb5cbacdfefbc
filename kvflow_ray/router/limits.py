"""What one tenant may make the router hold or do: the bounds every request from the network meets.

Ray-free (pydantic only), so the simulator's router and serving's enforce the same limits; serving's
`AppConfig` nests them as `limits`.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from kvflow_ray.core.graph import SpecLimits


class TenantLimits(BaseModel):
    """What one tenant can make the serving stack hold or do at once. Each exceeded limit is a 4xx
    whose message names it (`limits.<field>`). The defaults suit a shared platform: room for any real
    workflow, none for a tenant that tries to exhaust the router's memory or time."""

    model_config = ConfigDict(extra="forbid", strict=True)

    max_agents_per_spec: int = Field(256, ge=1)
    max_prompt_bytes: int = Field(1 << 20, ge=1)  # UTF-8 bytes of all agent prompts of one spec
    max_templates: int = Field(1000, ge=1)  # workflow templates per tenant
    max_live_clients: int = Field(10_000, ge=1)  # workflow instances per tenant not finished or expired
    max_inflight_requests: int = Field(64, ge=1)  # per tenant, per ingress replica; more get 429
    max_body_bytes: int = Field(4 << 20, ge=1024)  # one HTTP request body (read no further)
    max_json_depth: int = Field(64, ge=4)  # nesting of a request body
    # registrations that change a template (POST /v1/workflows, inline specs), per tenant: a sustained
    # rate and a burst (a platform registering its applications at start-up); re-sending an unchanged
    # spec costs nothing. Parsing and storing large specs is the costliest thing a tenant can ask for.
    template_writes_per_s: float = Field(10.0, gt=0)
    template_write_burst: int = Field(100, ge=1)

    def spec_limits(self) -> SpecLimits:
        """The bounds every spec from the network is parsed with (`parse_spec(..., limits=)`)."""
        return SpecLimits(max_agents=self.max_agents_per_spec, max_prompt_bytes=self.max_prompt_bytes,
                          max_agents_setting="limits.max_agents_per_spec",
                          max_prompt_bytes_setting="limits.max_prompt_bytes")
