"""`python -m pipeline bench-serve CONFIG`: serving throughput and latency under concurrent clients.

For every path (the Python engine behind EngineLoop; the real tritonserver) and concurrency C, C client threads
send their share of N greedy requests, one after another, in each mode:

  one_at_a_time      one request in flight at a time (a lock shared by all clients, held from send to last
                     token): what serving delivered before in-flight batching; K as a plain request gets it
  target_only        batched, every request max_draft_len = 0
  speculative        batched, K as a plain request gets it (the engine caps K per step from measured costs)
  speculative_fixed  batched, every request names K = the config's K (the engine never caps a named K)

Paths: ``engine`` (EngineLoop in this process, clients are threads), ``triton`` (tritonclient HTTP against the
request/response model ``speculative``: no per-token arrival, so TTFT is not measured and ITL is the request's
decode time spread over its tokens, see _Timing) and ``triton_stream`` (tritonclient gRPC stream against the
decoupled ``speculative_stream``: every target step arrives as it happens).

Cells are interleaved over rounds (round 1 of every cell, then round 2, ...) and each cell keeps its best round by
tokens/s: the machine is shared and load from elsewhere only ever makes a round slower.
Also measured (issue item 6): at batch 1 on the same prompts, our target-only decoding against Hugging Face
``generate`` greedy, interleaved over rounds, best of each.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .timing import percentile

MODES = ("one_at_a_time", "target_only", "speculative", "speculative_fixed")
PATHS = ("engine", "triton", "triton_stream")
ADAPTIVE = "adaptive"  # a mode's K when the request names none (the engine's K, capped per step)


def mode_draft_len(mode: str, k: int) -> int | None:
    """The K a mode's requests name: None = not named (the engine's K under its adaptive cap)."""
    return {"target_only": 0, "speculative_fixed": k}.get(mode)


@dataclass
class _Timing:
    """One request as its client saw it; times in seconds from the client's send."""

    tokens: int = 0
    first_s: float | None = None  # first token arrived (None: the path cannot tell)
    last_s: float = 0.0  # the response completed
    itl_s: list[float] = field(default_factory=list)  # [tokens after the first step] per-token gaps
    error: str | None = None
    drafted: int = 0  # draft tokens proposed, accepted by the target, and target steps (the request's stats)
    accepted: int = 0
    steps: int = 0
    started: float = field(default_factory=time.perf_counter)  # perf_counter at send

    def queued_since(self, queued: float) -> None:
        """Count a wait before the send (one-at-a-time's lock) into TTFT and latency, as the client saw it."""
        wait = self.started - queued
        self.first_s = None if self.first_s is None else self.first_s + wait
        self.last_s += wait


