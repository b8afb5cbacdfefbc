"""Measure the CPU engine on this machine and write the `cpu-reference` simulator profile.

The simulator's cost model is a roofline per forward step (engines/sim/profile.py):
    step = max(FLOPs / (peak_flops * prefill_mfu), bytes / (hbm_bytes_per_s * decode_mbu)) + overhead
Calibration times the engine's own step path (gather the past KV from the device pool, run the
model, scatter the new KV) and fits, with both efficiencies fixed at 1:
- decode steps at several context lengths: time = a + b * context. The slope is KV bytes per token /
  bandwidth, so hbm_bytes_per_s = kv_bytes_per_token / b; the intercept is weights / bandwidth + overhead;
- prefill chunks of several sizes and contexts: time - overhead = FLOPs / peak_flops (least squares);
- the host <-> device copy rate is timed on the engine's copy stream, each way (the `link_gbps` pacing
  included on a CPU; on a GPU, pinned host memory over the real link).

On a GPU (`--device cuda`) the same steps are timed and the profile is named for it (`--name`, e.g.
`h200-llama3.1-8b`; docs/gpu.md).
"""

from __future__ import annotations

import datetime as dt
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from kvflow_ray.engines.cpu.config import DEFAULT_PROFILE, CpuEngineConfig
from kvflow_ray.engines.cpu.kv_pool import paced_link
from kvflow_ray.engines.cpu.model import CpuModel
from kvflow_ray.engines.sim.profile import Profile, user_profile_dir

# (new tokens, context). Both kinds of prefill a workflow makes: whole prompts in chunks (recompute)
# and short dynamic suffixes after a long cached prefix (the common case once the cache works).
PREFILL_GRID = ((1024, 0), (1024, 1024), (32, 0), (256, 2048), (32, 1024), (32, 2048), (64, 2048), (128, 3072))
DECODE_CONTEXTS = (64, 1024, 2048, 3072)


def profile_path(out: str | None = None, name: str = DEFAULT_PROFILE) -> Path:
    return Path(out) if out else user_profile_dir() / f"{name}.yaml"


class _StepTimer:
    """Times whole engine steps (`CpuEngine.step`: scheduling, KV gather, forward, scatter, sampling)
    on an LRU engine whose pool holds everything, so each step's shape is known exactly."""

    def __init__(self, config: CpuEngineConfig, model: CpuModel) -> None:
        from dataclasses import replace

        from kvflow_ray.engines.cpu.engine import CpuEngine

        longest = max(max(ctx + n for n, ctx in PREFILL_GRID), max(DECODE_CONTEXTS)) + 16
        self.engine = CpuEngine(replace(config, policy="lru", device_kv_tokens=4 * longest, link_gbps=None,
                                        chunk_tokens=max(n for n, _c in PREFILL_GRID)), model=model)
        self.gen = torch.Generator().manual_seed(0)

    def fresh(self, n: int) -> tuple[int, ...]:
        return tuple(torch.randint(0, 256, (n,), generator=self.gen).tolist())

    def run(self, tokens: tuple[int, ...], max_tokens: int) -> list[float]:
        """Seconds of each forward step of one request (its prefill chunk, then its decodes)."""
        from kvflow_ray.engines.base import GenerateRequest

        self.engine.submit(GenerateRequest(tokens=tokens, max_tokens=max_tokens, ignore_eos=True))
        times = []
        while self.engine.busy:
            t0 = time.perf_counter()
            self.engine.step()
            times.append(time.perf_counter() - t0)
        return times

    def prefill(self, n: int, ctx: int, repeats: int) -> float:
        prefix = self.fresh(ctx)
        if ctx:
            self.run(prefix, 1)  # now cached: the next prompt's prefill computes exactly n tokens after ctx
        times = [self.run(prefix + self.fresh(n), 1)[0] for _ in range(repeats + 1)]
        return statistics.median(times[1:])  # the first pays for allocation and kernel selection

    def decode(self, ctx: int, repeats: int) -> float:
        steps = self.run(self.fresh(ctx), 2 + 2 * repeats)[1:]  # decodes at contexts ctx .. ctx + 2 * repeats
        return statistics.median(steps)

    def close(self) -> None:
        self.engine.close()


