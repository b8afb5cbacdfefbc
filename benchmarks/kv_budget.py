"""Per-request KV budgets on the embedded default model (SmolLM2-135M-Instruct): answer quality of every
scorer at four budgets against full KV, with paired-bootstrap 95% intervals, and the throughput the
budget buys at a fixed pool, side by side in one run (docs/design.md §13).

Quality. A seeded script writes agent trajectories in the model's chat template: a system prompt that
states a project codename, a task, then rounds of thinking (`<think>`), a tool call (`<tool_call>`) and
its result (`<tool_response>`: records of key-value fields, one per search). The final question asks
either the codename (from the system prompt) or a field of the first search's result; the gold answer
is that value. Each trajectory is teacher-forced in chunks of Δ tokens; under a budget the request
compacts between chunks exactly as the engine does (`engines/cpu/kv_budget.py`: the same scorer,
phase tracker and compaction), so that it holds at most B + Δ tokens. Scores: the gold answer's
log-probability, teacher-forced after the question, and exact match (greedy decoding spells it). The
budgeted runs start from the full run's KV up to their first compaction (identical until then). Also
per scorer and budget: the share of the gold answer's mention in the context still held when the
question is asked (`fact_kept`).

Phases. AgentKV's premise, on the same trajectories with full KV: queries of one phase (think, act,
tool) read other keys than queries of another. Each phase segment's most-read keys are compared with
those of the same phase's next segment (a round later) and of the other phases' segments in between
(nearer in time); and, at the end of the context, each scorer's top-ranked keys with those the final
question then reads (`phase_effect`).

Throughput. Turns of P prompt + G generated tokens (distinct prompts, `ignore_eos`) on the CPU engine
at a device pool where full KV must queue: how many run at once, output tokens/s, and the share of
compute time spent compacting, full KV and the budget in one run.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import results_file
import torch

from kvflow_ray.core.kv_budget import KV_SCORERS, MIN_BUDGET, KvBudget, PhaseMarkers, PhaseTracker, parse_scorer
from kvflow_ray.core.stats import paired_bootstrap
from kvflow_ray.engines.base import GenerateRequest
from kvflow_ray.engines.cpu.config import CpuEngineConfig, ModelConfig
from kvflow_ray.engines.cpu.engine import CpuEngine
from kvflow_ray.engines.cpu.kv_budget import BudgetedKV, KeyScores, attention_paid, compact
from kvflow_ray.engines.cpu.kv_pool import KVPool
from kvflow_ray.engines.cpu.model import CpuModel, QueryCapture
from kvflow_ray.engines.cpu.weights import resolve_model, served_name
from kvflow_ray.engines.tokenizer import load_tokenizer
from kvflow_ray.progress import progress

SCORERS = tuple(KV_SCORERS.names())
WORDS = ("amber", "basalt", "cinder", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lumen", "meadow", "nimbus", "onyx", "pylon", "quartz", "raven", "summit", "tundra", "umber", "vertex",
         "willow", "xenon", "yarrow", "zephyr")
TOOLS = ("search_records", "lookup_inventory", "query_logs", "fetch_report", "scan_tickets")
FIELDS = ("ticket", "order", "batch", "invoice", "shipment", "permit", "badge", "locker", "voucher", "parcel",
          "contract", "license", "serial", "account", "booking", "claim")
THOUGHTS = ("The {tool} result lists {n} records, so the {f} fields are there.",
            "I still need to compare the {f} values against the task before I answer.",
            "Nothing in the last output contradicts the earlier {f} entries.",
            "Next I will call {tool} with a narrower query about {w}.",
            "The records mention {w} twice, which may matter for the report.",
            "I should keep track of every {f} value in case the user asks later.",
            "The status fields look consistent, but the {w} entry is unusual.",
            "Let me summarise: {n} matches so far, mostly about {w}.")


def value(rng: random.Random) -> str:
    return f"{rng.choice(WORDS).capitalize()} {rng.choice(WORDS).capitalize()}"


@dataclass
class Trajectory:
    context: list[int]  # the trajectory up to the question
    question: list[int]  # the final question, then the assistant's answer up to the value
    gold: list[int]
    gold_text: str
    kind: str  # "system" (the codename) | "tool" (a field of the first search)
    gold_at: int  # the position of the answer's first mention
    gold_end: int  # ... and of the token after it: the mention is positions [gold_at, gold_end)


def make_trajectory(rng: random.Random, tok: Any, rounds: int, records: int, think: int) -> Trajectory:
    """Seeded rounds of think, act and tool output; the question asks the codename or a field of the
    first tool result (equally often)."""
    codename = value(rng)
    kind = rng.choice(("system", "tool"))
    fields = rng.sample(FIELDS, len(FIELDS))
    asked_field = fields[0]
    messages: list[dict[str, str]] = [
        {"role": "system", "content": "You are a careful research agent. Think inside <think></think>, call tools "
                                      "inside <tool_call></tool_call> and read their results inside "
                                      f"<tool_response></tool_response>.\nProject codename: {codename}."},
        {"role": "user", "content": f"Task: audit the {rng.choice(WORDS)} {rng.choice(WORDS)} records and report "
                                    "anything unusual."},
    ]
    gold = codename
    for r in range(rounds):
        tool = rng.choice(TOOLS)
        thought = " ".join(rng.choice(THOUGHTS).format(tool=tool, f=rng.choice(fields[1:]), w=rng.choice(WORDS),
                                                       n=rng.randrange(2, 9)) for _ in range(think))
        call = f'{{"name": "{tool}", "arguments": {{"query": "{rng.choice(WORDS)} {rng.choice(WORDS)}"}}}}'
        messages.append({"role": "assistant", "content": f"<think>\n{thought}\n</think>\n<tool_call>\n{call}\n"
                                                         "</tool_call>"})
        lines = []
        for i in range(records):
            name = asked_field if r == 0 and i == 0 else fields[1 + (r * records + i) % (len(fields) - 1)]
            fact = value(rng)
            if r == 0 and i == 0 and kind == "tool":
                gold = fact
            lines.append(f"{name}: {fact}; status: {rng.choice(('open', 'closed', 'pending'))}; "
                         f"site: {rng.choice(WORDS)}")
        messages.append({"role": "user", "content": "<tool_response>\n" + "\n".join(lines) + "\n</tool_response>"})
    if kind == "system":
        question, prefix = "What is the project codename?", "The project codename is"
    else:
        question = f"Which {asked_field} appears in the first tool result?"
        prefix = f"The {asked_field} in the first tool result is"
    text = tok.apply_chat_template([*messages, {"role": "user", "content": question}]) + prefix
    split = text.rfind("<|", 0, text.rindex(question))  # where the question's turn starts
    context_text = text[:split]
    mention = context_text.index(gold)
    gold_at = len(tok.encode(context_text[:mention]))
    gold_end = len(tok.encode(context_text[:mention + len(gold)]))
    asked = tok.encode(text[split:])
    answered = tok.encode(text[split:] + " " + gold)
    if answered[:len(asked)] != asked:
        raise ValueError(f"the answer prefix {prefix!r} tokenizes differently before the answer")
    return Trajectory(tok.encode(context_text), asked, answered[len(asked):], gold, kind, gold_at, gold_end)


class Run:
    """One sequence in a pool, fed chunk by chunk; under a budget it compacts before a chunk that would
    take it past B + Δ, with the engine's own objects."""

    def __init__(self, model: Any, pool: Any, piece: Callable[[int], str], markers: PhaseMarkers,
                 budget: KvBudget | None = None, scorer: str | None = None, capture: bool = False) -> None:
        self.model, self.pool, self.piece = model, pool, piece
        self.own = torch.arange(pool.capacity)
        self.pos = 0
        self.kv = None
        if budget is not None:
            assert scorer is not None
            self.kv = BudgetedKV(budget, KeyScores(parse_scorer(scorer), model.attn_scale), PhaseTracker(markers))
        self.capture = capture or (self.kv is not None and self.kv.wants_queries)
        self.captures: list[tuple[torch.Tensor, torch.Tensor]] = []  # per chunk (the full run keeps them)
        self.compact_s = 0.0

    @property
    def written(self) -> int:
        return len(self.kv.positions) if self.kv is not None else self.pos

    def make_room(self, new: int) -> None:
        if self.kv is not None and self.kv.budget.due(len(self.kv.positions), new):
            started = time.perf_counter()
            compact(self.pool, self.own, self.kv)
            self.compact_s += time.perf_counter() - started

    def feed(self, tokens: Sequence[int], every: bool = False, keep: bool = False, room: int = 0) -> torch.Tensor:
        """Run `tokens` after what was fed; `room`: tokens that will follow without a compaction."""
        self.make_room(len(tokens) + room)
        capture = QueryCapture() if self.capture else None
        n = len(tokens)
        if self.written + n > len(self.own):  # a shorter slot list would overwrite the end of the context
            raise ValueError(f"the pool has {len(self.own)} slots; {self.written} are written, {n} more asked")
        logits = self.model.prefill(self.pool, list(tokens), self.own[:self.written + n], every, start=self.pos,
                                    capture=capture)
        stacked = capture.stacked() if capture is not None else None
        if keep and stacked is not None:
            self.captures.append((stacked[0][0], stacked[1][0]))
        self._observe(tokens, stacked[0][0] if stacked else None, stacked[1][0] if stacked else None)
        return logits

    def _observe(self, tokens: Sequence[int], queries: torch.Tensor | None, lses: torch.Tensor | None) -> None:
        positions = list(range(self.pos, self.pos + len(tokens)))
        self.pos += len(tokens)
        if self.kv is not None:
            self.kv.observe(queries, lses, positions, [self.piece(t) for t in tokens])

    def replay(self, full: Run, chunks: Sequence[Sequence[int]]) -> int:
        """Take the full run's KV and queries for the leading chunks that fit before the first compaction
        (identical in both runs); returns how many it took."""
        assert self.kv is not None and full.captures
        taken = 0
        for chunk, (queries, lses) in zip(chunks, full.captures, strict=False):
            if self.kv.budget.due(len(self.kv.positions), len(chunk)):
                break
            span = slice(self.pos, self.pos + len(chunk))
            self.pool.k[:, :, span] = full.pool.k[:, :, span]
            self.pool.v[:, :, span] = full.pool.v[:, :, span]
            self._observe(chunk, queries, lses)
            taken += 1
        return taken

    def answer(self, question: Sequence[int], gold: Sequence[int], eos: set[int],
               extra: int) -> tuple[float, list[int]]:
        """The gold answer's teacher-forced log-probability after `question`, and the greedy answer
        (at most len(gold) + extra tokens) from the same state."""
        logits = self.feed(question, room=len(gold) + extra + 1)
        first = torch.log_softmax(logits, -1)
        logprob = float(first[gold[0]])
        # greedy branch: slots past where the gold answer goes, the context up to the question shared
        base, pos = self.written, self.pos
        scratch = self.own[base + len(gold): base + len(gold) + len(gold) + extra]
        out = [int(torch.argmax(logits))]
        for i in range(len(gold) + extra - 1):
            if out[-1] in eos:
                break
            ctx = torch.cat([self.own[:base], scratch[:i + 1]])
            step = self.model.decode(self.pool, [out[-1]], [ctx], positions=[pos + i])
            out.append(int(torch.argmax(step[0])))
        if len(gold) > 1:
            logits = self.model.prefill(self.pool, list(gold[:-1]), self.own[:base + len(gold) - 1], True, start=pos)
            lp = torch.log_softmax(logits, -1)
            logprob += float(sum(lp[i, gold[i + 1]] for i in range(len(gold) - 1)))
        return logprob, out