class _Arrivals:
    """Turns arrival times of token groups into a _Timing (a group of n after a gap t: n gaps of t / n)."""

    def __init__(self) -> None:
        self.timing = _Timing()
        self.start = self.timing.started
        self._last: float | None = None

    def arrived(self, count: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if count <= 0:
            return
        if self._last is None:
            self.timing.first_s = now - self.start
        else:
            self.timing.itl_s.extend([(now - self._last) / count] * count)
        self._last = now
        self.timing.tokens += count

    def done(self) -> _Timing:
        self.timing.last_s = time.perf_counter() - self.start
        return self.timing


# ---- clients: one per thread; send(prompt_ids, max_tokens, k) blocks until the request completed ---------------


class EngineClient:
    """A client of an EngineLoop in this process; events are timed on the loop thread as they are emitted."""

    def __init__(self, executor, loop):
        self.executor, self.loop = executor, loop

    def send(self, prompt_ids: list[int], max_tokens: int, k: int | None) -> _Timing:
        clock, finished = _Arrivals(), threading.Event()
        request = self.executor.new_request(list(prompt_ids), max_tokens, max_draft_len=k, with_text=False)

        def on_event(event) -> None:
            if isinstance(event, BaseException):
                clock.timing.error = f"{type(event).__name__}: {event}"
                finished.set()
                return
            clock.arrived(len(event.token_ids))
            _take_stats(clock.timing, event.stats.draft_tokens, event.stats.accepted_tokens, event.stats.target_steps)
            if event.finished:
                finished.set()

        self.loop.submit(request, on_event)
        finished.wait()
        return clock.done()

    def close(self) -> None:
        pass


STAT_OUTPUTS = ("draft_tokens", "accepted_tokens", "target_steps")  # the request's running totals


def _take_stats(timing: _Timing, drafted: int, accepted: int, steps: int) -> None:
    timing.drafted, timing.accepted, timing.steps = drafted, accepted, steps


def _inputs(module, prompt_ids: list[int], max_tokens: int, k: int | None) -> list:
    import numpy as np

    arrays = {"input_ids": np.array([prompt_ids], dtype=np.int32),
              "max_tokens": np.array([[max_tokens]], dtype=np.int32)}
    if k is not None:
        arrays["num_draft_tokens"] = np.array([[k]], dtype=np.int32)
    inputs = []
    for name, array in arrays.items():
        tensor = module.InferInput(name, list(array.shape), "INT32")
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class TritonHttpClient:
    """tritonclient HTTP against the request/response model: one response holds every token."""

    def __init__(self, url: str, model: str = "speculative", timeout_s: float = 300.0):
        import tritonclient.http as httpclient

        self.module, self.model = httpclient, model
        self.client = httpclient.InferenceServerClient(url, connection_timeout=timeout_s, network_timeout=timeout_s)

    def send(self, prompt_ids: list[int], max_tokens: int, k: int | None) -> _Timing:
        timing = _Timing()
        result = self.client.infer(self.model, _inputs(self.module, prompt_ids, max_tokens, k))
        timing.last_s = time.perf_counter() - timing.started
        timing.tokens = int(result.as_numpy("output_ids").size)
        # No per-token arrivals: ITL is the whole request's time spread evenly over its tokens.
        timing.itl_s = [timing.last_s / timing.tokens] * timing.tokens
        _take_stats(timing, *(int(result.as_numpy(name).reshape(-1)[0]) for name in STAT_OUTPUTS))
        return timing

    def close(self) -> None:
        self.client.close()


class TritonStreamClient:
    """tritonclient gRPC stream against the decoupled model: one response per target step."""

    def __init__(self, url: str, model: str = "speculative_stream", timeout_s: float = 300.0):
        import tritonclient.grpc as grpcclient

        self.module, self.model, self.timeout_s = grpcclient, model, timeout_s
        self.client = grpcclient.InferenceServerClient(url)
        self.responses: queue.SimpleQueue = queue.SimpleQueue()
        # Stamped in the callback (the stream's reader thread), not when this thread gets round to reading it.
        self.client.start_stream(callback=lambda result, error: self.responses.put(
            (time.perf_counter(), result, error)))

    def send(self, prompt_ids: list[int], max_tokens: int, k: int | None) -> _Timing:
        clock = _Arrivals()
        self.client.async_stream_infer(self.model, _inputs(self.module, prompt_ids, max_tokens, k))
        while True:
            now, result, error = self.responses.get(timeout=self.timeout_s)
            if error is not None:
                clock.timing.error = str(error)
                break
            clock.arrived(int(result.as_numpy("output_ids").size), now)
            _take_stats(clock.timing, *(int(result.as_numpy(name).reshape(-1)[0]) for name in STAT_OUTPUTS))
            if result.as_numpy("finish_reason").reshape(-1)[0]:  # "" until the final response
                break
        return clock.done()

    def close(self) -> None:
        self.client.stop_stream()
        self.client.close()


# ---- one load: C clients, N requests --------------------------------------------------------------------------


def run_load(make_client: Callable[[], object], prompts: list[list[int]], requests: int, concurrency: int,
             max_tokens: int, k: int | None, one_at_a_time: bool) -> tuple[list[_Timing], float]:
    """Client c sends requests c, c + C, c + 2C, ... (prompts in turn), each after the previous completed.
    Returns every request's timing and the wall time from the first send to the last completion."""
    clients = [make_client() for _ in range(concurrency)]  # connected before the clock starts
    lock = threading.Lock() if one_at_a_time else None
    timings: list[_Timing | None] = [None] * requests
    errors: list[BaseException] = []
    barrier = threading.Barrier(concurrency + 1)

    def work(slot: int) -> None:
        barrier.wait()
        try:
            for i in range(slot, requests, concurrency):
                prompt = prompts[i % len(prompts)]
                if lock is None:
                    timings[i] = clients[slot].send(prompt, max_tokens, k)
                else:
                    queued = time.perf_counter()
                    with lock:
                        timings[i] = clients[slot].send(prompt, max_tokens, k)
                    timings[i].queued_since(queued)  # the lock's wait is queueing, as in the batched modes
        except BaseException as exc:  # noqa: BLE001 - reported once every thread has stopped
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(slot,), daemon=True) for slot in range(concurrency)]
    for thread in threads:
        thread.start()
    barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - start
    for client in clients:
        client.close()
    failed = [t.error for t in timings if t is not None and t.error]
    if errors or failed or any(t is None for t in timings):
        raise RuntimeError(f"serving load failed: {errors[:1] or failed[:1] or 'a request got no answer'}")
    return timings, wall  # type: ignore[return-value]


