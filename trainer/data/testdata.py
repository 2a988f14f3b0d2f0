"""Small corpora for the tests: written by the test, seconds to precook, lengths that vary
enough (a few tokens to several rows) to exercise every packing strategy."""

import json
import os

import numpy as np

WORDS = (
    "the of and to in is was for on that with as by at from kitchen token row shard pack "
    "bucket loader epoch seed rank model train eval batch padding document length attention "
    "def return class import self None True False if else while yield lambda 0 1 2 3 42 1024"
).split()


def random_text(rng: np.random.Generator, n_words: int) -> str:
    words = rng.choice(WORDS, size=n_words)
    lines = [" ".join(words[i : i + 12]) for i in range(0, n_words, 12)]
    return "\n".join(lines) + "\n"


def doc_lengths(n: int, seed: int) -> np.ndarray:
    """Words per document: log-uniform from 1 to 600, as skewed as real corpora."""
    rng = np.random.default_rng(seed)
    return np.exp(rng.uniform(0, np.log(600), size=n)).astype(int) + 1


def write_text_corpus(directory: str, n: int = 40, seed: int = 0) -> list[str]:
    """n text files doc-000.txt ... (one document each); returns their texts in file order."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed + 1)
    texts = [random_text(rng, int(k)) for k in doc_lengths(n, seed)]
    for i, text in enumerate(texts):
        with open(os.path.join(directory, f"doc-{i:03d}.txt"), "w", encoding="utf-8") as f:
            f.write(text)
    return texts


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def write_chat_corpus(path: str, n: int = 30, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = [
        {"prompt": "Q: " + random_text(rng, int(a)), "response": "A: " + random_text(rng, int(b))}
        for a, b in zip(
            doc_lengths(n, seed) // 4 + 1, doc_lengths(n, seed + 7) // 4 + 1, strict=True
        )
    ]
    write_jsonl(path, rows)
    return rows


def data_config(**fields):
    """A DataConfig for tests: small BPE, short rows, one process, unless overridden."""
    from protos import trainer_config_pb2

    base = {"vocab_size": 300, "seq_len": 64, "workers": 1, "eval_fraction": 0.1}
    cfg = trainer_config_pb2.DataConfig(**{**base, **fields})
    return cfg


def precook_to_queue(root: str, cache: str, queue) -> None:
    """Precook `root` in a child process and report (path, cache_hit). Lives here, not in the
    test, so that spawned children need not import the test's heavy imports (torch)."""
    from trainer.data.precook import precook_dataset

    ds = precook_dataset(data_config(input=root), cache, show_progress=False)
    queue.put((ds.path, ds.cache_hit))