def chunked(tokens: Sequence[int], size: int) -> list[list[int]]:
    return [list(tokens[i:i + size]) for i in range(0, len(tokens), size)]


@dataclass
class Scores:
    logprob: dict[str, list[float]] = field(default_factory=dict)
    exact: dict[str, list[float]] = field(default_factory=dict)
    fact: dict[str, list[float]] = field(default_factory=dict)  # the share of the mention's tokens kept
    compact_s: dict[str, float] = field(default_factory=dict)
    kinds: list[str] = field(default_factory=list)

    def add(self, name: str, logprob: float, exact: bool, fact: float = 1.0) -> None:
        self.logprob.setdefault(name, []).append(logprob)
        self.exact.setdefault(name, []).append(float(exact))
        self.fact.setdefault(name, []).append(fact)


def matches(tok: Any, out: list[int], gold: str) -> bool:
    text = tok.decode(out).strip().strip(".").strip().lower()
    return text.startswith(gold.lower())


def quality(model: Any, tok: Any, trajectories: list[Trajectory], budgets: Sequence[int], interval: int,
            tick: Callable[[], None]) -> Scores:
    markers = PhaseMarkers.for_template(getattr(tok, "chat_template", None))
    eos = {t for t in (tok.eos_id, *tok.encode("<|im_end|>")) if t is not None}
    scores = Scores()
    extra = 3
    for t in trajectories:
        capacity = len(t.context) + len(t.question) + 3 * len(t.gold) + 2 * extra + 8
        full_pool = model.pool("full", capacity)
        budget_pool = KVPool("budget", capacity, model.n_layers, model.n_kv_heads, model.head_dim, model.torch_dtype)
        chunks = chunked(t.context, interval)
        full = Run(model, full_pool, tok.piece, markers, capture=True)
        for chunk in chunks:
            full.feed(chunk, keep=True)
        lp, out = full.answer(t.question, t.gold, eos, extra)
        scores.add("full", lp, matches(tok, out, t.gold_text))
        scores.kinds.append(t.kind)
        for b in budgets:
            for scorer in SCORERS:
                run = Run(model, budget_pool, tok.piece, markers, KvBudget(b, interval), scorer)
                taken = run.replay(full, chunks)
                for chunk in chunks[taken:]:
                    run.feed(chunk)
                lp, out = run.answer(t.question, t.gold, eos, extra)
                name = f"{scorer}@{b}"
                assert run.kv is not None
                mention = range(t.gold_at, t.gold_end)
                kept = len(set(mention).intersection(run.kv.positions)) / len(mention)
                scores.add(name, lp, matches(tok, out, t.gold_text), kept)
                scores.compact_s[name] = scores.compact_s.get(name, 0.0) + run.compact_s
        tick()
    return scores


