"""Checkpoints: atomic, checksummed, the last K kept, a damaged one skipped with a warning.

A checkpoint is a directory `step_00000050/` holding
  model.pt     the full (unsharded) model state dict
  train.pt     optimizer, scheduler, RNG states of every rank, loss guard, counters
  meta.json    `CheckpointMeta`: step, SHA-256 and size of both files, loader positions of
               every rank, and what is needed to rebuild the model (its config and vocabulary)
It is written into a temporary directory beside the others, every file fsynced, then renamed
into place: a crash mid-save leaves the previous checkpoint as the newest complete one.
Only rank 0 writes; every rank joins in gathering sharded (FSDP) state.

Under a model-parallel layout (tensor, pipeline, context parallel: no rank holds the whole
model) every rank also writes its shards of model and optimizer into `dcp/`, a distributed
checkpoint (trainer/parallel/dcp.py), and train.pt holds no optimizer: a resume reads `dcp/`,
under any layout (a pipeline run resumed with data parallel, or in one process), and model.pt
is the whole model's weights for everything else that reads checkpoints. meta.json lists and
checksums the shards like the other files. (Several nodes need a shared run directory.)
"""

import dataclasses
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Self

import torch
from google.protobuf import json_format

from protos import trainer_config_pb2
from protos.files import FileDigest, json_bytes, replace_dir, sha256_file, write_bytes
from protos.paths import CHECKPOINT_PREFIX, step_dirs
from trainer import distributed

if TYPE_CHECKING:
    from trainer.parallel.mesh import Mesh

PREFIX = CHECKPOINT_PREFIX
FILES = ("model.pt", "train.pt")
DCP_DIR = "dcp"  # a model-parallel run's shards: <rank files> and .metadata


class CheckpointError(RuntimeError):
    """A checkpoint that is missing, incomplete or does not match its checksums."""


@dataclass(frozen=True)
class TrainingRun:
    """What every checkpoint of a run records besides its step: how to rebuild the model, and
    what it was trained on."""

    kind: str  # the job kind: "PRETRAIN" or "SFT"
    model: trainer_config_pb2.ModelConfig
    vocab_size: int
    dataset: str  # the precooked dataset's directory
    world_size: int  # processes that trained it: the data order continues only with as many


@dataclass(frozen=True)
class CheckpointMeta(TrainingRun):
    """meta.json of one checkpoint (`to_json`/`from_json` keep its on-disk format)."""

    step: int
    loader: list[dict[str, Any]]  # every rank's PackedRowLoader.state_dict(), by rank
    files: dict[str, FileDigest]  # model.pt, train.pt
    saved_at: float  # time.time() of the save

    def to_json(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["model"] = json_format.MessageToDict(self.model, preserving_proto_field_name=True)
        out["files"] = {name: dataclasses.asdict(d) for name, d in self.files.items()}
        return out

    @classmethod
    def from_json(cls, data: Any, source: Path) -> Self:
        """The meta of a parsed meta.json; CheckpointError naming `source` if it is not one."""
        if not isinstance(data, dict):
            raise CheckpointError(f"{source}: not a JSON object")
        missing = [f.name for f in dataclasses.fields(cls) if f.name not in data]
        if missing:
            raise CheckpointError(f"{source}: no {', '.join(missing)}")
        fields = {f.name: data[f.name] for f in dataclasses.fields(cls)}
        try:
            fields["model"] = json_format.ParseDict(data["model"], trainer_config_pb2.ModelConfig())
            fields["files"] = {name: FileDigest(**d) for name, d in data["files"].items()}
        except (json_format.ParseError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{source}: model or files malformed ({e})") from e
        return cls(**fields)


class _HashingFile:
    """A write-only file that computes SHA-256 of what passes through it, for torch.save."""

    def __init__(self, path: Path):
        self.file = open(path, "wb")  # noqa: SIM115 (closed in close())
        self.sha = hashlib.sha256()
        self.size = 0

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        return self.file.write(data)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> FileDigest:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()
        return FileDigest(sha256=self.sha.hexdigest(), bytes=self.size)


def _save(obj, path: Path) -> FileDigest:
    out = _HashingFile(path)
    try:
        torch.save(obj, out)
    finally:
        info = out.close()
    return info


def _digest(path: Path) -> FileDigest:
    return FileDigest(sha256=sha256_file(str(path)), bytes=path.stat().st_size)


def _state_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, cpu_offload=True)


def model_state(model) -> dict:
    """The full model state dict on CPU (gathered from every rank under FSDP)."""
    if hasattr(model, "full_state_dict"):  # expert parallel: experts gathered
        return model.full_state_dict()
    if not distributed.active():
        return {k: v.detach().cpu() for k, v in distributed.unwrap(model).state_dict().items()}
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_state_options())


