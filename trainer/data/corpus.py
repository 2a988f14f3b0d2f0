"""The corpus: which files make it up, their content hashes, and reading them as documents.

`plan_corpus` lists and hashes the inputs once (the hashes key the cache) and cuts them into
work units of about a megabyte, so that worker processes can tokenize them in parallel while
the parent keeps their order. `read_unit` turns one unit back into documents. Each document is
a *record* with a global index (a file for TEXT_FILES, a non-blank line for JSONL) so that the
eval split can be chosen before anything is tokenized.
"""

import glob
import hashlib
import json
import os
import sysconfig
from dataclasses import dataclass, field

from protos.trainer_config_pb2 import DataConfig
from trainer.data.errors import CorpusError, DataConfigError

UNIT_BYTES = 1 << 20  # about 0.3 s of tokenizing per unit: fine-grained progress, little IPC
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
NEVER_TEXT_DIRS = {"__pycache__"}  # compiled bytecode: skipped in every directory walk
# Not the standard library proper: third-party packages installed into the interpreter.
STDLIB_EXCLUDED_DIRS = {"site-packages", "dist-packages"}


@dataclass(frozen=True)
class InputFile:
    path: str  # absolute
    relpath: str  # relative to the corpus root: what the manifest and the cache key record
    size: int
    sha256: str


@dataclass(frozen=True)
class WorkUnit:
    """Consecutive records: whole files (TEXT_FILES) or a byte range of lines of one JSONL file."""

    first_record: int
    n_records: int
    paths: tuple = ()  # TEXT_FILES
    path: str = ""  # JSONL: the file, byte range [start, end), line number of `start`
    start: int = 0
    end: int = 0
    first_line: int = 1
    source: int = 0  # index into CorpusPlan.sources: whose format and fields read it


@dataclass
class CorpusPlan:
    description: str
    root: str
    fmt: str  # TEXT_FILES | JSONL | JSONL_CHAT
    files: list = field(default_factory=list)  # [InputFile]
    units: list = field(default_factory=list)  # [WorkUnit]
    records: int = 0
    # The stdlib holds a few deliberately mis-encoded test fixtures: skipped there, an error
    # everywhere else.
    skip_invalid_utf8: bool = False
    sources: list = field(default_factory=list)  # [SourceReader], one per mixture source

    def reader(self, unit: WorkUnit) -> "SourceReader":
        return self.sources[unit.source]

    @property
    def bytes(self) -> int:
        return sum(f.size for f in self.files)


@dataclass(frozen=True)
class SourceReader:
    """How to read the units of one source: its name, resolved DataConfig and format."""

    name: str
    cfg: DataConfig
    fmt: str