def summarise(scores: Scores, budgets: Sequence[int], rng: random.Random, resamples: int) -> dict[str, Any]:
    lp, n = scores.logprob, len(scores.logprob["full"])

    def diff(a: str, b: str) -> tuple[float, float, float]:
        return paired_bootstrap(n, lambda idx: statistics.fmean(lp[a][i] - lp[b][i] for i in idx), rng, resamples)

    out: dict[str, Any] = {
        "trajectories": n,
        "kinds": {k: scores.kinds.count(k) for k in sorted(set(scores.kinds))},
        "mean_logprob": {m: statistics.fmean(v) for m, v in lp.items()},
        "exact_match": {m: statistics.fmean(v) for m, v in scores.exact.items()},
        # the share of the gold answer's mention in the context still in the KV when the question is asked
        "fact_kept": {m: statistics.fmean(v) for m, v in scores.fact.items()},
        "budgets": {},
    }
    for b in budgets:
        out["budgets"][str(b)] = {
            "agentkv_minus_recent": diff(f"agentkv@{b}", f"recent@{b}"),
            "minus_full": {s: diff(f"{s}@{b}", "full") for s in SCORERS},
            "by_kind": {kind: {s: statistics.fmean(lp[name][i] for i in range(n) if scores.kinds[i] == kind)
                               for s, name in (("full", "full"), *((s, f"{s}@{b}") for s in SCORERS))}
                        for kind in sorted(set(scores.kinds))},
        }
    return out