def calibrate(config: CpuEngineConfig, *, repeats: int = 3, log: Callable[[str], None] = lambda _m: None,
              model: CpuModel | None = None, name: str = DEFAULT_PROFILE) -> dict[str, Any]:
    """Measure and fit; returns {"values": profile fields (the profile called `name`), "measurements":
    raw timings}."""
    model = model if model is not None else CpuModel(config.model, threads=config.threads)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    timer = _StepTimer(config, model)
    try:
        timer.prefill(64, 0, 1)  # warm up
        decode = [(ctx, timer.decode(ctx, repeats * 3)) for ctx in DECODE_CONTEXTS]
        log("decode step: " + ", ".join(f"ctx {c}: {t * 1e3:.1f} ms" for c, t in decode))
        prefill = [(n, ctx, timer.prefill(n, ctx, repeats)) for n, ctx in PREFILL_GRID]
        log("prefill chunk: " + ", ".join(f"{n}@{c}: {t * 1e3:.0f} ms" for n, c, t in prefill))
    finally:
        timer.close()

    peak, attention_mfu, hbm, overhead, streamed = _fit(config, model, decode, prefill)

    h2d, d2h = _copy_rates(config, model, repeats)
    log(f"copy: host->device {h2d / 1e9:.3f} GB/s, device->host {d2h / 1e9:.3f} GB/s "
        f"(paced to {paced_link(config.link_gbps, model.device)} GB/s)")

    values = _profile_values(config, model, peak_flops=peak, attention_mfu=attention_mfu, hbm=hbm,
                             overhead=overhead, h2d=h2d, d2h=d2h, streamed=streamed, name=name)
    fitted = Profile(**values)
    errors = [fitted.step_time([(n, ctx)], []) / t - 1 for n, ctx, t in prefill]
    errors += [fitted.step_time([], [ctx]) / t - 1 for ctx, t in decode]
    log(f"fit: GEMM {peak / 1e9:.1f} GFLOP/s, attention {peak * attention_mfu / 1e9:.1f} GFLOP/s, "
        f"bandwidth {hbm / 1e9:.1f} GB/s, overhead {overhead * 1e3:.2f} ms; "
        f"worst step error {max(abs(e) for e in errors):.1%}")
    return {"values": values, "measurements": {"decode": decode, "prefill": prefill,
                                               "copy_bytes_per_s": {"h2d": h2d, "d2h": d2h}, "fit_errors": errors}}


COPY_TOKENS = 2048


def _copy_rates(config: CpuEngineConfig, model: CpuModel, repeats: int) -> tuple[float, float]:
    """Median bytes/s of 2,048-token copies on the engine's own copy stream, each way, between a device
    pool and a host pool as the engine makes them (paced on a CPU, pinned on a GPU)."""
    from queue import Queue

    from kvflow_ray.engines.cpu.kv_pool import CopyJob, CopyStream

    device, host = model.pool("calibration-device", COPY_TOKENS), model.host_pool("calibration-host", COPY_TOKENS)
    done: Queue[CopyJob] = Queue()
    stream = CopyStream("calibration", paced_link(config.link_gbps, model.device), done)
    rates: dict[str, list[float]] = {"h2d": [], "d2h": []}
    try:
        for _ in range(repeats + 1):  # the first of each pays for staging buffers and the stream
            for way, (src, dst) in (("d2h", (device, host)), ("h2d", (host, device))):
                slots = src.alloc(COPY_TOKENS)
                stream.submit(CopyJob(src, slots, dst, dst.alloc(COPY_TOKENS), lambda: None))
                job = done.get()
                src.free(job.src_slots)
                dst.free(job.dst_slots)
                rates[way].append(COPY_TOKENS * model.kv_bytes_per_token / (job.finished - job.started))
    finally:
        stream.close()
    return statistics.median(rates["h2d"][1:]), statistics.median(rates["d2h"][1:])


def _fit(config: CpuEngineConfig, model: CpuModel, decode: list[tuple[int, float]],
         prefill: list[tuple[int, int, float]]) -> tuple[float, float, float, float, float]:
    """(peak FLOP/s, attention efficiency, bytes/s, per-step overhead, bytes streamed per step)
    minimising the squared relative error of the roofline over every measured step.

    Decode times are a line in the context length: its slope is KV bytes per token / bandwidth. The
    intercept splits into a fixed overhead and bytes streamed per step (on a CPU mostly interpreter
    and dispatch cost, not weights: the float32 weights stay largely in cache). Each split is tried;
    GEMM and attention rates then follow from the prefill chunks by linear least squares."""
    xs, ys = [c for c, _ in decode], [t for _, t in decode]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum((x - mx) ** 2 for x in xs)
    hbm = model.kv_bytes_per_token / max(slope, 1e-12)
    intercept = max(my - slope * mx, 0.0)
    unit = Profile(**_profile_values(config, model, peak_flops=1.0, attention_mfu=1.0, hbm=hbm, overhead=0.0,
                                     h2d=1.0, d2h=1.0, streamed=0.0))
    gemm = [2.0 * unit.params * n for n, _c, _t in prefill]
    attn = [unit.attention_flops(n, c) for n, c, _t in prefill]
    best: tuple[float, tuple[float, float, float, float, float]] | None = None
    for i in range(101):
        overhead = intercept * i / 100
        streamed = (intercept - overhead) * hbm
        # weighted (1/t) least squares of t - overhead = gemm * x1 + attn * x2
        rows = [(g / t, a / t, (t - overhead) / t) for g, a, (_n, _c, t) in zip(gemm, attn, prefill, strict=True)]
        rates = _flop_rates(rows)
        if rates is None:
            continue
        x1, x2 = rates
        peak, attention_mfu = 1.0 / x1, x1 / x2
        prof = Profile(**_profile_values(config, model, peak_flops=peak, attention_mfu=attention_mfu, hbm=hbm,
                                         overhead=overhead, h2d=1.0, d2h=1.0, streamed=streamed))
        err = sum((prof.step_time([(n, c)], []) / t - 1) ** 2 for n, c, t in prefill)
        err += sum((prof.step_time([], [c]) / t - 1) ** 2 for c, t in decode)
        if best is None or err < best[0]:
            best = (err, (peak, attention_mfu, hbm, overhead, streamed))
    if best is None:
        raise RuntimeError("calibration could not fit the measured steps (timings too noisy?): run it again "
                           "on an idle machine")
    return best[1]