def summarize(timings: list[_Timing], wall_s: float) -> dict:
    tokens = sum(t.tokens for t in timings)
    itl = [x for t in timings for x in t.itl_s]
    firsts = [t.first_s for t in timings if t.first_s is not None]
    latency = [t.last_s for t in timings]

    def ms(values: list[float], q: float) -> float | None:
        return round(1000 * percentile(values, q), 3) if values else None

    drafted, steps = sum(t.drafted for t in timings), sum(t.steps for t in timings)
    return {"requests": len(timings), "tokens": tokens, "wall_s": round(wall_s, 4),
            "mean_draft_len": round(drafted / steps, 3) if steps else None,
            "acceptance_rate": round(sum(t.accepted for t in timings) / drafted, 3) if drafted else None,
            "tokens_per_s": round(tokens / wall_s, 2), "requests_per_s": round(len(timings) / wall_s, 3),
            "itl_ms_p50": ms(itl, 50), "itl_ms_p99": ms(itl, 99),
            "ttft_ms_p50": ms(firsts, 50), "ttft_ms_p99": ms(firsts, 99),
            "latency_ms_p50": ms(latency, 50), "latency_ms_p99": ms(latency, 99)}


# ---- the whole matrix -----------------------------------------------------------------------------------------


@dataclass
class ServeOptions:
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16, 32])
    requests: int = 64  # N per cell, shared among the C clients
    max_tokens: int = 32
    rounds: int = 2
    modes: list[str] = field(default_factory=lambda: list(MODES))
    paths: list[str] = field(default_factory=lambda: list(PATHS))
    hf_rounds: int = 3  # item 6; 0 skips it

    def to_dict(self) -> dict:
        return asdict(self)


def run_matrix(clients: dict[str, Callable[[], object]], prompts: list[list[int]], options: ServeOptions, k: int,
               note: Callable[[str], None] = print) -> list[dict]:
    """Every (path, mode, concurrency) cell, rounds interleaved; one record per cell, its best round."""
    cells = [(path, mode, c) for c in options.concurrency for path in options.paths if path in clients
             for mode in options.modes]
    best: dict[tuple[str, str, int], dict] = {}
    for path, make in clients.items():  # warm-up: first requests pay connection and allocator costs
        run_load(make, prompts, min(4, options.requests), 2, options.max_tokens, None, False)
    for round_index in range(options.rounds):
        for path, mode, c in cells:
            draft_len = mode_draft_len(mode, k)
            timings, wall = run_load(clients[path], prompts, options.requests, c, options.max_tokens, draft_len,
                                     mode == "one_at_a_time")
            record = {"path": path, "mode": mode, "concurrency": c,
                      "k": ADAPTIVE if draft_len is None else draft_len, **summarize(timings, wall)}
            key = (path, mode, c)
            if key not in best or record["tokens_per_s"] > best[key]["tokens_per_s"]:
                best[key] = {**record, "best_of_rounds": round_index + 1}
            note(f"round {round_index + 1}/{options.rounds} {path:13s} {mode:17s} C={c:<3d} "
                 f"{record['tokens_per_s']:8.1f} tok/s")
    for record in best.values():
        record["best_of_rounds"] = options.rounds
    return [best[key] for key in cells]