# ---------------------------------------------------------------------- does this model show a phase effect?
PHASE_ORDER = ("think", "act", "tool")  # a round's segments, in the order the trajectory writes them
TOP_SHARE = 0.25  # the keys a segment reads most: this share of the keys it could read


def phase_segments(phases: Sequence[str]) -> dict[str, list[tuple[int, int]]]:
    """phase -> its maximal runs of positions [start, end), in order."""
    out: dict[str, list[tuple[int, int]]] = {}
    start = 0
    for i in range(1, len(phases) + 1):
        if i == len(phases) or phases[i] != phases[start]:
            out.setdefault(phases[start], []).append((start, i))
            start = i
    return out


def _comparisons(segments: dict[str, list[tuple[int, int]]]) -> list[tuple[tuple[int, int], tuple[int, int],
                                                                            list[tuple[int, int]]]]:
    """(anchor, the same phase's next segment, the other phases' segments between them): a think, act or
    tool segment of round r against its own phase in round r + 1 and the nearer segments of the other
    phases."""
    out = []
    for phase in PHASE_ORDER:
        runs = segments.get(phase, [])
        for anchor, later in itertools.pairwise(runs):
            between = [seg for other in PHASE_ORDER if other != phase for seg in segments.get(other, [])
                       if anchor[1] <= seg[0] and seg[1] <= later[0]]
            if between:
                out.append((anchor, later, between))
    return out


