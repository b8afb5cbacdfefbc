"""What the CPU engine runs: `CpuRequest`, a cache request with its sampling, stops, grammar, reuse and
KV budget, and `RequestBuilder`, which turns a `GenerateRequest` into one or refuses it with a
ValueError naming what this engine cannot run (empty, too long for the model's context or the device
pool, bad parameters, a combination it does not support). `submit` builds on the caller's thread:
building reads the engine's settings only (and makes the vocabulary's texts once, for grammars)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kvflow_ray.core.kv_budget import KvBudget, PhaseMarkers, PhaseTracker, parse_scorer
from kvflow_ray.core.reuse import MAX_DOCUMENTS, ReuseMethod, parse_reuse
from kvflow_ray.core.scheduler import CacheRequest
from kvflow_ray.engines.base import GenerateRequest, GenerateResult, request_tokens, session_turn
from kvflow_ray.engines.constrained import TokenConstraint, TokenTexts, check_constraint
from kvflow_ray.engines.cpu.config import CpuEngineConfig
from kvflow_ray.engines.cpu.kv_budget import BudgetedKV, KeyScores
from kvflow_ray.engines.cpu.model import CpuModel
from kvflow_ray.engines.stops import StopTokens


@dataclass(eq=False)
class CpuRequest(CacheRequest):
    temperature: float = 0.0
    top_p: float = 1.0
    # the request's stop strings over its output (set by the engine); it streams the tokens to on_token
    stops: StopTokens | None = None
    ignore_eos: bool = False
    constraint: TokenConstraint | None = None  # the grammar its output must spell (a forced tool call)
    generator: torch.Generator | None = None
    reuse: ReuseMethod | None = None  # how kept segments in its prompt are reused (None: exact, not at all)
    reused: int = 0  # prompt tokens placed from segments and not recomputed
    documents: tuple[tuple[int, ...], ...] = ()  # client-marked documents to keep as segments (under reuse)
    kv: BudgetedKV | None = None  # its private KV under a budget (docs/design.md §13)
    on_done: Callable[[CpuRequest], None] | None = None
    out: list[int] = field(default_factory=list)
    ctx: torch.Tensor | None = None  # device slot of the KV at each position (prompt, then output)
    # its private slots: all it reserved while its prompt is computed, then those past the committed prefix
    own: torch.Tensor | None = None
    base: int = 0  # first position computed by this request (own[i] holds position base + i)
    submitted_at: float = 0.0
    result: GenerateResult | None = None
    error: BaseException | None = None
    finish_reason: str = "length"


class RequestBuilder:
    """`GenerateRequest` -> `CpuRequest` for one engine: its model, tokenizer and settings (the KV budget
    defaults), the device pool's size, and why it cannot reuse KV beyond the prefix (None: it can)."""

    def __init__(self, config: CpuEngineConfig, model: CpuModel, tokenizer: Any, model_name: str, device_tokens: int,
                 cannot_reuse: str | None, phase_markers: PhaseMarkers) -> None:
        self.config = config
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.device_tokens = device_tokens
        self.cannot_reuse = cannot_reuse
        self.phase_markers = phase_markers
        self._token_texts: TokenTexts | None = None  # built at the first constrained request

    def build(self, request: GenerateRequest, on_token: Callable[[int], None] | None = None) -> CpuRequest:
        """The request as the engine runs it, its output streamed to `on_token`."""
        budget = self._kv_budget(request)
        tokens = request_tokens(request, model_name=self.model_name, encode=self.tokenizer.encode,
                                vocab_size=self.model.vocab_size, max_context=self.model.max_context,
                                device_tokens=self.device_tokens, constrained=True, reuses=True,
                                kv_budget=budget, budgets=True)
        reuse = parse_reuse(request.reuse)
        if len(request.documents) > MAX_DOCUMENTS or sum(len(d) for d in request.documents) > len(tokens):
            raise ValueError(f"documents: at most {MAX_DOCUMENTS}, together no longer than the prompt")
        if reuse.exact:
            reuse = None
        elif self.cannot_reuse:
            raise ValueError(f"reuse {request.reuse!r}: {self.model_name} cannot reuse KV beyond the prefix "
                             f"({self.cannot_reuse})")
        constraint = None
        if request.constraint is not None:
            grammar = check_constraint(request.constraint, request.max_tokens)
            if self._token_texts is None:  # once per engine (~0.15 s for a 49k vocabulary)
                self._token_texts = TokenTexts(self.tokenizer.decode, self.model.vocab_size, self.tokenizer.encode)
            constraint = TokenConstraint(grammar, self._token_texts)
        kv = self._budgeted(request, budget)
        if kv is not None and reuse is not None:
            raise ValueError("kv_budget and reuse cannot be combined: a compacted request keeps no segment")
        fixed = request.fixed_prefix_tokens
        generator = None
        if request.temperature > 0:
            generator = torch.Generator().manual_seed(request.seed if request.seed is not None else 0)
        return CpuRequest(workflow=request.workflow, agent=request.agent, tokens=tokens,
                          fixed_len=fixed if fixed is not None else -1, max_new=request.max_tokens,
                          cache_salt=request.cache_salt,
                          temperature=request.temperature, top_p=request.top_p,
                          stops=StopTokens(request.stop, self.tokenizer.decode, on_token),
                          ignore_eos=request.ignore_eos, constraint=constraint, generator=generator,
                          session=session_turn(request), reuse=reuse, submitted_at=time.perf_counter(),
                          documents=tuple(tuple(int(t) for t in doc) for doc in request.documents),
                          kv=kv, kv_budget=kv.budget if kv is not None else None)

    def _kv_budget(self, request: GenerateRequest) -> KvBudget | None:
        """The request's KV budget (its own, else the engine's default; None: unbudgeted)."""
        tokens = request.kv_budget if request.kv_budget is not None else self.config.kv_budget
        if tokens is None:
            return None
        if self.model.device.type != "cpu":
            raise ValueError(f"kv_budget: KV budgets run on the CPU only, not {self.model.device}")
        return KvBudget(tokens, self.config.kv_interval, self.config.kv_sinks)

    def _budgeted(self, request: GenerateRequest, budget: KvBudget | None) -> BudgetedKV | None:
        if budget is None:
            if request.kv_scorer is not None:
                raise ValueError("kv_scorer goes with a kv_budget (the call's, its tenant's or the engine's)")
            return None
        scorer = parse_scorer(request.kv_scorer or self.config.kv_scorer)
        return BudgetedKV(budget, KeyScores(scorer, self.model.attn_scale), PhaseTracker(self.phase_markers))
