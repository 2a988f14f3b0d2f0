"""Image+text precook: records in, a cached dataset of uint8 images and text rows out.

Inputs (DataConfig.format):
- JSONL_IMAGE: one JSON object per line with `vision.image_field` (a path, relative to the JSONL
  file) and either `text_field` (a caption: every token is a target) or `prompt_field` and
  `response_field` (a question: only the answer and <eos> are targets). An optional
  `vision.type_field` names the question type, which evaluation groups accuracy by.
- IMAGE_DIR: a directory of images, each with its caption in a .txt file of the same stem.

Each image is decoded once, converted to RGB, its shorter side resized to `image_size` and
center-cropped to a square. Records of one image share a split: the held-out split is held-out
images (spread evenly, as text precook spreads held-out documents). Layout of a split:

    <split>/images.bin     uint8 (images, S, S, 3), memory-mappable
    <split>/tokens.npy     int32 (records, seq_len): <bos> text <eos>, then pad_id
    <split>/targets.npy    uint8 (records, seq_len): 1 = a target of the loss
    <split>/rows.npy       int64 (records, 3): image index, text length, question type (-1 none)

One record is one row, so attention never crosses records. The entry lives in the same
content-addressed cache as text datasets (cache.py), keyed by every input byte (the JSONL and
each image), the tokenizer and the sizes. Unreadable images are skipped and listed in the
manifest (or fail the job: `vision.bad_images: FAIL_ON_BAD`); a malformed line is an error naming
file and line.
"""

import json
import os
import time
from dataclasses import dataclass
from typing import IO

import numpy as np

from protos.enums import enum_name
from protos.files import FileDigest, write_bytes
from protos.trainer_config_pb2 import TrainerConfig
from trainer.data import cache as cache_mod
from trainer.data import manifest
from trainer.data.corpus import _decode, _field, _hash_file, resolve_input
from trainer.data.errors import CorpusError, DataConfigError
from trainer.data.files import write_npy
from trainer.data.manifest import ImageDatasetManifest, ImageSplitStats, Inputs
from trainer.data.progress import reporter
from trainer.data.shards import SPLITS
from trainer.data.tokenized import eval_count, is_eval, tokenizer_identity, tokenizer_of

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp")


@dataclass(frozen=True)
class ImageRecord:
    image: str  # absolute path
    where: str  # "file:line", for messages
    prompt: str  # "" for a caption
    text: str  # the caption, or the response
    qtype: str  # question type ("" when none)


def read_records(cfg: TrainerConfig) -> tuple[str, str, list[ImageRecord]]:
    """(description, root, records) of data.input; CorpusError naming file:line when malformed."""
    d, v = cfg.data, cfg.vision
    fmt = enum_name(d, "format")
    if fmt == "IMAGE_DIR":
        description, root, paths, _ = resolve_input(d.input, "TEXT_FILES")
        out = []
        for path in paths:
            stem, suffix = os.path.splitext(path)
            if suffix.lower() not in IMAGE_SUFFIXES:
                continue
            if not os.path.exists(stem + ".txt"):
                raise CorpusError(f"{path}: no caption beside it ({os.path.basename(stem)}.txt)")
            with open(stem + ".txt", "rb") as f:
                caption = _decode(f.read(), stem + ".txt").strip()
            out.append(ImageRecord(path, path, "", caption, ""))
        if not out:
            raise DataConfigError(
                "input", f"{d.input!r} holds no images ({', '.join(IMAGE_SUFFIXES)})"
            )
        return description, root, out
    description, root, paths, _ = resolve_input(d.input, "JSONL")
    out = []
    for path in paths:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
        for n, raw in enumerate(lines, 1):
            if not raw.strip():
                continue
            where = f"{path}:{n}"
            try:
                obj = json.loads(_decode(raw, path, n))
            except json.JSONDecodeError as err:
                raise CorpusError(
                    f"{where}: invalid JSON ({err.msg} at column {err.colno})"
                ) from None
            if not isinstance(obj, dict):
                raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            image = os.path.join(
                os.path.dirname(path), _field(obj, v.image_field, where, "vision.image_field")
            )
            qtype = obj.get(v.type_field, "")
            if not isinstance(qtype, str):
                raise CorpusError(
                    f"{where}: field {v.type_field!r} is a {type(qtype).__name__}, "
                    "expected a string"
                )
            if d.prompt_field in obj:
                prompt = _field(obj, d.prompt_field, where, "data.prompt_field")
                text = _field(obj, d.response_field, where, "data.response_field")
            else:
                prompt, text = "", _field(obj, d.text_field, where, "data.text_field")
            out.append(ImageRecord(os.path.abspath(image), where, prompt, text, qtype))
    return description, root, out