def phase_effect(model: Any, tok: Any, trajectories: list[Trajectory], interval: int, sinks: int,
                 tick: Callable[[], None]) -> dict[str, Any]:
    """AgentKV's premise, measured directly on full KV: queries of one phase read other keys than queries
    of another. For each think, act or tool segment (the anchor), the keys it could read (after the
    sinks, before it) are ranked by the attention paid them by the anchor's queries, by the same phase's
    next segment (a round later), and by the other phases' segments between the two (nearer in time).
    With a phase effect the same phase, though farther, shares more of the anchor's most-read keys
    (top `TOP_SHARE`, Jaccard) than the other phases do; recency alone predicts the opposite."""
    markers = PhaseMarkers.for_template(getattr(tok, "chat_template", None))
    same: list[float] = []  # per trajectory: mean Jaccard with the same phase's next segment
    other: list[float] = []  # ... with the other phases' segments in between
    question: dict[str, list[float]] = {}  # scorer -> per trajectory: its top keys against the question's
    pairs = 0
    for t in trajectories:
        pool = model.pool("phases", len(t.context) + len(t.question))
        run = Run(model, pool, tok.piece, markers, capture=True)
        for chunk in chunked(t.context, interval):
            run.feed(chunk, keep=True)
        run.feed(t.question, keep=True)
        reads = Reads.of(run)
        phases = PhaseTracker(markers).extend([tok.piece(x) for x in t.context])
        # which scorer, at the end of the context, ranks highest the keys the final question then reads
        context = range(sinks, len(t.context))
        asked = reads.most_read((len(t.context), len(t.context) + len(t.question)), context)
        for scorer in SCORERS:
            question.setdefault(scorer, []).append(_jaccard(asked, reads.kept_by(scorer, phases, context, interval)))
        near, far = [], []
        for anchor, later, between in _comparisons(phase_segments(phases)):
            if anchor[0] - sinks < 8:  # too little to read before it
                continue
            keys = range(sinks, anchor[0])
            mine = reads.most_read(anchor, keys)
            far.append(_jaccard(mine, reads.most_read(later, keys)))
            near.append(statistics.fmean(_jaccard(mine, reads.most_read(seg, keys)) for seg in between))
        same.append(statistics.fmean(far) if far else math.nan)
        other.append(statistics.fmean(near) if near else math.nan)
        pairs += len(far)
        tick()
    return {"trajectories": len(trajectories), "comparisons": pairs, "top_share": TOP_SHARE, "same": same,
            "other": other, "question": question}


@dataclass
class Reads:
    """A full run's KV and every position's queries ([T, L, Hq, D]) and log-sum-exps ([T, L, Hq])."""

    run: Run
    queries: torch.Tensor
    lses: torch.Tensor

    @classmethod
    def of(cls, run: Run) -> Reads:
        queries, lses = (torch.cat(part) for part in zip(*run.captures, strict=True))
        return cls(run, queries, lses)

    def most_read(self, segment: tuple[int, int], keys: range) -> set[int]:
        """The positions among `keys` that the queries of `segment` pay most attention (top `TOP_SHARE`)."""
        entries = [(p, self.queries[p].float(), self.lses[p].float()) for p in range(*segment)]
        run = self.run
        return _top(attention_paid(run.pool, run.own[keys.start:keys.stop], torch.tensor(keys), entries,
                                   run.model.attn_scale), keys)

    def kept_by(self, scorer: str, phases: Sequence[str], keys: range, interval: int) -> set[int]:
        """The positions among `keys` that `scorer` ranks highest (top `TOP_SHARE`) after the queries of
        positions [0, len(phases)), fed `interval` at a time as the engine feeds them (a scorer that
        accumulates re-scores after each), as a compaction there would rank them."""
        run = self.run
        scores = KeyScores(parse_scorer(scorer), run.model.attn_scale)
        slots, at = run.own[keys.start:keys.stop], torch.tensor(keys)
        for start in range(0, len(phases), interval):
            seen = range(start, min(start + interval, len(phases)))
            scores.observe(self.queries[seen.start:seen.stop], self.lses[seen.start:seen.stop], list(seen),
                           phases[seen.start:seen.stop])
            if scores.scorer.accumulates:
                scores.scores(run.pool, slots, at)
        return _top(scores.scores(run.pool, slots, at), keys)


