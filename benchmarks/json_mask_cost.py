"""What the trainer's replay of constrained decoding's masks costs on the host (docs/DESIGN.md
§6.6): the token trie of a vocabulary, then one batch of json_object / json_schema replies
replayed into its mask table (`sat_jax.json_mask.MaskTable`), cold (every automaton state's mask
built for the first time) and warm (a second batch: the masks of states seen before are cached).

    python benchmarks/json_mask_cost.py                  # a 151,643-id byte-level BPE, 64 replies
    python benchmarks/json_mask_cost.py --quick          # 4,096 ids, 8 replies (seconds)

The vocabulary is a byte-level BPE written on the fly (no download, no training): the 256 byte
symbols, then merges of an existing token with a letter, digit, space or punctuation until
``--vocab`` ids, so the trie has the size and depth of a real ~150k vocabulary's (a token's bytes
are what the walk reads). Replies are ``json.dumps`` of random objects (json_object) and of random
instances of a schema (enum, booleans, a string, an array), encoded by that tokenizer with the
stop id at the end. Prints one line per figure; no figure is asserted anywhere.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import tempfile
import time

import numpy as np

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "pick": {"enum": ["alpha", "beta", 7, None]},
        "ok": {"type": "boolean"},
        "steps": {"type": "array", "items": {"type": "integer"}},
    },
    "required": ["answer", "pick", "ok"],
}
WORDS = "the of and to in is it that for as with was on be by at this are from or sum total".split()


def write_tokenizer(directory: pathlib.Path, vocab: int, seed: int = 0) -> None:
    """A byte-level BPE of `vocab` ids (specials included) as tokenizer.json + config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from sat_jax.model.make_tiny import EOS, PAD, SPECIALS

    rng = random.Random(seed)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    pieces = [c for c in alphabet if c.isalnum() or c in "Ġ.,:;\"'{}[]-_"]
    tokens, merges, seen = list(alphabet), [], set(alphabet)
    while len(tokens) < vocab - len(SPECIALS):
        a = tokens[rng.randrange(len(alphabet), len(tokens))] if len(tokens) > 300 else None
        a = a if a is not None and rng.random() < 0.7 else rng.choice(pieces)
        b = rng.choice(pieces)
        if a + b in seen or len(a) > 14:
            continue
        seen.add(a + b)
        tokens.append(a + b)
        merges.append((a, b))
    ids = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=ids, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS,
        "pad_token": PAD,
        "clean_up_tokenization_spaces": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def _value(rng: random.Random, depth: int) -> object:
    kind = rng.choice(["str", "num", "bool", "list", "obj"] if depth < 3 else ["str", "num"])
    if kind == "str":
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6)))
    if kind == "num":
        return rng.choice([rng.randint(-999, 99999), round(rng.uniform(-50, 50), 3)])
    if kind == "bool":
        return rng.random() < 0.5
    if kind == "list":
        return [_value(rng, depth + 1) for _ in range(rng.randint(0, 4))]
    return {rng.choice(WORDS) + str(i): _value(rng, depth + 1) for i in range(rng.randint(1, 4))}


def replies(rng: random.Random, n: int) -> list[tuple[str, str]]:
    """`n` (format, reply text) pairs, json_object and json_schema alternately."""
    from sat_jax.json_mask import parse_response_format

    obj = parse_response_format({"type": "json_object"})
    schema = parse_response_format({"type": "json_schema", "json_schema": {"schema": SCHEMA}})
    out = []
    for i in range(n):
        if i % 2 == 0:
            value = {rng.choice(WORDS) + str(k): _value(rng, 1) for k in range(rng.randint(2, 6))}
            out.append((obj, json.dumps(value, indent=rng.choice([None, 2]))))
        else:
            value = {
                "answer": " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12))),
                "pick": rng.choice(["alpha", "beta", 7, None]),
                "ok": rng.random() < 0.5,
                "steps": [rng.randint(0, 999) for _ in range(rng.randint(0, 6))],
            }
            out.append((schema, json.dumps(value)))
    return out


def replay_batch(tokenizer, vocab: int, batch: list[tuple[str, str]]) -> dict:
    """One batch's `MaskTable`: its rows, tokens and replay time."""
    from sat_jax.json_mask import MaskTable

    encoded = [(f, np.array([*tokenizer.encode(t), tokenizer.eos_id])) for f, t in batch]
    table = MaskTable(tokenizer, vocab)
    start = time.perf_counter()
    for fmt, ids in encoded:
        table.trajectory((fmt,), np.ones(len(ids), np.int32), ids)
    seconds = time.perf_counter() - start
    packed = table.packed()
    return {
        "seconds": seconds,
        "tokens": sum(len(ids) for _, ids in encoded),
        "rows": len(table),
        "table_bytes": packed.nbytes,
        "table_shape": packed.shape,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=151_643)
    parser.add_argument("--replies", type=int, default=64)
    parser.add_argument("--quick", action="store_true", help="4,096 ids and 8 replies")
    args = parser.parse_args(argv)
    if args.quick:
        args.vocab, args.replies = 4096, 8
    from sat_jax.json_mask import trie_of
    from sat_jax.tasks.hf_tokenizer import HFTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        write_tokenizer(pathlib.Path(tmp), args.vocab)
        tokenizer = HFTokenizer(tmp)
        print(f"tokenizer: {len(tokenizer)} ids, written in {time.perf_counter() - start:.1f} s")
        start = time.perf_counter()
        trie_of(tokenizer, len(tokenizer))
        print(f"token trie: {time.perf_counter() - start:.2f} s (once per tokenizer and process)")
        rng = random.Random(1)
        for name in ("cold", "warm"):
            r = replay_batch(tokenizer, len(tokenizer), replies(rng, args.replies))
            print(
                f"batch {name}: {args.replies} replies, {r['tokens']} constrained tokens, "
                f"{r['rows']} distinct masks, replay {r['seconds']:.2f} s "
                f"({1e6 * r['seconds'] / r['tokens']:.0f} us/token), table "
                f"{r['table_shape'][0]} x {r['table_shape'][1]} uint32 = "
                f"{r['table_bytes'] / 2**20:.2f} MiB"
            )


if __name__ == "__main__":
    main()