def add_ratios(records: list[dict]) -> None:
    """Each record's throughput against one_at_a_time and target_only of the same path and concurrency."""
    index = {(r["path"], r["mode"], r["concurrency"]): r for r in records}
    for r in records:
        for base in ("one_at_a_time", "target_only"):
            other = index.get((r["path"], base, r["concurrency"]))
            r[f"speedup_vs_{base}"] = round(r["tokens_per_s"] / other["tokens_per_s"], 3) if other else None


def batch1_target_vs_hf(executor, prompts: list[list[int]], max_tokens: int, rounds: int) -> dict:
    """Issue item 6: our target-only (max_draft_len=0) vs HF generate greedy at batch 1, best round of each.
    Runs on ``executor``'s engine directly: call it while no EngineLoop drives that engine."""
    from .measure import hf_sample, stream_sample

    target = executor.target.model
    pad = getattr(executor.tokenizer, "pad_token_id", None)
    methods = {"target": lambda ids: stream_sample(executor, ids, max_tokens, 0),
               "hf_target": lambda ids: hf_sample(target, None, ids, max_tokens, 0, pad)}
    for run in methods.values():  # warm-up
        run(prompts[0])
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, run in methods.items():
            samples = [run(ids) for ids in prompts]
            rate = sum(s.tokens for s in samples) / sum(s.seconds for s in samples)
            best[name] = max(best.get(name, 0.0), rate)
    return {"prompts": len(prompts), "max_tokens": max_tokens, "rounds": rounds,
            "target_tokens_per_s": round(best["target"], 2), "hf_target_tokens_per_s": round(best["hf_target"], 2),
            "target_vs_hf": round(best["target"] / best["hf_target"], 3)}


def targets_met(records: list[dict]) -> list[str]:
    """The issue's targets, checked on the measured records (a benchmark report, not a test)."""
    lines = []
    index = {(r["path"], r["mode"], r["concurrency"]): r for r in records}
    concurrencies = sorted({r["concurrency"] for r in records})
    for path in dict.fromkeys(r["path"] for r in records):
        top = concurrencies[-1]
        one, spec = index.get((path, "one_at_a_time", top)), index.get((path, "speculative", top))
        if one and spec:
            ratio = spec["tokens_per_s"] / one["tokens_per_s"]
            key = "itl_ms_p99" if spec["ttft_ms_p99"] is None else "ttft_ms_p99"
            p99 = "latency_ms_p99"
            lines.append(f"{path} C={top}: speculative {ratio:.2f}x one-at-a-time tokens/s (target >= 5x: "
                         f"{'met' if ratio >= 5 else 'NOT met'}); p99 request latency {spec[p99]:.0f} vs "
                         f"{one[p99]:.0f} ms ({'lower' if spec[p99] < one[p99] else 'NOT lower'}); "
                         f"{key} {spec[key]:.1f} vs {one[key]:.1f} ms")
        ratios = [(c, index[(path, "speculative", c)]["tokens_per_s"] / index[(path, "target_only", c)]["tokens_per_s"])
                  for c in concurrencies if (path, "speculative", c) in index and (path, "target_only", c) in index]
        if ratios:
            low = [(c, x) for c, x in ratios if c <= 4]
            lines.append(f"{path}: speculative / target_only tokens/s " + ", ".join(f"C={c} {x:.2f}x" for c, x in ratios)
                         + f"; >= 1.3x at C<=4: {'met' if low and all(x >= 1.3 for _, x in low) else 'NOT met'}"
                         + f"; >= 0.95x everywhere: {'met' if all(x >= 0.95 for _, x in ratios) else 'NOT met'}")
        # The served default (K not named: the adaptive policy) against naming the config's K, per concurrency.
        versus = [(c, index[(path, "speculative", c)]["tokens_per_s"] /
                   index[(path, "speculative_fixed", c)]["tokens_per_s"])
                  for c in concurrencies if (path, "speculative", c) in index and (path, "speculative_fixed", c) in index]
        if versus:
            lines.append(f"{path}: adaptive K / fixed K tokens/s " + ", ".join(f"C={c} {x:.2f}x" for c, x in versus))
    return lines


