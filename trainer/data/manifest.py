"""manifest.json: what a precooked directory holds, and the check that it holds it.

A directory is published only once complete (cache.py), and its manifest lists every other
file with its size and sha256, so a reader can tell a sound directory from a damaged one.
Two kinds: the tokenized corpus (`TokenizedManifest`, stage one) and the packed dataset
(`DatasetManifest`). Each is a dataclass; `to_json`/`read_manifest` keep the JSON on disk as
it always was (the field names are the JSON keys).
"""

import dataclasses
import json
import os
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from protos import files
from protos.files import FileDigest
from protos.paths import PRECOOK_MANIFEST
from trainer.data.curate import Curation
from trainer.data.mixture import SourceStats

FORMAT_VERSION = 1
MANIFEST = PRECOOK_MANIFEST  # protos/paths.py: the launcher reads a dataset's digest too
_OMIT_IF_NONE = {"omit_if_none": True}  # field metadata: absent from the JSON when None


@dataclass(frozen=True)
class TokenizerSection:
    """How to rebuild the tokenizer saved beside the data (tokenizer.from_section)."""

    kind: str  # "bpe" (HF tokenizers) or "cl100k" (tiktoken)
    file: str  # its file in the directory: tokenizer.json or cl100k_base.tiktoken
    sha256: str
    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int
    document_layout: str  # "<bos> text <eos>"
    pat_str: str | None = field(default=None, metadata=_OMIT_IF_NONE)  # cl100k only
    special_tokens: dict[str, int] | None = field(default=None, metadata=_OMIT_IF_NONE)


@dataclass(frozen=True)
class Inputs:
    """The corpus a directory was made from."""

    description: str
    format: str  # TEXT_FILES, JSONL or JSONL_CHAT
    files: list[tuple[str, int, str]]  # (path relative to the corpus root, bytes, sha256)
    bytes: int
    records: int  # files, or non-blank JSONL lines


@dataclass(frozen=True)
class DocumentCounts:
    total: int
    train: int
    eval: int
    skipped_not_utf8: list[str]  # TEXT_FILES: files skipped, relative to the corpus root
    skipped_empty: int


@dataclass(frozen=True)
class TokenCounts:
    total: int
    train: int
    eval: int


@dataclass(frozen=True)
class TokenizedManifest:
    """Stage one: every document tokenized (tokens.bin, doc_offsets.npy, ...)."""

    KIND: ClassVar[str] = "tokenized"
    CACHE_DIR: ClassVar[str] = "tokenized"  # where the cache keeps entries of this kind

    key: str  # the cache key: inputs, tokenizer, split, format
    inputs: Inputs
    tokenizer: TokenizerSection
    token_dtype: str  # uint16 or uint32
    loss_mask: bool  # loss_mask.bin is there (JSONL_CHAT)
    documents: DocumentCounts
    tokens: TokenCounts
    files: dict[str, FileDigest]  # every other file, by path relative to the directory
    # the mixture's sources in order (doc_source.npy indexes this); None: written before #21
    sources: list[str] | None = field(default=None, metadata=_OMIT_IF_NONE)


@dataclass(frozen=True)
class PrecookSettings:
    """The DataConfig fields that decided a dataset, as resolved."""

    format: str
    tokenizer: str  # BPE_TRAIN, BPE_FILE or CL100K
    vocab_size_requested: int | None  # BPE_TRAIN's vocab_size
    eval_fraction: float
    max_documents: int
    shard_tokens: int
    fields: dict[str, str]  # the JSON fields read: {"text": ...} or {"prompt", "response"}


@dataclass(frozen=True)
class SplitStats:
    """One split of a packed dataset."""

    documents: int
    tokens: int  # the documents' tokens before packing
    rows: int
    segments: int  # document pieces placed in rows
    slots: int  # rows x their capacity
    padding_tokens: int
    truncated_tokens: int
    target_tokens: int  # tokens with a next-token target in their row: what is trained on
    shards: int


@dataclass(frozen=True)
class Counts:
    """Both splits together."""

    documents: int
    tokens: int
    rows: int
    padding_tokens: int
    truncated_tokens: int


@dataclass(frozen=True)
class DatasetManifest:
    """A packed, sharded dataset (shards.py), the trainer's input."""

    KIND: ClassVar[str] = "dataset"
    CACHE_DIR: ClassVar[str] = "datasets"

    key: str  # the cache key: the tokenized corpus's key, seq_len, packing, shard_tokens
    tokenized_key: str
    config: PrecookSettings
    inputs: Inputs
    tokenizer: TokenizerSection
    vocab_size: int
    token_dtype: str
    loss_mask: bool
    seq_len: int
    packing: str  # pad, concat, best_fit or bucket
    bucket_lengths: list[int] | None  # bucket packing's row lengths
    documents: DocumentCounts
    splits: dict[str, SplitStats]  # "train", "eval"
    counts: Counts
    files: dict[str, FileDigest]
    # #21: what filters and dedup dropped, and the train tokens of each source
    curation: Curation | None = field(default=None, metadata=_OMIT_IF_NONE)
    sources: dict[str, SourceStats] | None = field(default=None, metadata=_OMIT_IF_NONE)


