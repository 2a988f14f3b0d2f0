"""IMPORT: a Hugging Face Llama-architecture directory as a Kitchen checkpoint.

The directory (config.json, model.safetensors or a sharded model.safetensors.index.json,
tokenizer.json) becomes `<run dir>/checkpoints/step_00000000`: model.pt, meta.json with the
model's ModelConfig and vocabulary size, and imported_from.json (the source directory and the
SHA-256 of each file read). From there it is the starting checkpoint of any job that takes
`checkpoint.path` (sft, eval, generate). Shapes Kitchen's model cannot represent are refused
naming the config.json field (llama_format.model_config) or the tensor that differs. A
directory Kitchen exported carries kitchen_checksums.json: its files are checked against it.
"""

import hashlib
import io
import json
import time
from pathlib import Path

import torch

from protos.files import FileDigest, json_bytes, sha256_file
from trainer import checkpoint
from trainer.interop import llama_format
from trainer.interop.llama_format import HfFormatError
from trainer.interop.publish import CHECKSUMS, publish

SOURCE = "imported_from.json"
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # buffers some old checkpoints saved


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise HfFormatError("(file)", f"unreadable ({e})", str(path)) from e
    if not isinstance(data, dict):
        raise HfFormatError("(top level)", "not a JSON object", str(path))
    return data


def _check_carried_checksums(hf_dir: Path) -> None:
    """A Kitchen export lists every file's SHA-256: a damaged copy is refused naming the file."""
    if not (hf_dir / CHECKSUMS).is_file():
        return
    for name, digest in _read_json(hf_dir / CHECKSUMS).items():
        path = hf_dir / name
        if not path.is_file() or sha256_file(str(path)) != digest["sha256"]:
            raise HfFormatError(
                name, f"missing or does not match its SHA-256 in {CHECKSUMS}", str(hf_dir)
            )


def weight_files(hf_dir: Path) -> list[Path]:
    """The safetensors files of the model: one, or the shards an index names."""
    single = hf_dir / llama_format.WEIGHTS_FILE
    if single.is_file():
        return [single]
    index = hf_dir / llama_format.WEIGHTS_INDEX
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        return [hf_dir / s for s in shards]
    raise HfFormatError(
        llama_format.WEIGHTS_FILE, "missing (only safetensors weights are read)", str(hf_dir)
    )


def load_tensors(hf_dir: Path, expected: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """Every expected tensor, in the file's dtype (a bf16 model stays bf16: half the bytes of
    fp32, and an export gives back the same file), after checking its shape; HfFormatError
    naming the tensor (and the config.json fields its shape comes from) otherwise."""
    from safetensors import safe_open

    found: dict[str, torch.Tensor] = {}
    position = {name: i for i, name in enumerate(expected)}
    for file in weight_files(hf_dir):
        if not file.is_file():
            raise HfFormatError(
                file.name, f"missing (named by {llama_format.WEIGHTS_INDEX})", str(hf_dir)
            )
        with safe_open(str(file), framework="pt") as f:
            # In the model's order (unknown names first): the first error is the first layer's.
            for name in sorted(f.keys(), key=lambda n: position.get(n, -1)):
                if name.endswith(IGNORED_SUFFIXES):
                    continue
                if name not in expected:
                    raise HfFormatError(name, f"no such parameter in {_cfg(hf_dir)}", str(file))
                tensor = f.get_tensor(name)
                if tuple(tensor.shape) != expected[name]:
                    kind = name.split(".")[-2]
                    fields = llama_format.SHAPE_FIELDS.get(kind, "hidden_size")
                    raise HfFormatError(
                        name,
                        f"shape {list(tensor.shape)}, but config.json ({fields}) gives "
                        f"{list(expected[name])}",
                        str(file),
                    )
                found[name] = tensor
    missing = [n for n in expected if n not in found]
    if missing:
        raise HfFormatError(missing[0], f"missing ({len(missing)} tensors in all)", str(hf_dir))
    return found


def _cfg(hf_dir: Path) -> Path:
    return hf_dir / llama_format.CONFIG_FILE


def import_hf(hf_dir: Path, checkpoints: Path) -> checkpoint.Found:
    """Write the HF model in `hf_dir` as checkpoint step 0 in directory `checkpoints`; return
    (its path, its meta). HfFormatError names what Kitchen's model cannot represent."""
    from trainer.model import Transformer

    if not hf_dir.is_dir():
        raise HfFormatError("trainer.hf.path", f"{hf_dir} is not a directory")
    _check_carried_checksums(hf_dir)
    config = _read_json(_cfg(hf_dir))
    model_cfg, vocab = llama_format.model_config(config, str(_cfg(hf_dir)))
    model_cfg.use_kernels = True
    tensors = load_tensors(hf_dir, llama_format.expected_shapes(model_cfg, vocab))
    model = Transformer(model_cfg, vocab)
    by_hf = {llama_format.hf_name(name): name for name in model.state_dict()}
    state = {by_hf[name]: t for name, t in tensors.items()}
    if model_cfg.tie_embeddings:  # one tensor in the file, two names in the model
        state["output.weight"] = state["tok_embeddings.weight"]
    model.load_state_dict(state)  # every tensor fits the model (the jobs load it so, upcast)
    buffer = io.BytesIO()
    torch.save({name: state[name] for name in model.state_dict()}, buffer)  # the file's dtypes
    weights = buffer.getvalue()
    files = {"model.pt": weights}
    read = [_cfg(hf_dir), *weight_files(hf_dir), hf_dir / "tokenizer.json"]
    source = {
        "hf_dir": str(hf_dir),
        "files": {p.name: sha256_file(str(p)) for p in read if p.is_file()},
    }
    files[SOURCE] = json_bytes(source)
    final = checkpoints / f"{checkpoint.PREFIX}{0:08d}"
    meta = checkpoint.CheckpointMeta(
        kind="IMPORT",
        model=model_cfg,
        vocab_size=vocab,
        dataset="",  # none: the job that uses it precooks its own data with this tokenizer
        world_size=1,
        step=0,
        loader=[],
        files={"model.pt": FileDigest(len(weights), hashlib.sha256(weights).hexdigest())},
        saved_at=time.time(),
    )
    files["meta.json"] = json_bytes(meta.to_json())
    publish(final, files, replaceable=True)
    return final, checkpoint.verify(final, files=("model.pt",))