def _top(paid: torch.Tensor, keys: range) -> set[int]:
    return {keys.start + int(i) for i in torch.topk(paid, max(1, round(TOP_SHARE * len(paid)))).indices}


def _jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b)


def summarise_phases(raw: dict[str, Any], rng: random.Random, resamples: int) -> dict[str, Any]:
    n, question = raw["trajectories"], raw["question"]
    paired = [i for i in range(n) if not math.isnan(raw["same"][i])]  # trajectories with a comparison
    same, other = ([raw[k][i] for i in paired] for k in ("same", "other"))
    return {**{k: raw[k] for k in ("trajectories", "comparisons", "top_share")},
            "same_phase_later": statistics.fmean(same), "other_phases_nearer": statistics.fmean(other),
            "same_minus_other": paired_bootstrap(len(paired),
                                                 lambda idx: statistics.fmean(same[i] - other[i] for i in idx),
                                                 rng, resamples),
            "question_overlap": {s: statistics.fmean(v) for s, v in question.items()},
            "question_agentkv_minus_recent": paired_bootstrap(
                n, lambda idx: statistics.fmean(question["agentkv"][i] - question["recent"][i] for i in idx),
                rng, resamples)}


# AgentKV's: the method, whose re-scores (32 buffered queries, as `recent`) are what compaction costs
THROUGHPUT_SCORER = "agentkv"


def throughput(model_path: str | None, prompt: int, generated: int, budget: int, requests: int,
               full_concurrency: int, tick: Callable[[], None]) -> dict[str, Any]:
    """Turns of `prompt` + `generated` tokens at a pool where full KV runs `full_concurrency` at once."""
    pool = full_concurrency * (prompt + generated) + 64
    model = CpuModel(ModelConfig(path=model_path, max_context=prompt + generated + 64))
    rng = random.Random(3)
    vocab = model.vocab_size
    prompts = [[rng.randrange(100, vocab - 100) for _ in range(prompt)] for _ in range(requests)]
    out: dict[str, Any] = {"prompt": prompt, "generated": generated, "budget": budget, "requests": requests,
                           "device_kv_tokens": pool, "scorer": THROUGHPUT_SCORER}
    for label, kv_budget in (("full", None), (f"kv{budget}", budget)):
        engine = CpuEngine(CpuEngineConfig(policy="lru", device_kv_tokens=pool, link_gbps=None, chunk_tokens=prompt,
                                           max_running=64), model=model)
        reqs = [engine.submit(GenerateRequest(tokens=p, max_tokens=generated, ignore_eos=True, kv_budget=kv_budget,
                                              kv_scorer=THROUGHPUT_SCORER if kv_budget else None))
                for p in prompts]
        started = time.perf_counter()
        most, private_peak, decoded = 0, 0, 0
        while engine.busy:
            engine.step()
            running = engine.scheduler.running
            most = max(most, len(running))
            private_peak = max([private_peak] + [len(r.kv.positions) for r in running if r.kv is not None])
            done = sum(len(r.out) for r in reqs)
            if done - decoded >= generated // 4:
                decoded = done
                tick()
        wall = time.perf_counter() - started
        failed = [r.error for r in reqs if r.error is not None]
        if failed:
            raise RuntimeError(f"throughput: a request failed: {failed[0]}")
        stats = engine.stats()
        output = sum(len(r.result.tokens) for r in reqs if r.result is not None)
        out[label] = {"max_running": most, "wall_s": wall, "output_tokens_per_s": output / wall,
                      "compute_s": stats["compute_s"], "compaction_s": stats["kv_budget"]["compaction_s"],
                      "compaction_share": stats["kv_budget"]["compaction_s"] / max(stats["compute_s"], 1e-9),
                      "compactions": stats["kv_budget"]["compactions"], "max_private_kv": private_peak}
        engine.close()
    b = out[f"kv{budget}"]
    out["concurrency_ratio"] = b["max_running"] / out["full"]["max_running"]
    out["throughput_ratio"] = b["output_tokens_per_s"] / out["full"]["output_tokens_per_s"]
    return out


