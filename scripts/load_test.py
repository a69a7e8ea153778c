"""Load a running speculative-decoding Triton server and print p50/p99 latency of the valid requests.

    make serve                                     # terminal 1 (configs/tiny.yaml: HTTP 8000, gRPC 8001)
    .venv/bin/python scripts/load_test.py --url 127.0.0.1:8000 --clients 32 --requests 320   # terminal 2

N client threads, each with its own tritonclient HTTP client, gRPC client and plain-HTTP generate calls, send
their share of the requests one after another. Every 4th request is invalid (negative max_tokens, a prompt over
the engine's max_input_len, a wrong dtype, top_p out of range, num_draft_tokens above the engine's K, an empty
prompt); the rest are greedy requests for a few prompts. Every request must come back, as a response or as an
error, within --timeout seconds; a request that does not is "lost". The run fails (exit code 1) when a request is
lost, a valid request is refused, an invalid one is answered, or two greedy requests for the same prompt and
max_tokens get different tokens. tests/test_server_load.py runs this same load against a test server and also
compares every answer with the executor's own greedy output.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

import numpy as np

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "x = [1, 2"]
MAX_TOKENS = (4, 6, 8)
CLIENT_KINDS = ("http", "grpc", "generate")  # tritonclient HTTP, tritonclient gRPC, POST .../generate
# Invalid cases, and a word the server's error message must contain for each (it names the input).
INVALID = {
    "negative_max_tokens": "max_tokens",
    "prompt_too_long": "max_input_len",
    "wrong_dtype": "max_tokens",
    "top_p_out_of_range": "top_p",
    "k_above_limit": "num_draft_tokens",
    "empty_prompt": "empty",
}


def error_word(job: Job) -> str:
    """A word the error for an invalid ``job`` must contain."""
    if job.case == "wrong_dtype" and job.client == "generate":
        return "Unable to parse"  # Triton's JSON parser refuses a string for INT32 and names no input
    return INVALID[job.case]
# gRPC codes that mean the answer never came (the client gave up or could not connect), not a server error.
GRPC_LOST = {"StatusCode.DEADLINE_EXCEEDED", "StatusCode.UNAVAILABLE", "StatusCode.CANCELLED"}


@dataclass(frozen=True)
class Job:
    index: int
    client: str  # one of CLIENT_KINDS
    case: str  # "valid" or a key of INVALID
    prompt: str
    max_tokens: int
    num_draft_tokens: int | None = None  # None: the engine's K
    top_p: float | None = None
    wrong_dtype: bool = False  # send max_tokens as FP32 (a JSON string on the generate endpoint)


@dataclass
class Outcome:
    job: Job
    status: str = "lost"  # "ok" (a response), "error" (the server's error answer) or "lost" (no answer in time)
    latency_s: float = 0.0
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    message: str = ""


def make_jobs(count: int, k_limit: int, long_prompt_repeat: int = 400, first_index: int = 0) -> list[Job]:
    """``count`` requests, one in four invalid; every client kind meets every invalid case."""
    jobs = []
    for i in range(first_index, first_index + count):
        client = CLIENT_KINDS[i % 3]
        prompt, max_tokens = PROMPTS[i % len(PROMPTS)], MAX_TOKENS[(i // 3) % len(MAX_TOKENS)]
        if i % 4 != 3:
            ks = [None, *range(k_limit + 1)]  # greedy tokens do not depend on K (0 = target only)
            jobs.append(Job(i, client, "valid", prompt, max_tokens, num_draft_tokens=ks[(i // 9) % len(ks)]))
            continue
        # i = 4m + 3, so i % 3 == m % 3: taking the case from m // 3 pairs each case with all three clients.
        case = list(INVALID)[(i // 12) % len(INVALID)]
        job = Job(i, client, case, prompt, max_tokens)
        if case == "negative_max_tokens":
            job = Job(i, client, case, prompt, -(1 + i % 5))
        elif case == "prompt_too_long":
            job = Job(i, client, case, "x = 1\n" * long_prompt_repeat, max_tokens)
        elif case == "wrong_dtype":
            job = Job(i, client, case, prompt, max_tokens, wrong_dtype=True)
        elif case == "top_p_out_of_range":
            job = Job(i, client, case, prompt, max_tokens, top_p=1.5 if i % 2 else 0.0)
        elif case == "k_above_limit":
            job = Job(i, client, case, prompt, max_tokens, num_draft_tokens=k_limit + 1 + i % 3)
        elif case == "empty_prompt":
            job = Job(i, client, case, "", max_tokens)
        jobs.append(job)
    return jobs


def _arrays(job: Job) -> dict[str, np.ndarray]:
    arrays = {"text_input": np.array([[job.prompt.encode()]], dtype=np.object_),
              "max_tokens": np.array([[job.max_tokens]], dtype=np.float32 if job.wrong_dtype else np.int32)}
    if job.num_draft_tokens is not None:
        arrays["num_draft_tokens"] = np.array([[job.num_draft_tokens]], dtype=np.int32)
    if job.top_p is not None:
        arrays["top_p"] = np.array([[job.top_p]], dtype=np.float32)
    return arrays


def _infer_inputs(module, arrays: dict[str, np.ndarray]) -> list:
    inputs = []
    for name, array in arrays.items():
        datatype = {"O": "BYTES", "i": "INT32", "f": "FP32"}[array.dtype.kind]
        tensor = module.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


class Client:
    """One simulated client: its own HTTP and gRPC connections, used from one thread."""

    def __init__(self, http_url: str, grpc_url: str, model: str, timeout_s: float):
        import tritonclient.grpc as grpcclient
        import tritonclient.http as httpclient

        self.http_module, self.grpc_module = httpclient, grpcclient
        self.http = httpclient.InferenceServerClient(http_url, connection_timeout=timeout_s, network_timeout=timeout_s)
        self.grpc = grpcclient.InferenceServerClient(grpc_url)
        self.generate_url = f"http://{http_url}/v2/models/{model}/generate"
        self.model, self.timeout_s = model, timeout_s

    def send(self, job: Job) -> Outcome:
        from tritonclient.utils import InferenceServerException

        outcome = Outcome(job)
        start = time.perf_counter()
        try:
            if job.client == "generate":
                self._generate(job, outcome)
            else:
                module = self.http_module if job.client == "http" else self.grpc_module
                kwargs = {"client_timeout": self.timeout_s} if job.client == "grpc" else {}
                client = self.http if job.client == "http" else self.grpc
                result = client.infer(self.model, _infer_inputs(module, _arrays(job)), **kwargs)
                outcome.status = "ok"
                outcome.output_ids = result.as_numpy("output_ids")[0].tolist()
                outcome.text = result.as_numpy("text_output")[0, 0].decode()
        except InferenceServerException as exc:
            outcome.status = "lost" if str(exc.status()) in GRPC_LOST else "error"
            outcome.message = str(exc.message())
        except Exception as exc:  # noqa: BLE001 - a timeout or a dropped connection: the request is lost
            outcome.status, outcome.message = "lost", f"{type(exc).__name__}: {exc}"
        outcome.latency_s = time.perf_counter() - start
        return outcome

    def _generate(self, job: Job, outcome: Outcome) -> None:
        body = {"text_input": job.prompt,
                "max_tokens": str(job.max_tokens) if job.wrong_dtype else job.max_tokens}
        if job.num_draft_tokens is not None:
            body["num_draft_tokens"] = job.num_draft_tokens
        if job.top_p is not None:
            body["top_p"] = job.top_p
        request = urllib.request.Request(self.generate_url, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                data = json.loads(response.read())
        except urllib.error.HTTPError as exc:  # the server answered with an error status
            outcome.status = "error"
            raw = exc.read().decode(errors="replace")
            try:
                outcome.message = json.loads(raw).get("error", raw)
            except ValueError:
                outcome.message = raw
            return
        outcome.status, outcome.output_ids, outcome.text = "ok", data["output_ids"], data["text_output"]

    def close(self) -> None:
        for client in (self.http, self.grpc):
            try:
                client.close()
            except Exception:  # noqa: BLE001, S110 - closing a broken connection at the end changes nothing
                pass


def run_load(http_url: str, grpc_url: str, jobs: list[Job], clients: int = 32, timeout_s: float = 60.0,
             model: str = "speculative") -> list[Outcome]:
    """Send ``jobs`` from ``clients`` concurrent clients; one Outcome per job, in job order.

    A client that is still stuck when every one of its requests could have timed out leaves its remaining jobs
    marked "lost" (its thread is a daemon and is abandoned).
    """
    outcomes = [Outcome(job) for job in jobs]

    def work(slot: int) -> None:
        client = Client(http_url, grpc_url, model, timeout_s)
        try:
            for index in range(slot, len(jobs), clients):
                outcomes[index] = client.send(jobs[index])
        finally:
            client.close()

    threads = [threading.Thread(target=work, args=(slot,), daemon=True, name=f"load-client-{slot}")
               for slot in range(clients)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + timeout_s * (len(jobs) // clients + 1) + 30
    for thread in threads:
        thread.join(max(deadline - time.monotonic(), 0.0))
    return outcomes


def percentile_ms(latencies_s: list[float], q: float) -> float:
    return float(np.percentile(np.array(latencies_s) * 1000.0, q)) if latencies_s else float("nan")


def summarize(outcomes: list[Outcome], wall_s: float, clients: int) -> dict:
    valid_ok = [o.latency_s for o in outcomes if o.job.case == "valid" and o.status == "ok"]
    return {
        "requests": len(outcomes), "clients": clients,
        "valid": sum(o.job.case == "valid" for o in outcomes),
        "invalid": sum(o.job.case != "valid" for o in outcomes),
        "ok": sum(o.status == "ok" for o in outcomes), "errors": sum(o.status == "error" for o in outcomes),
        "lost": sum(o.status == "lost" for o in outcomes),
        "valid_p50_ms": round(percentile_ms(valid_ok, 50), 1), "valid_p99_ms": round(percentile_ms(valid_ok, 99), 1),
        "valid_max_ms": round(max(valid_ok) * 1000.0, 1) if valid_ok else float("nan"),
        "wall_s": round(wall_s, 2), "requests_per_s": round(len(outcomes) / wall_s, 1) if wall_s else 0.0,
    }


def problems(outcomes: list[Outcome]) -> list[str]:
    """What went wrong, without an oracle: lost requests, wrong outcomes, and greedy answers that disagree."""
    found, answers = [], {}
    for o in outcomes:
        job = o.job
        if o.status == "lost":
            found.append(f"#{job.index} {job.client} {job.case}: lost ({o.message or 'no answer'})")
        elif job.case == "valid" and o.status != "ok":
            found.append(f"#{job.index} {job.client}: valid request refused: {o.message}")
        elif job.case != "valid" and o.status != "error":
            found.append(f"#{job.index} {job.client} {job.case}: invalid request was answered")
        elif job.case != "valid" and error_word(job) not in o.message:
            found.append(f"#{job.index} {job.client} {job.case}: error does not say {error_word(job)!r}: "
                         f"{o.message}")
        elif job.case == "valid":
            first = answers.setdefault((job.prompt, job.max_tokens), o.output_ids)
            if o.output_ids != first:
                found.append(f"#{job.index} {job.client}: greedy tokens differ from an earlier answer for the "
                             f"same prompt and max_tokens")
    return found


def engine_k(http_url: str, model: str) -> int:
    """The K the served engine was built for, from the model's config.pbtxt parameters."""
    import tritonclient.http as httpclient

    config = httpclient.InferenceServerClient(http_url).get_model_config(model)
    return int(config["parameters"]["max_draft_len"]["string_value"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="127.0.0.1:8000", help="the server's HTTP host:port")
    parser.add_argument("--grpc-url", help="the server's gRPC host:port (default: the HTTP port + 1)")
    parser.add_argument("--clients", type=int, default=32, help="concurrent clients (threads)")
    parser.add_argument("--requests", type=int, default=320, help="requests in total, one in four invalid")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a request counts as lost")
    parser.add_argument("--model", default="speculative")
    parser.add_argument("--long-prompt-repeat", type=int, default=400,
                        help="'x = 1\\n' repeats in the too-long prompt; must exceed the engine's max_input_len")
    parser.add_argument("--json", help="also write the summary to this file")
    args = parser.parse_args(argv)
    host, _, port = args.url.rpartition(":")
    grpc_url = args.grpc_url or f"{host}:{int(port) + 1}"

    jobs = make_jobs(args.requests, engine_k(args.url, args.model), args.long_prompt_repeat)
    start = time.perf_counter()
    outcomes = run_load(args.url, grpc_url, jobs, args.clients, args.timeout, args.model)
    summary = summarize(outcomes, time.perf_counter() - start, args.clients)
    found = problems(outcomes)
    summary["problems"] = len(found)
    print(json.dumps(summary, indent=1))
    print(f"valid requests: p50 {summary['valid_p50_ms']} ms, p99 {summary['valid_p99_ms']} ms "
          f"({summary['valid']} valid, {summary['invalid']} invalid, {summary['lost']} lost)")
    for line in found[:20]:
        print("PROBLEM", line, file=sys.stderr)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({**summary, "outcomes": [{**asdict(o.job), "status": o.status, "latency_s": o.latency_s}
                                               for o in outcomes]}, out, indent=1)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