def format_serving_table(records: list[dict]) -> str:
    head = (f"{'path':13s} {'mode':17s} {'C':>3s} {'K':>8s} {'tok/s':>8s} {'req/s':>7s} {'ITL p50':>8s} "
            f"{'ITL p99':>8s} {'TTFT p50':>8s} {'TTFT p99':>8s} {'lat p99':>8s} {'mean K':>6s} {'accept':>6s} "
            f"{'x1-at-a-time':>12s} {'x target':>8s}")
    lines = [head, "-" * len(head)]

    def f(value, digits=1):
        return "-" if value is None else f"{value:.{digits}f}"

    for r in records:
        lines.append(f"{r['path']:13s} {r['mode']:17s} {r['concurrency']:3d} {str(r['k']):>8s} "
                     f"{r['tokens_per_s']:8.1f} {r['requests_per_s']:7.2f} {f(r['itl_ms_p50']):>8s} "
                     f"{f(r['itl_ms_p99']):>8s} {f(r['ttft_ms_p50']):>8s} {f(r['ttft_ms_p99']):>8s} "
                     f"{f(r['latency_ms_p99'], 0):>8s} {f(r['mean_draft_len'], 2):>6s} {f(r['acceptance_rate'], 2):>6s} "
                     f"{f(r.get('speedup_vs_one_at_a_time'), 2):>12s} "
                     f"{f(r.get('speedup_vs_target_only'), 2):>8s}")
    return "\n".join(lines)