def main() -> int:
    ap = results_file.parser(__doc__, "kv_budget", "a smoke run: a few short trajectories, a small throughput run")
    ap.add_argument("--trajectories", type=int, default=100, help="trajectories (each scored at every budget)")
    ap.add_argument("--budgets", default="128,256,384,768", help="KV budgets B (tokens) of the quality section")
    ap.add_argument("--interval", type=int, default=128, help="Δ: tokens between compactions")
    ap.add_argument("--rounds", type=int, default=4, help="think/act/tool rounds per trajectory (~220 tokens each)")
    ap.add_argument("--records", type=int, default=6, help="records per tool result")
    ap.add_argument("--think", type=int, default=3, help="sentences per thought")
    ap.add_argument("--prompt", type=int, default=1024, help="throughput: prompt tokens per turn")
    ap.add_argument("--generated", type=int, default=3072, help="throughput: generated tokens per turn")
    ap.add_argument("--budget", type=int, default=1024, help="throughput: the budget B")
    ap.add_argument("--full-concurrency", type=int, default=2, help="throughput: turns full KV fits in the pool")
    ap.add_argument("--requests", type=int, default=7, help="throughput: turns submitted at once")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--sections", default="quality,phases,throughput",
                    help="any of quality, phases (whether the model's queries read by phase), throughput")
    ap.add_argument("--model", default="smollm2-135m", help="a built-in model name")
    ap.add_argument("--seed", type=int, default=11)
    args = ap.parse_args()
    if args.quick:
        args.trajectories, args.rounds, args.resamples = 2, 2, 100
        args.prompt, args.generated, args.budget, args.requests = 128, 128, MIN_BUDGET, 3
        args.budgets = "128,768"  # one that compacts the short trajectories, one that keeps them whole
    budgets = [int(b) for b in args.budgets.split(",") if b]
    sections = set(args.sections.split(","))

    started = time.perf_counter()
    try:
        path = resolve_model(args.model)
    except ValueError as exc:  # the model's wheel is not installed: one line naming the install command
        sys.exit(f"kv_budget: {exc}")
    report: dict[str, Any] = {"model": served_name(args.model), "scorers": list(SCORERS), "budgets": budgets,
                              "params": vars(args) | {"out": str(args.out)}}
    if sections & {"quality", "phases"}:  # the same trajectories for both
        model = CpuModel(ModelConfig(path=path, max_context=8192))
        tok = load_tokenizer(path)
        rng = random.Random(args.seed)
        trajectories = [make_trajectory(rng, tok, args.rounds, args.records, args.think)
                        for _ in range(args.trajectories)]
        report["trajectory_tokens"] = statistics.fmean(len(t.context) for t in trajectories)
        report["gold_position"] = statistics.fmean(t.gold_at for t in trajectories)
    if "quality" in sections:
        with progress(len(trajectories), "trajectories", "trajectory", disable=args.no_progress) as bar:
            scores = quality(model, tok, trajectories, budgets, args.interval, lambda: bar.update(1))
        report["quality"] = summarise(scores, budgets, rng, args.resamples)
        report["quality"]["compaction_s"] = scores.compact_s
        report["wall_s"] = time.perf_counter() - started
        results_file.write(args.out, "kv_budget", report, lambda p: plot(report, p))  # kept if a later section fails
    if "phases" in sections:
        with progress(len(trajectories), "phases", "trajectory", disable=args.no_progress) as bar:
            raw = phase_effect(model, tok, trajectories, args.interval, KvBudget(MIN_BUDGET).sinks,
                               lambda: bar.update(1))
        report["phases"] = summarise_phases(raw, random.Random(args.seed), args.resamples)
        report["wall_s"] = time.perf_counter() - started
        results_file.write(args.out, "kv_budget", report, lambda p: plot(report, p))
    if "throughput" in sections:
        # a tick per quarter of a turn's tokens decoded, over all turns: 4 per turn and run
        with progress(2 * 4 * args.requests, "throughput", "quarter turn", disable=args.no_progress) as bar:
            report["throughput"] = throughput(path, args.prompt, args.generated, args.budget, args.requests,
                                              args.full_concurrency, lambda: bar.update(1))
    report["wall_s"] = time.perf_counter() - started
    print_report(report)
    results_file.write(args.out, "kv_budget", report, lambda p: plot(report, p))
    return 0