def optimizer_state(model, optimizer) -> dict:
    if hasattr(model, "full_optimizer_state_dict"):  # expert parallel
        return model.full_optimizer_state_dict(optimizer)
    if not distributed.active():
        return optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_state_options())


def load_model_state(model, state: dict) -> None:
    if hasattr(model, "load_full_state_dict"):  # expert parallel: experts sliced
        model.load_full_state_dict(state)
        return
    if not distributed.active():
        distributed.unwrap(model).load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    set_model_state_dict(model, state, options=_state_options())


def load_optimizer_state(model, optimizer, state: dict) -> None:
    if hasattr(model, "load_full_optimizer_state_dict"):  # expert parallel
        model.load_full_optimizer_state_dict(optimizer, state)
        return
    if not distributed.active():
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_state_options())


def rng_state(device: torch.device) -> dict:
    """This process's RNG states (CPU, and `device`'s under CUDA), for train.pt."""
    state = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["cpu"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def verify(path: Path, files: tuple[str, ...] = FILES) -> CheckpointMeta:
    """meta.json of checkpoint `path` after checking `files` against it; else CheckpointError.
    With `FILES` (what a resume reads), the distributed checkpoint's shards too."""
    try:
        data = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: meta.json unreadable ({e})") from e
    meta = CheckpointMeta.from_json(data, path / "meta.json")
    if files == FILES:
        files += tuple(n for n in meta.files if n.startswith(DCP_DIR + "/"))
    for name in files:
        expected = meta.files.get(name)
        file = path / name
        if expected is None or not file.exists():
            raise CheckpointError(f"{path}: {name} missing")
        size = file.stat().st_size
        if size != expected.bytes:
            raise CheckpointError(f"{path}: {name} is {size} bytes, expected {expected.bytes}")
        if sha256_file(str(file)) != expected.sha256:
            raise CheckpointError(f"{path}: {name} does not match its SHA-256")
    return meta


def checkpoints(directory: Path) -> list[Path]:
    """Complete checkpoint directories in `directory`, oldest first."""
    return [Path(p) for p in step_dirs(str(directory))]


Found = tuple[Path, CheckpointMeta]  # a valid checkpoint's directory and its meta


def newest_valid(
    directory: Path, files: tuple[str, ...] = FILES, warn: Callable[[str], object] = print
) -> Found | None:
    """The newest checkpoint that passes `verify`, warning about each damaged one skipped."""
    for path in reversed(checkpoints(directory)):
        try:
            return path, verify(path, files)
        except CheckpointError as e:
            warn(f"WARNING: skipping damaged checkpoint: {e}")
    return None


class Checkpointer:
    """Saves and finds the checkpoints of one run directory (`<run_dir>/checkpoints`)."""

    def __init__(self, directory: Path, keep_last: int, is_main: bool):
        self.directory = Path(directory)
        self.keep_last = keep_last
        self.is_main = is_main
        if is_main:
            self.directory.mkdir(parents=True, exist_ok=True)
            for stale in self.directory.glob(".tmp-*"):  # a save that died midway
                shutil.rmtree(stale, ignore_errors=True)

    def save(
        self,
        step: int,
        model,
        optimizer,
        train_state: dict,
        loader_position: dict[str, Any],
        run: TrainingRun,
        mesh: "Mesh | None" = None,
    ) -> Path:
        """Collective: every rank calls it. `train_state` (RNG included) and `loader_position`
        (where its next batch starts) are this rank's. `mesh`: the model-parallel layout's mesh
        (trainer/parallel/mesh.py): model and optimizer are then written as shards into dcp/ by
        every rank, and model.pt gathered whole."""
        final = self.directory / f"{PREFIX}{step:08d}"
        tmp = self.directory / f".tmp-{final.name}-{os.getpid()}"
        if self.is_main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        train: dict[str, Any] = {}
        if mesh is not None:
            from trainer.parallel import dcp

            tmp = distributed.broadcast_object(tmp)  # rank 0's: every rank writes into it
            model_sd = dcp.full_weights(model, mesh.group("pp"))
            dcp.save(tmp / DCP_DIR, model, optimizer)
        else:
            model_sd = model_state(model)
            train["optimizer"] = optimizer_state(model, optimizer)
        ranks = distributed.gather_objects({"train": train_state, "loader": loader_position})
        if self.is_main:
            train["ranks"] = [r["train"] for r in ranks]
            files = {
                "model.pt": _save(model_sd, tmp / "model.pt"),
                "train.pt": _save(train, tmp / "train.pt"),
            }
            for shard in sorted((tmp / DCP_DIR).glob("*")):
                files[f"{DCP_DIR}/{shard.name}"] = _digest(shard)
            meta = CheckpointMeta(
                **{f.name: getattr(run, f.name) for f in dataclasses.fields(TrainingRun)},
                step=step,
                loader=[r["loader"] for r in ranks],
                files=files,
                saved_at=time.time(),
            )
            write_bytes(str(tmp / "meta.json"), json_bytes(meta.to_json()))
            replace_dir(str(tmp), str(final))  # replaces the same step saved before a rollback
            for old in checkpoints(self.directory)[: -self.keep_last]:
                shutil.rmtree(old, ignore_errors=True)
        distributed.barrier()
        return final

    def find(self, warn: Callable[[str], object] = print) -> Found | None:
        """Collective: the newest valid checkpoint, chosen on rank 0 and shared."""
        found = newest_valid(self.directory, warn=warn) if self.is_main else None
        return distributed.broadcast_object(found)


def load(path: Path, model, optimizer, rank: int, sharded: bool = False) -> dict:
    """Restore model and optimizer from checkpoint `path`; return this rank's train state
    (rank 0's when the world size differs from the writer's: a resume under another layout,
    where per-rank random streams do not map and the rest is the same on every rank).
    `sharded`: `model` is one rank's part of a model-parallel layout, which reads dcp/ only."""
    # A checkpoint may be another team's file: tensors and plain data only, never a pickle's
    # code (weights_only, spelled out whatever torch's default; trainer/untrusted_files_test.py).
    train = torch.load(path / "train.pt", map_location="cpu", weights_only=True)
    if (path / DCP_DIR).is_dir():
        from trainer.parallel import dcp

        dcp.load(path / DCP_DIR, model, optimizer)
    elif sharded:
        raise CheckpointError(
            f"{path}: written whole (single process, DDP or FSDP); a tensor/pipeline/context "
            "parallel layout resumes from a distributed checkpoint (dcp/): resume this one "
            "with the layout that wrote it"
        )
    else:
        state = torch.load(path / "model.pt", map_location="cpu", mmap=True, weights_only=True)
        load_model_state(model, state)
        load_optimizer_state(model, optimizer, train["optimizer"])
    ranks = train["ranks"]
    world_size = torch.distributed.get_world_size() if distributed.active() else 1
    return ranks[rank] if len(ranks) == world_size else ranks[0]


def language_model_state(path: Path) -> dict:
    """model.pt's language model: the whole state, or its `lm.` part where the run trained
    more than a Transformer (a scalar head: REWARD, PPO; a VLM's encoder and projector)."""
    state = torch.load(Path(path) / "model.pt", map_location="cpu", mmap=True, weights_only=True)
    if any(k.startswith("lm.") for k in state):
        return {k[3:]: v for k, v in state.items() if k.startswith("lm.")}
    return state


def load_model(path: Path, device, use_kernels: bool = True) -> tuple[Any, CheckpointMeta]:
    """(model, meta) for evaluation or generation: the model alone, rebuilt from meta.json."""
    from trainer.model import Transformer, select_ops

    path = Path(path)
    meta = verify(path, files=("model.pt",))
    if meta.kind == "VLM":  # #16: its encoder and projector need the vision section
        raise CheckpointError(
            f"{path} is a VLM checkpoint: read it with its image data (trainer.data.format "
            "JSONL_IMAGE or IMAGE_DIR) and the trainer.vision section it was trained with"
        )
    model = Transformer(meta.model, meta.vocab_size, ops=select_ops(use_kernels, device))
    model.load_state_dict(language_model_state(path))
    return model.to(device).eval(), meta


def pretrained(
    path: Path, model_cfg: trainer_config_pb2.ModelConfig, vocab_size: int
) -> CheckpointMeta:
    """meta.json of the checkpoint an SFT run starts from, if its model fits `model_cfg` and
    `vocab_size`; else a ConfigError naming trainer.checkpoint.path."""
    from protos.config_yaml import ConfigError

    field = "trainer.checkpoint.path"
    try:
        meta = verify(path, files=("model.pt",))
    except CheckpointError as e:
        raise ConfigError(field, str(e)) from e
    if meta.vocab_size != vocab_size:
        raise ConfigError(
            field,
            f"{path} has a {meta.vocab_size}-token vocabulary, the SFT data "
            f"{vocab_size}: precook it with tokenizer: BPE_FILE and tokenizer_path: "
            "the pretraining dataset's tokenizer.json",
        )
    ours = json_format.MessageToDict(model_cfg, preserving_proto_field_name=True)
    theirs = json_format.MessageToDict(meta.model, preserving_proto_field_name=True)
    for name, value in theirs.items():
        if name not in ("max_seq_len", "use_kernels") and ours.get(name) != value:
            raise ConfigError(
                field,
                f"{path} has model.{name} {value}, this config {ours.get(name)}: "
                "set trainer.model as the pretraining run had it",
            )
    return meta