def load_image(source: str | IO[bytes], size: int) -> np.ndarray:
    """(size, size, 3) uint8: RGB, shorter side resized to `size`, center-cropped. `source` is
    a path or the bytes of an image file (a served request's image: trainer/serve/images.py).
    OSError or PIL's errors for what is not a readable image."""
    from PIL import Image

    with Image.open(source) as f:
        im = f.convert("RGB")
        w, h = im.size
        scale = size / min(w, h)
        im = im.resize(
            (max(size, round(w * scale)), max(size, round(h * scale))), Image.Resampling.BICUBIC
        )
        left, top = (im.size[0] - size) // 2, (im.size[1] - size) // 2
        return np.asarray(im.crop((left, top, left + size, top + size)), dtype=np.uint8)


def image_dataset_key(cfg: TrainerConfig, inputs: list[tuple[str, int, str]]) -> str:
    d, v = cfg.data, cfg.vision
    return cache_mod.key_of(
        {
            "stage": "image_dataset",
            "format_version": manifest.FORMAT_VERSION,
            "format": enum_name(d, "format"),
            "fields": [d.text_field, d.prompt_field, d.response_field, v.image_field, v.type_field],
            "tokenizer": tokenizer_identity(d),
            "image_size": v.image_size,
            "seq_len": d.seq_len,
            "eval_fraction": d.eval_fraction,
            "max_documents": d.max_documents,
            "bad_images": enum_name(v, "bad_images"),
            "inputs": inputs,
        }
    )