@dataclass(frozen=True)
class ImageSplitStats:
    """One split of an image+text dataset (trainer/data/images.py)."""

    records: int  # image+text rows
    images: int  # distinct images
    text_tokens: int  # before truncation to seq_len
    target_tokens: int  # text tokens that are a target of the loss
    truncated_tokens: int


@dataclass(frozen=True)
class ImageDatasetManifest:
    """An image+text dataset: uint8 images and text rows, one record per row (images.py)."""

    KIND: ClassVar[str] = "image_dataset"
    CACHE_DIR: ClassVar[str] = "image_datasets"

    key: str  # the cache key: every input byte (records and images), tokenizer, sizes
    inputs: Inputs
    tokenizer: TokenizerSection
    vocab_size: int
    image_size: int  # images are image_size x image_size x 3, uint8
    seq_len: int  # text tokens per row (image tokens come on top, from the model's config)
    question_types: list[str]  # rows.npy's third column indexes this list (-1: none)
    skipped_images: list[str]  # "file:line: reason" of every image skipped
    splits: dict[str, ImageSplitStats]
    files: dict[str, FileDigest]


Manifest = TokenizedManifest | DatasetManifest | ImageDatasetManifest
M = TypeVar("M", TokenizedManifest, DatasetManifest, ImageDatasetManifest)


def to_json(obj: Any) -> Any:
    """A manifest (or any part of one) as the JSON value written to disk."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {
            f.name: to_json(getattr(obj, f.name))
            for f in dataclasses.fields(obj)
            if not (f.metadata.get("omit_if_none") and getattr(obj, f.name) is None)
        }
    if isinstance(obj, dict):
        return {k: to_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_json(v) for v in obj]
    return obj


def from_json(cls: type, value: Any, where: str = "") -> Any:
    """`value` (parsed JSON) as an instance of `cls`, checked against its type hints; a
    ValueError names the field at fault (`where` is the path to `value`)."""
    origin, args = typing.get_origin(cls), typing.get_args(cls)
    at = where or "the manifest"
    if dataclasses.is_dataclass(cls):
        if not isinstance(value, dict):
            raise ValueError(f"{at}: expected an object, got {value!r:.60}")
        hints = typing.get_type_hints(cls)
        kwargs = {}
        for f in dataclasses.fields(cls):
            path = f"{where}.{f.name}" if where else f.name
            if f.name in value:
                kwargs[f.name] = from_json(hints[f.name], value[f.name], path)
            elif f.default is dataclasses.MISSING:
                raise ValueError(f"{path}: missing")
        return cls(**kwargs)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return from_json(inner, value, where)
    if origin is dict:
        if not isinstance(value, dict):
            raise ValueError(f"{at}: expected an object, got {value!r:.60}")
        return {k: from_json(args[1], v, f"{where}.{k}") for k, v in value.items()}
    if origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{at}: expected a list, got {value!r:.60}")
        return [from_json(args[0], v, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, list) or len(value) != len(args):
            raise ValueError(f"{at}: expected a list of {len(args)}, got {value!r:.60}")
        return tuple(
            from_json(a, v, f"{where}[{i}]")
            for i, (a, v) in enumerate(zip(args, value, strict=True))
        )
    expected = (int, float) if cls is float else cls  # JSON writes 1.0 as 1.0, but accept 1
    if not isinstance(value, expected) or (cls is not bool and isinstance(value, bool)):
        raise ValueError(f"{at}: expected {cls.__name__}, got {value!r:.60}")
    return value


def read_manifest(path: str, kind: type[M]) -> M:
    """The manifest of a precooked directory of `kind`; ValueError naming the file (and the
    field) if it is not one."""
    name = os.path.join(path, MANIFEST)
    try:
        with open(name, encoding="utf-8") as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{path}: not a precooked dataset (no {MANIFEST})") from None
    except json.JSONDecodeError as err:
        raise ValueError(f"{name}: not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{name}: not a JSON object")
    if data.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{name}: format version {data.get('format_version')}, this code reads "
            f"{FORMAT_VERSION}: precook it again"
        )
    if data.get("kind") != kind.KIND:
        raise ValueError(f"{name}: kind {data.get('kind')!r}, expected {kind.KIND!r}")
    try:
        return from_json(kind, data)
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def as_json(manifest: Manifest) -> dict[str, Any]:
    """The whole of manifest.json: the manifest, its kind and the format version."""
    return {"format_version": FORMAT_VERSION, "kind": manifest.KIND, **to_json(manifest)}


def write_manifest(directory: str, manifest: Manifest) -> None:
    files.write_bytes(os.path.join(directory, MANIFEST), files.json_bytes(as_json(manifest)))


def problem(path: str, manifest: Manifest) -> str | None:
    """Why the directory does not match its manifest (a missing, resized or changed file),
    or None when it does."""
    for rel, want in sorted(manifest.files.items()):
        name = os.path.join(path, rel)
        try:
            size = os.path.getsize(name)
        except OSError:
            return f"{rel} is missing"
        if size != want.bytes:
            return f"{rel} has {size} bytes, the manifest says {want.bytes}"
        if files.sha256_file(name) != want.sha256:
            return f"{rel} does not match its sha256 in the manifest"
    return None
