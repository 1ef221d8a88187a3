"""Decode tokens/s of llama.cpp (llama-cpp-python) on a GGUF file, with the prompt and the
greedy loop of examples/bench_generate.rs; prints one JSON line in its schema.

    python3 scripts/llama_cpp_bench.py --model F.gguf --threads 2 --new-tokens 32
"""
import argparse
import json
import time

import numpy as np
from llama_cpp import Llama

ap = argparse.ArgumentParser()
ap.add_argument("--model", required=True)
ap.add_argument("--threads", type=int, default=2)
ap.add_argument("--prompt-len", type=int, default=32)
ap.add_argument("--new-tokens", type=int, default=32)
a = ap.parse_args()

# logits_all: llama-cpp-python 0.3.36 fills `scores` (read below) only with it; without it
# the rows stay zero and argmax gives token 0 every step.
llm = Llama(model_path=a.model, n_threads=a.threads, n_threads_batch=a.threads,
            n_ctx=a.prompt_len + a.new_tokens + 8, logits_all=True, verbose=False)
vocab = llm.n_vocab()
ids = [(i * 7919 + 13) % vocab for i in range(a.prompt_len)]
t0 = time.perf_counter()
llm.eval(ids)
nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
prefill = time.perf_counter() - t0
out = [nxt]
t1 = time.perf_counter()
for _ in range(1, a.new_tokens):
    llm.eval([nxt])
    nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    out.append(nxt)
decode = time.perf_counter() - t1
print(json.dumps({
    "impl": "llama.cpp", "model": a.model.rsplit("/", 1)[-1], "world_size": 1,
    "threads_per_rank": a.threads, "backend": "ggml", "prompt_tokens": a.prompt_len,
    "new_tokens": a.new_tokens, "prefill_ms": prefill * 1e3,
    "tokens_per_s": (a.new_tokens - 1) / decode, "token_ids": out,
}))
