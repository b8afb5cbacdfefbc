"""The Python SDK: agents of a workflow call an OpenAI-compatible kvflow-ray server, and every call
carries the `kvflow` metadata (docs/design.md §7) so the server can route it and manage its KV cache.

    wf = Workflow.from_yaml("workflows/peer.yaml")
    with wf.client(base_url="http://127.0.0.1:8000/v1", api_key="...") as run:   # one workflow instance
        plan = run.agent("planner").chat([{"role": "user", "content": task}])
        ...
    # leaving the block finishes the instance (POST /v1/clients/{id}/finish): its prompts are retired

An agent's messages start with its fixed prompt from the spec (as the system message) unless the
caller passes one. Users of the plain OpenAI SDK can send the same metadata themselves:
`client.chat.completions.create(..., extra_body={"kvflow": {"client_id": ..., "workflow": ..., "agent": ...}})`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
import typing
import urllib.error
import urllib.request
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvflow_ray.core.graph import UnknownAgentError, WorkflowSpec, load_spec, parse_spec

SESSION_HEADER = "x-session-id"  # Ray Serve's session header (RAY_SERVE_SESSION_ID_HEADER_KEY's default)


_BUILD_LOCK = threading.Lock()


@functools.cache
def build_openai_response_types() -> tuple[type, ...]:
    """Build the OpenAI SDK's completion response models once, before any call parses a reply.

    The SDK defers building its pydantic models to their first use, and that build is not thread-safe:
    two threads parsing their first replies at once can see a half-built class (`ChatCompletion` has no
    `__pydantic_core_schema__`). A WorkflowRun is shared by threads (the load generator, the soak), so
    every model a reply can hold is built here, under a lock (threads racing to the first, uncached call
    build one after another; the later builds find the models complete)."""
    from openai import BaseModel
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    built: list[type] = []
    with _BUILD_LOCK:
        pending: list[object] = [ChatCompletion, ChatCompletionChunk, Completion]
        seen: set[object] = set()
        while pending:
            kind = pending.pop()
            if kind in seen:
                continue
            seen.add(kind)
            pending.extend(typing.get_args(kind))
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                kind.model_rebuild()
                built.append(kind)
                pending.extend(field.annotation for field in kind.model_fields.values())
    return tuple(built)


class Workflow:
    """A workflow template (spec) that runs as many instances (`client`) as you like."""

    def __init__(self, spec: WorkflowSpec) -> None:
        self.spec = spec

    @classmethod
    def from_yaml(cls, path: str | Path) -> Workflow:
        return cls(load_spec(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Workflow:
        return cls(parse_spec(data))

    @property
    def name(self) -> str:
        return self.spec.name

    def client(self, *, base_url: str, api_key: str | None = None, client_id: str | None = None,
               model: str | None = None, register: bool = True, timeout: float = 600.0,
               max_retries: int = 2) -> WorkflowRun:
        """One running instance of this workflow against a server. `register` sends the template
        (POST /v1/workflows) first, so the server knows its agents and prompts. `max_retries`: the
        OpenAI SDK's, with its default: agent calls answered 408, 409, 429 or 5xx, or cut off, are
        sent again with backoff (a 500 is what Ray Serve's proxy answers for a request whose ingress
        replica died); 0 reports every failure (a load generator's choice)."""
        return WorkflowRun(self, base_url=base_url, api_key=api_key, client_id=client_id, model=model,
                           register=register, timeout=timeout, max_retries=max_retries)


class WorkflowRun:
    """One workflow instance (a `client_id`). Use it as a context manager to finish it on exit."""

    def __init__(self, workflow: Workflow, *, base_url: str, api_key: str | None, client_id: str | None,
                 model: str | None, register: bool, timeout: float, max_retries: int = 2) -> None:
        from openai import OpenAI

        build_openai_response_types()
        self.workflow = workflow
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.client_id = client_id or f"{workflow.name}-{uuid.uuid4().hex[:12]}"
        self.model = model
        self.timeout = timeout
        # every call of the instance names it in the session header: the server keeps one client's calls on
        # one ingress replica (Ray Serve's consistent-hash request router keys on it)
        self.max_retries = max_retries
        self.openai = OpenAI(base_url=self.base_url, api_key=api_key or "none", timeout=timeout,
                             max_retries=max_retries, default_headers={SESSION_HEADER: self.client_id})
        self.finished = False
        if register:
            self._post("/workflows", workflow.spec.to_dict())

    def agent(self, name: str) -> Agent:
        if name not in self.workflow.spec.agents:
            raise UnknownAgentError(name, self.workflow.name, self.workflow.spec.agents)
        return Agent(self, name)

    def metadata(self, agent: str) -> dict[str, Any]:
        return {"client_id": self.client_id, "workflow": self.workflow.name, "agent": agent}

    def finish(self) -> None:
        """Tell the server this instance is over (its prompts are retired first at eviction)."""
        if not self.finished:
            self.finished = True
            self._post(f"/clients/{self.client_id}/finish", {})

    def __enter__(self) -> WorkflowRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """Registering and finishing are idempotent, so a 5xx or a dropped connection is retried like
        the agent calls (`max_retries` times, backing off from 0.5 s)."""
        headers = {"Content-Type": "application/json", SESSION_HEADER: self.client_id}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode()
        for attempt in range(self.max_retries + 1):
            request = urllib.request.Request(self.base_url + path, data=data, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    raw = response.read()
                return json.loads(raw) if raw else {}
            except urllib.error.HTTPError as exc:
                detail = exc.read().decode(errors="replace")
                if exc.code >= 500 and attempt < self.max_retries:
                    time.sleep(0.5 * 2**attempt)
                    continue
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    detail = json.loads(detail)["error"]["message"]
                raise RuntimeError(f"POST {path} failed with HTTP {exc.code}: {detail}") from None
            except (urllib.error.URLError, ConnectionError):
                if attempt >= self.max_retries:
                    raise
                time.sleep(0.5 * 2**attempt)
        raise AssertionError("unreachable")


class Agent:
    def __init__(self, run: WorkflowRun, name: str) -> None:
        self.run = run
        self.name = name

    @property
    def prompt(self) -> str | None:
        return self.run.workflow.spec.agents[self.name].prompt

    def messages(self, messages: Sequence[dict[str, str]]) -> list[dict[str, str]]:
        """The agent's fixed prompt first (as the system message), unless the caller gave a system message."""
        out = [dict(m) for m in messages]
        if self.prompt and not (out and out[0].get("role") == "system"):
            out.insert(0, {"role": "system", "content": self.prompt})
        return out

    def chat(self, messages: Sequence[dict[str, str]], **kwargs: Any) -> Any:
        """`chat.completions.create` with this agent's prompt and kvflow metadata; returns the
        OpenAI SDK's response (a stream iterator with `stream=True`)."""
        extra = dict(kwargs.pop("extra_body", None) or {})
        extra["kvflow"] = self.run.metadata(self.name)
        return self.run.openai.chat.completions.create(
            model=kwargs.pop("model", self.run.model or "default"), messages=self.messages(messages),
            extra_body=extra, **kwargs)

    def text(self, messages: Sequence[dict[str, str]], **kwargs: Any) -> str:
        """The reply's text."""
        return self.chat(messages, **kwargs).choices[0].message.content or ""
