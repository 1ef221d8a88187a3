"""The JSON lines that the benchmark scripts write: each tool's own line with the script's tags
put first (`sed 's/^{/{"side":...,/'`), read back so that the tags win over a tool's keys of
the same name (bench_generate's `model`, say)."""
import json


def first_wins(pairs):
    """A JSON object's pairs, the first of each key kept."""
    obj = {}
    for k, v in pairs:
        obj.setdefault(k, v)
    return obj


def read_rows(path):
    """Every JSON object line of `path`, tags first."""
    return [json.loads(line, object_pairs_hook=first_wins)
            for line in open(path) if line.startswith("{")]