# ---- the command ----------------------------------------------------------------------------------------------


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _name_list(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def add_bench_serve_parser(sub, common) -> None:
    p = sub.add_parser(
        "bench-serve", help="serving under concurrent clients: one-at-a-time vs batched target-only vs speculative",
        description="C client threads send their share of N greedy requests through the Python engine and through "
                    "a real tritonserver on loopback, in each mode; tokens/s, requests/s, ITL and TTFT p50/p99 per "
                    "(path, mode, C), best of interleaved rounds; plus batch-1 target-only vs HF generate. Writes "
                    "engines/<name>/bench/serving.json and serving.png.")
    common(p)
    p.add_argument("--concurrency", type=_int_list, default=[1, 4, 16, 32], help="comma list (default 1,4,16,32)")
    p.add_argument("--requests", type=int, default=64, help="requests per (path, mode, C) (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds; each cell keeps its best (default 2)")
    p.add_argument("--modes", type=_name_list, default=list(MODES), help=f"comma list (default {','.join(MODES)})")
    p.add_argument("--paths", type=_name_list, default=list(PATHS), help=f"comma list (default {','.join(PATHS)})")
    p.add_argument("--prompt-set", default="code", help="built-in prompt set (default code)")
    p.add_argument("--num-prompts", type=int, default=8, help="distinct prompts, sent in turn (default 8)")
    p.add_argument("--hf-rounds", type=int, default=3,
                   help="rounds of batch-1 target-only vs HF generate (0 skips it; default 3)")
    p.add_argument("--out", type=Path, default=None, help="results folder (default engines/<name>/bench)")
    p.set_defaults(func=cmd_bench_serve)


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on right now (another process may take it first; rare on loopback)."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def start_triton(config, engines_dir, log_path):
    """Deploy the engines and start tritonserver on free loopback ports; the caller stops it."""
    from ..triton.repository import deploy
    from ..triton.server import Endpoints, TritonServer

    repo = deploy(config, engines_dir).path
    endpoints = Endpoints("127.0.0.1", free_port(), free_port(), free_port())
    return TritonServer(repo, endpoints, log_path=log_path).start(ready_timeout_s=400)


def cmd_bench_serve(args) -> int:
    import json
    import os

    from ..config import load_config
    from ..errors import PipelineError
    from ..executor import SpeculativeExecutor
    from ..executor.serving import EngineLoop
    from ..run_cmd import proposer_options
    from .cli import _check_range
    from .prompts import load_prompt_set, pair_seed_of
    from .runner import fit_prompt, git_commit, machine_info, timestamp
    from .serving_plot import plot_serving

    options = ServeOptions(concurrency=args.concurrency, requests=args.requests, max_tokens=args.max_tokens,
                           rounds=args.rounds, modes=args.modes, paths=args.paths, hf_rounds=args.hf_rounds)
    _check_range("--max-tokens", options.max_tokens, 2, fix="latency needs at least two tokens")
    _check_range("--requests", options.requests, 1)
    _check_range("--rounds", options.rounds, 1)
    _check_range("--hf-rounds", options.hf_rounds, 0)
    for c in options.concurrency:
        _check_range("--concurrency", c, 1, options.requests, fix="each client needs at least one request")
    for flag, values, known in (("--modes", options.modes, MODES), ("--paths", options.paths, PATHS)):
        bad = [v for v in values if v not in known]
        if bad:
            raise PipelineError(f"{flag}: {', '.join(bad)} unknown; choose from {', '.join(known)}")
    config = load_config(args.config)
    root = args.engines_dir / config.name
    if not (root / "target" / "build").is_dir():
        raise PipelineError(f"{root}: no built engines; run `python -m pipeline build {args.config}` first")
    target_folder = config.base_dir / config.target.model
    pair_seed = pair_seed_of(target_folder) if target_folder.is_dir() else 0
    try:
        texts = load_prompt_set(args.prompt_set, args.num_prompts, pair_seed=pair_seed)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    device = None if config.runtime.device == "auto" else config.runtime.device
    executor = SpeculativeExecutor.from_engines(root, device=device, adaptive_draft_len=True,
                                                **proposer_options(config))
    prompts = [fit_prompt(executor, text, options.max_tokens) for text in texts]
    k = executor.max_draft_len
    started, commit = timestamp(), git_commit(Path(__file__).resolve().parents[2])

    batch1 = None
    if options.hf_rounds:  # before the EngineLoop exists: it runs on the executor's engine directly
        batch1 = batch1_target_vs_hf(executor, prompts, options.max_tokens, options.hf_rounds)
        print(f"batch 1, target only: ours {batch1['target_tokens_per_s']:.1f} tok/s, HF generate "
              f"{batch1['hf_target_tokens_per_s']:.1f} tok/s ({batch1['target_vs_hf']:.2f}x)")
    out_dir = args.out or args.engines_dir / config.name / "bench"
    out_dir.mkdir(parents=True, exist_ok=True)
    loop = EngineLoop(executor.engine)
    clients: dict[str, Callable[[], object]] = {"engine": lambda: EngineClient(executor, loop)}
    server = None
    try:
        if {"triton", "triton_stream"} & set(options.paths):
            server = start_triton(config, args.engines_dir, out_dir / "serving-tritonserver.log")
            clients["triton"] = lambda: TritonHttpClient(server.endpoints.http)
            clients["triton_stream"] = lambda: TritonStreamClient(server.endpoints.grpc)
        clients = {path: make for path, make in clients.items() if path in options.paths}
        records = run_matrix(clients, prompts, options, k)
    finally:
        loop.stop()
        if server is not None:
            server.stop()
    add_ratios(records)
    results = {
        "config": config.name, "started": started, "finished": timestamp(), "git_commit": commit,
        "machine": {**machine_info(str(executor.device)), "omp_num_threads": os.environ.get("OMP_NUM_THREADS")},
        "options": {**options.to_dict(), "prompt_set": args.prompt_set, "num_prompts": len(prompts),
                    "decoding": "greedy", "max_batch_size": executor.max_batch_size, "k": k,
                    "adaptive_draft_len": True},
        "records": records, "batch1_target_vs_hf": batch1, "targets": targets_met(records),
    }
    tmp = out_dir / "serving.json.tmp"
    tmp.write_text(json.dumps(results, indent=2) + "\n")
    tmp.replace(out_dir / "serving.json")
    machine = results["machine"]
    plot = plot_serving(records, out_dir / "serving.png",
                        f"{config.name}: {machine['cpu']} ({machine['cpu_count']} cores, {machine['torch_threads']} "
                        f"torch threads), {options.max_tokens} tokens/request greedy, engine batch "
                        f"{executor.max_batch_size}, K={k}")
    print(format_serving_table(records))
    for line in results["targets"]:
        print(line)
    print(f"wrote {out_dir / 'serving.json'} and {plot}")
    return 0
