"""Load test: 32 concurrent clients against the real tritonserver on loopback, valid and invalid requests mixed.

The load is scripts/load_test.py's (the script a user runs against `make serve`): tritonclient HTTP, tritonclient
gRPC and the HTTP generate endpoint, one request in four invalid. Asserted: no request lost (each gets a response
or an error before its timeout), every valid answer equals the executor's own greedy output, every invalid one is
refused with an error naming the input, the server and its Python-backend stubs survive (same pids, still ready),
and its memory does not keep growing. p50/p99 latency of the valid requests is printed and written as JSON.
"""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("tritonclient.http")
pytest.importorskip("tritonclient.grpc")

from pipeline.config import load_config  # noqa: E402
from pipeline.executor import SpeculativeExecutor  # noqa: E402
from tests.triton_helpers import load_script, process_tree_rss, server_pid, start_server  # noqa: E402

pytestmark = pytest.mark.server

load = load_script("load_test")

CLIENTS = 32
WARMUP_REQUESTS = 64  # every client twice: first-request costs (allocator pools, connections) land here
MAIN_WAVES = (320, 320)  # ~4 s each on 2 busy cores; two, so a leak shows as growth between samples
TIMEOUT_S = 60.0  # per request; a valid one takes well under a second even queued behind 31 others
# Growth allowed from after the warm-up to after the main waves, server + stubs together. After warm-up the
# resident set is ~780 MB (tritonserver ~40 MB, two Python-backend stubs ~370 MB each: torch plus a copy of the
# tiny pair) and measured growth over the 640 main requests is ~1-2 MB. 64 MB catches a leak of ~100 KB per
# request (a retained prompt's activations, KV cache or response), or a restarted stub (~370 MB), while leaving
# room for glibc arenas that new server threads may map under 32 concurrent clients.
MAX_GROWTH_BYTES = 64 * 2**20
MAX_GROWTH_FRACTION = 0.10


@pytest.fixture(scope="module")
def server(built_engines, tmp_path_factory):
    config_path, engines = built_engines
    running = start_server(config_path, engines, tmp_path_factory.mktemp("triton-load") / "server.log")
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
def expected(built_engines):
    """The executor's own greedy tokens and text for every (prompt, max_tokens) the load sends."""
    config_path, engines = built_engines
    executor = SpeculativeExecutor.from_engines(engines / load_config(config_path).name, device="cpu")
    return executor, {(prompt, n): executor.generate([prompt], max_new_tokens=n)[0]
                      for prompt in load.PROMPTS for n in load.MAX_TOKENS}


def _wave(server, jobs):
    start = time.perf_counter()
    outcomes = load.run_load(server.endpoints.http, server.endpoints.grpc, jobs, CLIENTS, TIMEOUT_S)
    return outcomes, time.perf_counter() - start


def _check(outcomes, expected):
    for o in outcomes:
        job = o.job
        assert o.status != "lost", f"request #{job.index} ({job.client}, {job.case}) lost: {o.message}"
        if job.case == "valid":
            assert o.status == "ok", f"valid request #{job.index} ({job.client}) refused: {o.message}"
            want = expected[(job.prompt, job.max_tokens)]
            assert (o.output_ids, o.text) == (want.token_ids, want.text), f"#{job.index} ({job.client}, K " \
                                                                          f"{job.num_draft_tokens})"
        else:
            assert o.status == "error", f"invalid request #{job.index} ({job.client}, {job.case}) was answered"
            assert load.error_word(job) in o.message, f"#{job.index} {job.case}: {o.message}"
            assert "internal error" not in o.message, o.message  # a bad request, not a model crash


def test_concurrent_mixed_load(server, expected, tmp_path):
    executor, answers = expected
    k = executor.engine_draft_len or executor.max_draft_len
    assert load.engine_k(server.endpoints.http, "speculative") == k
    assert len(executor.encode("x = 1\n" * 400)) > executor.max_input_len  # so it is refused
    pid = server_pid(server)

    warmup, _ = _wave(server, load.make_jobs(WARMUP_REQUESTS, k))
    _check(warmup, answers)
    rss_warm = process_tree_rss(pid)
    assert len(rss_warm) >= 3, f"expected tritonserver and two Python-backend stubs, found pids {list(rss_warm)}"

    outcomes, wall_s, samples = [], 0.0, [sum(rss_warm.values())]
    first = WARMUP_REQUESTS
    for size in MAIN_WAVES:
        wave, seconds = _wave(server, load.make_jobs(size, k, first_index=first))
        _check(wave, answers)
        outcomes += wave
        wall_s += seconds
        first += size
        samples.append(sum(process_tree_rss(pid).values()))
    rss_end = process_tree_rss(pid)

    assert len(outcomes) == sum(MAIN_WAVES)
    for case in load.INVALID:  # every invalid case reached every client kind
        assert {o.job.client for o in outcomes if o.job.case == case} == set(load.CLIENT_KINDS), case
    assert set(rss_end) == set(rss_warm), "a Python-backend stub died or was restarted under load"

    # Still up, ready, and answering correctly.
    import tritonclient.http as httpclient

    client = httpclient.InferenceServerClient(server.endpoints.http)
    assert server.running and client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("speculative") and client.is_model_ready("speculative_stream")
    again = load.Client(server.endpoints.http, server.endpoints.grpc, "speculative", TIMEOUT_S)
    final = again.send(load.make_jobs(1, k)[0])
    again.close()
    assert final.status == "ok"
    assert final.output_ids == answers[(final.job.prompt, final.job.max_tokens)].token_ids

    growth = samples[-1] - samples[0]
    summary = load.summarize(outcomes, wall_s, CLIENTS)
    summary.update(rss_mb_after_warmup=round(samples[0] / 2**20, 1),
                   rss_mb_after_waves=[round(s / 2**20, 1) for s in samples[1:]],
                   rss_growth_mb=round(growth / 2**20, 1),
                   rss_mb_by_process={pid_: round(rss / 2**20, 1) for pid_, rss in rss_end.items()})
    path = tmp_path / "load_latency.json"
    path.write_text(json.dumps(summary, indent=1))
    print(f"\nload: {json.dumps(summary)}\nwritten to {path}")

    assert summary["lost"] == 0
    assert growth < MAX_GROWTH_BYTES, f"server memory grew {growth / 2**20:.0f} MB under load: {summary}"
    assert growth < MAX_GROWTH_FRACTION * samples[0], summary
