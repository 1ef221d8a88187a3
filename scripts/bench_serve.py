#!/usr/bin/env python3
"""Load generator for an OpenAI-compatible server (stdlib only): for each concurrency level,
that many client threads each send streaming /v1/completions requests (greedy, fixed
max_tokens) until `requests_per_stream` each are done; measures total generated tokens/s, time
to first token and inter-token latency (p50/p99) from the SSE chunk arrival times, and prints
one JSON object.

Generated tokens are the `usage.completion_tokens` of the stream's last chunk
(`stream_options.include_usage`); a server that sends no usage in a stream (llama-cpp-python's)
is counted by its content chunks (those without a `finish_reason`: one per token there, a
multi-byte character split over tokens excepted). `token_count` in each level says which.
`short_requests` counts requests that ended before max_tokens (end of sequence): tokens/s
stays comparable, the per-request latencies less so.

usage: bench_serve.py PORT [--levels 1,4,8,16] [--max-tokens 64] [--requests-per-stream 2]
                           [--extra '{"min_tokens": 64}']   (fields added to every request)
"""
import argparse
import http.client
import json
import statistics
import threading
import time

PROMPTS = [
    "The capital of France is",
    "Tensor parallelism splits a model across",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "To make a cup of tea, first",
    "In 1969, the first humans",
    "The quick brown fox",
    "def fibonacci(n):",
]


def one_request(port, prompt, max_tokens, extra=None):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    fields = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
              "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    if "min_tokens" in fields:  # never above max_tokens (the warm-up asks for 4)
        fields["min_tokens"] = min(fields["min_tokens"], max_tokens)
    body = json.dumps(fields)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
    resp = conn.getresponse()
    if resp.status != 200:
        raise RuntimeError(f"status {resp.status}: {resp.read()[:300]!r}")
    arrivals, usage, chunks = [], None, 0
    for raw in resp:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        data = line[6:]
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            raise RuntimeError(chunk["error"]["message"])
        if chunk.get("usage"):
            usage = chunk["usage"]["completion_tokens"]
        if chunk.get("choices"):
            choice = chunk["choices"][0]
            if choice.get("finish_reason") is None:
                chunks += 1
            if choice.get("text"):
                arrivals.append(time.perf_counter())
    conn.close()
    tokens, counted = (usage, "usage") if usage is not None else (chunks, "chunks")
    return t0, arrivals, tokens, counted


def pct(xs, p):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def level(port, streams, per_stream, max_tokens, extra):
    results, errors = [], []
    lock = threading.Lock()

    def worker(i):
        for j in range(per_stream):
            try:
                r = one_request(port, PROMPTS[(i + j) % len(PROMPTS)], max_tokens, extra)
                with lock:
                    results.append(r)
            except Exception as e:  # noqa: BLE001 - reported in the JSON
                with lock:
                    errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [a[0] - s for s, a, _, _ in results if a]
    itl = [b - a for _, arr, _, _ in results for a, b in zip(arr, arr[1:])]
    tokens = sum(n for _, _, n, _ in results)
    counted = sorted({c for _, _, _, c in results})
    return {
        "streams": streams,
        "requests": len(results),
        "errors": errors[:5],
        "generated_tokens": tokens,
        "token_count": "/".join(counted) or None,
        "short_requests": sum(1 for _, _, n, _ in results if n < max_tokens),
        "wall_s": round(wall, 3),
        "tokens_per_s": round(tokens / wall, 2),
        "ttft_ms": {"p50": round(1e3 * pct(ttft, 50), 1), "p99": round(1e3 * pct(ttft, 99), 1)} if ttft else None,
        "itl_ms": {"p50": round(1e3 * pct(itl, 50), 1), "p99": round(1e3 * pct(itl, 99), 1)} if itl else None,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("port", type=int)
    ap.add_argument("--levels", default="1,4,8,16")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-stream", type=int, default=2)
    ap.add_argument("--extra", type=json.loads, default={},
                    help="a JSON object of fields added to every request")
    a = ap.parse_args()
    one_request(a.port, PROMPTS[0], 4, a.extra)  # warm-up
    levels = [level(a.port, int(n), a.requests_per_stream, a.max_tokens, a.extra)
              for n in a.levels.split(",")]
    base = levels[0]["tokens_per_s"] or 1
    for lv in levels:
        lv["speedup_vs_1_stream"] = round(lv["tokens_per_s"] / base, 2)
    print(json.dumps({"max_tokens": a.max_tokens, "requests_per_stream": a.requests_per_stream,
                      "extra_fields": a.extra, "levels": levels}, indent=1))


if __name__ == "__main__":
    main()
