"""Which tokenizer may drive a checkpoint's model, by its number of ids against the model's
rows of token embeddings:

- as many ids as rows: any tokenizer (as always: another vocabulary of exactly the same size
  is not caught);
- more rows than ids: only the checkpoint's own tokenizer, the tokenizer.json it was imported
  with (imported_from.json) or the one of the dataset it trained on (same SHA-256). Published
  checkpoints pad their embedding past the tokenizer (777 ids, 832 rows: a multiple of 64),
  rows no text encodes to and no decode path samples (trainer/inference/engine.py); a smaller
  vocabulary that is not theirs would be misread without a word;
- more ids than rows: never (an id past the last row has no embedding).
"""

import json
from pathlib import Path

from trainer.data.tokenizer import tokenizer_section


def own_tokenizer_sha256(path: Path, dataset: str) -> str | None:
    """SHA-256 of the tokenizer checkpoint `path`'s model was made with: the tokenizer.json its
    import read, else the one beside its dataset (`dataset`, meta.json's); None if unknown."""
    from trainer.interop.hf_import import SOURCE

    if (path / SOURCE).is_file():
        return json.loads((path / SOURCE).read_text())["files"].get("tokenizer.json")
    if dataset and Path(dataset).is_dir():
        return tokenizer_section(dataset).sha256
    return None


def problem(path: Path, meta, ids: int, sha256: str) -> str | None:
    """Why a tokenizer of `ids` ids whose file has SHA-256 `sha256` cannot drive checkpoint
    `path` (its meta.json `meta`), or None when it can (module docstring)."""
    rows = meta.vocab_size
    if ids > rows:
        return f"the tokenizer has {ids:,} ids, more than the model's {rows:,} token embeddings"
    if ids < rows and sha256 != own_tokenizer_sha256(path, meta.dataset):
        return (
            f"the tokenizer has {ids:,} ids, the model {rows:,} token embeddings: fewer ids than "
            "rows only with the checkpoint's own tokenizer (a padded vocabulary), and this "
            "tokenizer is not the one it was imported with or trained on"
        )
    return None


def dataset_problem(path: Path, meta, dataset: str) -> str | None:
    """`problem` for the tokenizer beside precooked dataset `dataset`."""
    section = tokenizer_section(dataset)
    return problem(path, meta, section.vocab_size, section.sha256)