def _flop_rates(rows: list[tuple[float, float, float]]) -> tuple[float, float] | None:
    """Seconds per GEMM FLOP and per attention FLOP, (x1, x2), from least squares over rows of
    (GEMM FLOPs, attention FLOPs, time), each row already weighted; None when no positive pair fits.
    Where the two cannot be told apart with positive rates (on a GPU a short chunk's time is mostly
    launch overhead), one rate for every FLOP: attention at the GEMM rate."""
    s11 = sum(g * g for g, _a, _y in rows)
    s12 = sum(g * a for g, a, _y in rows)
    s22 = sum(a * a for _g, a, _y in rows)
    b1 = sum(g * y for g, _a, y in rows)
    b2 = sum(a * y for _g, a, y in rows)
    det = s11 * s22 - s12 * s12
    if det > 0:
        x1, x2 = (b1 * s22 - b2 * s12) / det, (s11 * b2 - s12 * b1) / det
        if x1 > 0 and x2 > 0:
            return x1, x2
    flops = s11 + 2 * s12 + s22  # sum of (g + a)^2
    x = (b1 + b2) / flops if flops > 0 else 0.0
    return (x, x) if x > 0 else None


def _profile_values(config: CpuEngineConfig, model: CpuModel, *, peak_flops: float, attention_mfu: float,
                    hbm: float, overhead: float, h2d: float, d2h: float, streamed: float,
                    name: str = DEFAULT_PROFILE) -> dict[str, Any]:
    kv = model.kv_bytes_per_token
    return {
        "name": name,
        "description": f"kvflow-ray engine on {_device_name(model)}, calibrated {dt.date.today().isoformat()}",
        # the device pool is exactly the engine's: memory = weights + pool, all of it static
        # `weight_bytes` is the fitted bytes streamed per step; memory = that + the pool, all static,
        # so the simulated device pool is exactly the engine's
        "gpu_memory_bytes": float(streamed + config.device_kv_tokens * kv),
        "mem_fraction_static": 1.0,
        "weight_bytes": float(streamed),
        "peak_flops": peak_flops,
        "hbm_bytes_per_s": hbm,
        "h2d_bytes_per_s": h2d,
        "d2h_bytes_per_s": d2h,
        "params": float(model.n_params),
        "n_layers": model.n_layers,
        "hidden_size": model.hidden_size,
        "n_kv_heads": model.n_kv_heads,
        "head_dim": model.head_dim,
        "kv_bytes_per_token": float(kv),
        "prefill_mfu": 1.0,
        "decode_mbu": 1.0,
        "iteration_overhead_s": overhead,
        "chunked_prefill_tokens": config.chunk_tokens,
        "idle_prefill_tokens": config.idle_chunk_tokens or 0,
        "max_running_requests": config.max_running,
        "host_kv_tokens": config.host_kv_tokens,
        "attention_mfu": attention_mfu,
    }


def _device_name(model: CpuModel) -> str:
    if model.device.type == "cuda":
        return f"{torch.cuda.get_device_name(model.device)} ({model.config.dtype})"
    return f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads"


def write_profile(profile: dict[str, Any], out: str | None = None) -> Path:
    import yaml

    path = profile_path(out, profile["values"]["name"])
    path.parent.mkdir(parents=True, exist_ok=True)
    m = profile["measurements"]
    lines = [
        "# Cost profile measured by `kvflow-ray bench calibrate` (kvflow_ray/engines/cpu/calibrate.py) on",
        f"# {platform.node()} ({platform.processor() or platform.machine()}, {os.cpu_count()} CPUs),"
        f" torch {torch.__version__}, {dt.datetime.now().isoformat(timespec='seconds')}.",
        "# peak_flops, attention_mfu, hbm_bytes_per_s, weight_bytes and iteration_overhead_s are fitted to these",
        "# engine steps (median times):",
        *(f"#   decode at context {c}: {t * 1e3:.2f} ms" for c, t in m["decode"]),
        *(f"#   prefill of {n} tokens after {c}: {t * 1e3:.1f} ms" for n, c, t in m["prefill"]),
        f"#   copy of {COPY_TOKENS} tokens between pools: "
        + ", ".join(f"{way} {r / 1e9:.3f} GB/s" for way, r in m["copy_bytes_per_s"].items()),
        "# relative error of the fitted roofline on each measured step: "
        + ", ".join(f"{e:+.1%}" for e in m["fit_errors"]),
        "",
        yaml.safe_dump(profile["values"], sort_keys=False),
    ]
    path.write_text("\n".join(lines))
    return path