@dataclass(frozen=True)
class Record:
    index: int
    source: str  # "file" or "file:line", for messages
    text: str | None = None  # TEXT_FILES / JSONL; None: skipped (not UTF-8, stdlib only)
    prompt: str | None = None  # JSONL_CHAT
    response: str | None = None


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _walk(root: str, suffixes: tuple | None, excluded: set) -> list:
    """Every non-hidden file under root (dangling links too: reading them must fail loudly)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        skip = excluded | NEVER_TEXT_DIRS
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d not in skip)
        for name in filenames:
            if name.startswith(".") or (suffixes and not name.endswith(suffixes)):
                continue
            out.append(os.path.join(dirpath, name))
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def resolve_input(input_path: str, fmt: str) -> tuple[str, str, list, bool]:
    """(description, root, sorted absolute file paths, is_stdlib) for DataConfig.input."""
    if not input_path:
        root = stdlib_dir()
        files = _walk(root, (".py",), STDLIB_EXCLUDED_DIRS)
        return f"Python standard library ({root}, *.py)", root, files, True
    suffixes = None if fmt == "TEXT_FILES" else JSONL_SUFFIXES
    if glob.has_magic(input_path):
        matches = glob.glob(input_path, recursive=True)
        files = sorted(os.path.abspath(p) for p in matches if not os.path.isdir(p))
        prefix = input_path.split("*")[0].split("?")[0].split("[")[0]
        root = os.path.abspath(prefix if prefix.endswith(os.sep) else os.path.dirname(prefix))
        if not files:
            raise DataConfigError("input", f"{input_path!r} matches no files")
        return input_path, root, files, False
    if not os.path.lexists(input_path):
        raise DataConfigError("input", f"{input_path!r} does not exist")
    if os.path.isdir(input_path):
        root = os.path.abspath(input_path)
        files = _walk(root, suffixes, set())
        if not files:
            kind = "files" if suffixes is None else "*.jsonl files"
            raise DataConfigError("input", f"directory {input_path!r} holds no {kind}")
        return input_path, root, files, False
    path = os.path.abspath(input_path)
    return input_path, os.path.dirname(path), [path], False


def _read_error(path: str, err: OSError) -> CorpusError:
    return CorpusError(f"{path}: cannot read: {err.strerror or err}")


def _hash_file(path: str, root: str) -> InputFile:
    try:
        with open(path, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
            size = f.tell()
    except OSError as err:
        raise _read_error(path, err) from None
    return InputFile(path, os.path.relpath(path, root), size, digest)


def _plan_text_files(plan: CorpusPlan, paths: list, max_records: int) -> None:
    if max_records:
        paths = paths[:max_records]
    batch, batch_bytes, first = [], 0, 0
    for path in paths:
        f = _hash_file(path, plan.root)
        plan.files.append(f)
        batch.append(path)
        batch_bytes += f.size
        if batch_bytes >= UNIT_BYTES:
            plan.units.append(WorkUnit(first, len(batch), paths=tuple(batch)))
            first, batch, batch_bytes = first + len(batch), [], 0
    if batch:
        plan.units.append(WorkUnit(first, len(batch), paths=tuple(batch)))
    plan.records = len(paths)


def _plan_jsonl(plan: CorpusPlan, paths: list, max_records: int) -> None:
    """Hash each file and cut it at line ends into units, counting non-blank lines (records)."""
    for path in paths:
        if max_records and plan.records >= max_records:
            break
        digest, size, offset, line = hashlib.sha256(), 0, 0, 1
        carry = b""
        try:
            with open(path, "rb") as f:
                while True:
                    block = f.read(UNIT_BYTES)
                    digest.update(block)
                    size += len(block)
                    data = carry + block
                    cut = len(data) if not block else data.rfind(b"\n") + 1
                    chunk, carry = data[:cut], data[cut:]
                    n = sum(1 for ln in chunk.split(b"\n") if ln.strip())
                    if max_records:
                        n = min(n, max_records - plan.records)
                    if n:
                        span = dict(path=path, start=offset, end=offset + cut, first_line=line)
                        plan.units.append(WorkUnit(plan.records, n, **span))
                    plan.records += n
                    offset += cut
                    line += chunk.count(b"\n")
                    if not block:
                        break
        except OSError as err:
            raise _read_error(path, err) from None
        rel = os.path.relpath(path, plan.root)
        plan.files.append(InputFile(path, rel, size, digest.hexdigest()))


def plan_corpus(cfg: DataConfig, fmt: str) -> CorpusPlan:
    """List, hash and cut the corpus of a defaulted DataConfig into work units."""
    description, root, paths, is_stdlib = resolve_input(cfg.input, fmt)
    plan = CorpusPlan(description, root, fmt, skip_invalid_utf8=is_stdlib)
    plan.sources = [SourceReader("input", cfg, fmt)]
    if fmt == "TEXT_FILES":
        _plan_text_files(plan, paths, cfg.max_documents)
    else:
        _plan_jsonl(plan, paths, cfg.max_documents)
    if plan.records == 0:
        raise CorpusError(f"{description}: the corpus is empty ({len(paths)} files, no documents)")
    return plan


def _decode(data: bytes, source: str, line_base: int = 1) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = line_base + data.count(b"\n", 0, err.start)
        bad = data[err.start]
        raise CorpusError(
            f"{source}:{line}: invalid UTF-8 (byte 0x{bad:02x}); precook reads UTF-8 text only"
        ) from None


def _field(obj: dict, name: str, where: str, flag: str) -> str:
    if name not in obj:
        keys = ", ".join(repr(k) for k in list(obj)[:8]) or "none"
        raise CorpusError(f"{where}: no field {name!r} (fields here: {keys}); see {flag}")
    value = obj[name]
    if not isinstance(value, str):
        kind = type(value).__name__
        raise CorpusError(f"{where}: field {name!r} is a {kind}, expected a string")
    return value


def read_unit(unit: WorkUnit, cfg: DataConfig, fmt: str, skip_invalid_utf8: bool = False):
    """Yield the Records of one work unit, in order."""
    if fmt == "TEXT_FILES":
        for i, path in enumerate(unit.paths):
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as err:
                raise _read_error(path, err) from None
            try:
                text = _decode(data, path)
            except CorpusError:
                if not skip_invalid_utf8:
                    raise
                text = None
            yield Record(unit.first_record + i, path, text=text)
        return
    try:
        with open(unit.path, "rb") as f:
            f.seek(unit.start)
            data = f.read(unit.end - unit.start)
    except OSError as err:
        raise _read_error(unit.path, err) from None
    index = unit.first_record
    for offset, raw in enumerate(data.split(b"\n")):
        if index >= unit.first_record + unit.n_records:
            break
        if not raw.strip():
            continue
        where = f"{unit.path}:{unit.first_line + offset}"
        try:
            obj = json.loads(_decode(raw, unit.path, unit.first_line + offset))
        except json.JSONDecodeError as err:
            raise CorpusError(f"{where}: invalid JSON ({err.msg} at column {err.colno})") from None
        if not isinstance(obj, dict):
            raise CorpusError(f"{where}: expected a JSON object, got {type(obj).__name__}")
        if fmt == "JSONL":
            yield Record(index, where, text=_field(obj, cfg.text_field, where, "--text-field"))
        else:
            prompt = _field(obj, cfg.prompt_field, where, "--prompt-field")
            response = _field(obj, cfg.response_field, where, "--response-field")
            yield Record(index, where, prompt=prompt, response=response)
        index += 1


def input_hashes(plan: CorpusPlan) -> list[tuple[str, int, str]]:
    """[(relpath, size, sha256), ...]: the inputs as the manifest and the cache key see them."""
    return [(f.relpath, f.size, f.sha256) for f in plan.files]
