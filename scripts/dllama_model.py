#!/usr/bin/env python3
"""A random-weight Llama and a tokenizer in distributed-llama's own file formats, for
scripts/bench-hosts.sh's comparison with distributed-llama (b4rtaz/distributed-llama).

usage: dllama_model.py OUT_DIR TOKENIZER_JSON [--dim 2048 --hidden-dim 8192 --layers 16
                       --heads 32 --kv-heads 8 --vocab 49152]

The defaults are the shape of the project's synthetic ~1 B Llama (Llama 3.2 1B's shape with
SmolLM2's vocabulary, `make_synthetic_llama`), so that both engines decode the same amount of
arithmetic: Q40 weights (distributed-llama's Q4_0, 18-byte blocks: an f16 scale and 16 bytes of
nibbles) with random nibbles, F32 embedding and norms, written as distributed-llama's
converter/writer.py lays them out (header of (key, value) int pairs, then the tensors in
converter/convert-hf.py's order). Only decoding speed is measured: the weights are random, as
the synthetic model's are. The tokenizer is SmolLM2's vocabulary (byte-level BPE tokens as
bytes, scores -id, as converter/convert-tokenizer-hf.py writes them). Python's standard library
only (no numpy or torch).
"""
import argparse
import array
import json
import os
import random
import struct

LLAMA = 0xABCD00
Q40, F32 = 2, 0
HEADER_KEYS = {
    "version": 0, "arch_type": 1, "dim": 2, "hidden_dim": 3, "n_layers": 4, "n_heads": 5,
    "n_kv_heads": 6, "n_experts": 7, "n_active_experts": 8, "vocab_size": 9, "max_seq_len": 10,
    "hidden_act": 11, "rope_theta": 12, "weights_float_type": 13, "norm_epsilon": 20,
}


def write_header(f, params):
    data = b"".join(struct.pack("ii", HEADER_KEYS[k], v) for k, v in params.items())
    f.write(struct.pack("i", 0xA00ABCD))
    f.write(struct.pack("i", 8 + len(data)))
    f.write(data)


def q40(f, rows, cols, scale=0.002):
    """rows x cols Q40 weights: random nibbles, one f16 scale per 32 values."""
    n = rows * cols // 32
    buf = bytearray(os.urandom(n * 18))
    d = struct.pack("<e", scale)
    buf[0::18] = d[:1] * n
    buf[1::18] = d[1:] * n
    f.write(buf)


def f32(f, count, rng, std=0.02, value=None):
    """count F32 values: `value` everywhere, or a repeated block of normal noise."""
    if value is not None:
        block = array.array("f", [value] * min(count, 1 << 16))
    else:
        block = array.array("f", [rng.gauss(0.0, std) for _ in range(min(count, 1 << 16))])
    raw = block.tobytes()
    full, rest = divmod(count, len(block))
    for _ in range(full):
        f.write(raw)
    f.write(raw[: rest * 4])


def model(path, a):
    rng = random.Random(7)
    head_dim = a.dim // a.heads
    kv = a.kv_heads * head_dim
    with open(path, "wb") as f:
        write_header(f, {
            "version": 0, "arch_type": LLAMA, "hidden_act": 1, "dim": a.dim,
            "hidden_dim": a.hidden_dim, "n_layers": a.layers, "n_heads": a.heads,
            "n_kv_heads": a.kv_heads, "weights_float_type": Q40, "max_seq_len": 2048,
            "vocab_size": a.vocab, "n_experts": 0, "n_active_experts": 0,
            "rope_theta": 500000, "norm_epsilon": 5,
        })
        f32(f, a.vocab * a.dim, rng)  # embedding
        for _ in range(a.layers):
            q40(f, a.dim, a.dim)  # q
            q40(f, kv, a.dim)  # k
            q40(f, kv, a.dim)  # v
            q40(f, a.dim, a.dim)  # o
            q40(f, a.hidden_dim, a.dim)  # gate
            q40(f, a.dim, a.hidden_dim)  # down
            q40(f, a.hidden_dim, a.dim)  # up
            f32(f, a.dim, rng, value=1.0)  # input norm
            f32(f, a.dim, rng, value=1.0)  # post-attention norm
        f32(f, a.dim, rng, value=1.0)  # final norm
        q40(f, a.vocab, a.dim)  # LM head


def byte_decoder():
    """GPT-2's byte-level alphabet back to bytes."""
    bs = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
          + list(range(ord("®"), ord("ÿ") + 1)))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def tokenizer(path, tokenizer_json, vocab):
    t = json.load(open(tokenizer_json, encoding="utf-8"))
    by_id = {i: s for s, i in t["model"]["vocab"].items()}
    for added in t.get("added_tokens", []):
        by_id[added["id"]] = added["content"]
    utb = byte_decoder()
    tokens = []
    for i in range(vocab):
        s = by_id.get(i, f"<unused{i}>")
        b = bytes(utb[c] for c in s) if all(c in utb for c in s) else s.encode("utf-8")
        tokens.append(b or b" ")
    params = [(0, 1), (1, vocab), (2, max(len(x) for x in tokens)), (3, 1), (9, 1), (10, 0)]
    data = b"".join(struct.pack("ii", k, v) for k, v in params)
    with open(path, "wb") as f:
        f.write(struct.pack("i", 0x567124))
        f.write(struct.pack("i", 8 + len(data)))
        f.write(data)
        f.write(struct.pack("i", 2))  # end of sequence: SmolLM2's <|im_end|>
        for i, tok in enumerate(tokens):
            f.write(struct.pack("fI", -float(i), len(tok)))
            f.write(tok)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out_dir")
    p.add_argument("tokenizer_json")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden-dim", type=int, default=8192)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--vocab", type=int, default=49152)
    a = p.parse_args()
    os.makedirs(a.out_dir, exist_ok=True)
    m = os.path.join(a.out_dir, "model.m")
    t = os.path.join(a.out_dir, "tokenizer.t")
    model(m + ".part", a)
    os.replace(m + ".part", m)
    tokenizer(t, a.tokenizer_json, a.vocab)
    print(m, t)


if __name__ == "__main__":
    main()