def fmt(ci: Sequence[float], digits: int = 2) -> str:
    return f"{ci[0]:+.{digits}f} [{ci[1]:+.{digits}f}, {ci[2]:+.{digits}f}]"


def print_report(report: dict[str, Any]) -> None:
    print(f"kv budget on {report['model']}")
    q = report.get("quality")
    if q:
        print(f"quality: {q['trajectories']} trajectories ({report['trajectory_tokens']:.0f} tokens, kinds "
              f"{q['kinds']}); gold log-probability (exact match)")
        lp, em = q["mean_logprob"], q["exact_match"]
        print(f"  full KV: {lp['full']:.2f} ({em['full']:.2f})")
        for b in report["budgets"]:
            row = "  ".join(f"{s} {lp[f'{s}@{b}']:.2f} ({em[f'{s}@{b}']:.2f})" for s in report["scorers"])
            print(f"  B={b}: {row}")
            kept = "  ".join(f"{s} {q['fact_kept'][f'{s}@{b}']:.2f}" for s in report["scorers"])
            print(f"         the gold fact's tokens kept: {kept}")
            print(f"         agentkv - recent: {fmt(q['budgets'][str(b)]['agentkv_minus_recent'])}")
    ph = report.get("phases")
    if ph:
        print(f"phases: {ph['comparisons']} segments of {ph['trajectories']} trajectories; the top "
              f"{ph['top_share']:.0%} of keys each reads, Jaccard with the anchor's: same phase a round later "
              f"{ph['same_phase_later']:.3f}, other phases in between {ph['other_phases_nearer']:.3f}")
        print(f"  same - other: {fmt(ph['same_minus_other'], 3)} (above 0: queries read by phase)")
        overlap = "  ".join(f"{s} {v:.3f}" for s, v in ph["question_overlap"].items())
        print(f"  the final question's top keys against each scorer's at the end of the context (Jaccard): {overlap}")
        print(f"  agentkv - recent: {fmt(ph['question_agentkv_minus_recent'], 3)}")
    t = report.get("throughput")
    if t:
        full, b = t["full"], t[f"kv{t['budget']}"]
        print(f"throughput: {t['requests']} turns of {t['prompt']} + {t['generated']} tokens, "
              f"pool {t['device_kv_tokens']}")
        print(f"  running at once: full {full['max_running']}, B={t['budget']} {b['max_running']} "
              f"({t['concurrency_ratio']:.2f}x)")
        print(f"  output tokens/s: full {full['output_tokens_per_s']:.1f}, B={t['budget']} "
              f"{b['output_tokens_per_s']:.1f} ({t['throughput_ratio']:.2f}x); compaction {b['compaction_share']:.1%} "
              f"of compute; most private KV {b['max_private_kv']}")
    print(f"wall {report['wall_s']:.0f} s")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    q, t = report.get("quality"), report.get("throughput")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    if q:
        ax, budgets = axes[0], report["budgets"]
        for s in report["scorers"]:
            ax.plot(budgets, [q["mean_logprob"][f"{s}@{b}"] for b in budgets], marker="o", label=s)
        ax.axhline(q["mean_logprob"]["full"], color="black", linestyle="--", label="full KV")
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_xlabel("KV budget B (tokens)")
        ax.set_ylabel("gold answer log-probability (mean)")
        ax.set_title(f"{q['trajectories']} agent trajectories, {report['model']}")
        ax.legend()
        ax = axes[1]
        for s in report["scorers"]:
            ax.plot(budgets, [q["fact_kept"][f"{s}@{b}"] for b in budgets], marker="o", label=s)
        ax.set_xscale("log", base=2)
        ax.set_xticks(budgets, [str(b) for b in budgets])
        ax.set_ylim(-0.05, 1.05)
        ax.set_xlabel("KV budget B (tokens)")
        ax.set_ylabel("share of the gold fact's tokens kept")
        ax.set_title("the early fact, when the question is asked")
        ax.legend()
    if t:
        ax, labels = axes[2], ["full", f"kv{t['budget']}"]
        ax.bar([f"{x}\n{t[x]['max_running']} at once" for x in labels], [t[x]["output_tokens_per_s"] for x in labels],
               color=["grey", "tab:blue"])
        ax.set_ylabel("output tokens/s")
        ax.set_title(f"{t['prompt']} + {t['generated']}-token turns, pool {t['device_kv_tokens']}")
    results_file.save(fig, path)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