def _build(tmp: str, cfg: TrainerConfig, key: str, description: str, inputs, records, say):
    d, v = cfg.data, cfg.vision
    S, T = v.image_size, d.seq_len
    images: dict[str, int] = {}  # path -> index in first-appearance order
    for r in records:
        images.setdefault(r.image, len(images))
    n_eval = eval_count(len(images), d.eval_fraction)
    split_of_image = is_eval(np.arange(len(images)), len(images), n_eval).astype(np.int64)
    pixels: dict[str, np.ndarray] = {}
    skipped: list[str] = []
    bad: set[str] = set()
    for r in records:
        if r.image in pixels or r.image in bad:
            continue
        try:
            pixels[r.image] = load_image(r.image, S)
        except Exception as err:  # PIL raises many kinds (UnidentifiedImageError, OSError, ...)
            problem = f"{r.where}: {r.image}: not a readable image ({type(err).__name__}: {err})"
            if enum_name(v, "bad_images") == "FAIL_ON_BAD":
                raise CorpusError(problem) from None
            skipped.append(problem)
            bad.add(r.image)
    if skipped:
        say(f"skipped {len(skipped)} unreadable images (listed in the manifest): {skipped[0]}")
    kept = [r for r in records if r.image in pixels]
    train_texts = [r.prompt + r.text for r in kept if split_of_image[images[r.image]] == 0]
    tok = tokenizer_of(cfg.data, train_texts, say)
    qtypes = sorted({r.qtype for r in kept if r.qtype})
    written: dict[str, FileDigest] = {}
    splits: dict[str, ImageSplitStats] = {}
    for split_id, split in enumerate(SPLITS):
        rows = [r for r in kept if split_of_image[images[r.image]] == split_id]
        order = sorted({r.image for r in rows}, key=images.__getitem__)
        index = {path: i for i, path in enumerate(order)}
        tokens = np.full((len(rows), T), tok.pad_id, dtype=np.int32)
        targets = np.zeros((len(rows), T), dtype=np.uint8)
        table = np.zeros((len(rows), 3), dtype=np.int64)
        total = target_total = truncated = 0
        for i, r in enumerate(rows):
            prompt = tok.encode(r.prompt) if r.prompt else []
            text = [tok.bos_id, *prompt, *tok.encode(r.text), tok.eos_id]
            mask = [0] * (1 + len(prompt)) + [1] * (len(text) - 1 - len(prompt))
            total += len(text)
            truncated += max(len(text) - T, 0)
            n = min(len(text), T)
            tokens[i, :n], targets[i, :n] = text[:n], mask[:n]
            target_total += sum(mask[1:n])
            table[i] = (index[r.image], n, qtypes.index(r.qtype) if r.qtype else -1)
        os.makedirs(os.path.join(tmp, split), exist_ok=True)
        stack = np.stack([pixels[p] for p in order]) if order else np.zeros((0, S, S, 3), np.uint8)
        written[f"{split}/images.bin"] = write_bytes(os.path.join(tmp, split, "images.bin"), stack)
        for name, array in (("tokens", tokens), ("targets", targets), ("rows", table)):
            written[f"{split}/{name}.npy"] = write_npy(
                os.path.join(tmp, split, f"{name}.npy"), array
            )
        splits[split] = ImageSplitStats(len(rows), len(order), total, target_total, truncated)
        say(f"{split}: {len(rows):,} records on {len(order):,} images, {total:,} text tokens")
        if truncated:
            say(
                f"warning: {split}: {truncated:,} text tokens cut at seq_len {T}: "
                "raise data.seq_len"
            )
    section = tok.save(tmp)
    written[section.file] = FileDigest(
        os.path.getsize(os.path.join(tmp, section.file)), section.sha256
    )
    body = ImageDatasetManifest(
        key=key,
        inputs=Inputs(
            description, enum_name(d, "format"), inputs, sum(f[1] for f in inputs), len(records)
        ),
        tokenizer=section,
        vocab_size=section.vocab_size,
        image_size=S,
        seq_len=T,
        question_types=qtypes,
        skipped_images=skipped,
        splits=splits,
        files=written,
    )
    manifest.write_manifest(tmp, body)
    return manifest.read_manifest(tmp, ImageDatasetManifest)


@dataclass(frozen=True)
class PrecookedImages:
    path: str
    manifest: ImageDatasetManifest
    cache_hit: bool


def precook_images(
    cfg: TrainerConfig, cache_dir: str, *, show_progress: bool = True
) -> PrecookedImages:
    """Precook the image+text records of a resolved TrainerConfig under `cache_dir`, or find
    them there. CorpusError / DataConfigError for input that cannot be precooked."""

    say = reporter(show_progress)
    start = time.perf_counter()
    description, root, records = read_records(cfg)
    if cfg.data.max_documents:
        records = records[: cfg.data.max_documents]
    files = sorted({r.where.rsplit(":", 1)[0] for r in records} | {r.image for r in records})
    inputs = []
    for path in files:
        if os.path.exists(path):  # a missing image is a bad image, found when decoding
            f = _hash_file(path, root)
            inputs.append((f.relpath, f.size, f.sha256))
        else:
            inputs.append((os.path.relpath(path, root), -1, ""))
    key = image_dataset_key(cfg, inputs)
    name = f"{cfg.vision.image_size}px-{cfg.data.seq_len}-{key[:16]}"
    build = lambda tmp: _build(tmp, cfg, key, description, inputs, records, say)
    path, found, hit = cache_mod.Cache(cache_dir).get_or_build(
        ImageDatasetManifest, name, key, build, say
    )
    say(f"{'cache hit' if hit else 'built'} in {time.perf_counter() - start:.1f} s: {path}")
    return PrecookedImages(path, found, hit)
