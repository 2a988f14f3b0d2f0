"""EXPORT: a Kitchen checkpoint as a Hugging Face model directory.

    config.json             LlamaForCausalLM (llama_format.hf_config)
    generation_config.json  BOS/EOS/pad ids
    model.safetensors       the weights under Llama's names, in model.pt's dtype (fp32 trained,
                            bf16 imported from bf16) or trainer.hf.dtype
    tokenizer.json          the dataset's tokenizer, BOS prepended (hf_tokenizer)
    tokenizer_config.json   PreTrainedTokenizerFast; the chat template of an SFT checkpoint
    kitchen_export.json     where it came from: checkpoint, step, the checkpoint's own SHA-256s
    kitchen_checksums.json  size and SHA-256 of every file above (checked again on import)

`transformers` loads it with `AutoModelForCausalLM.from_pretrained(dir)`, no custom code.
"""

from dataclasses import dataclass
from pathlib import Path

import torch

from protos.files import FileDigest, json_bytes, sha256_file
from trainer import checkpoint
from trainer.data.tokenizer import Tokenizer
from trainer.interop import hf_tokenizer, llama_format, vocab
from trainer.interop.llama_format import HfFormatError
from trainer.interop.publish import publish

PROVENANCE = "kitchen_export.json"


@dataclass(frozen=True)
class Exported:
    path: Path
    step: int
    files: dict[str, FileDigest]
    parameters: int


def hf_tensors(state: dict[str, torch.Tensor], tied: bool) -> dict[str, torch.Tensor]:
    """Kitchen's state dict under Llama's names. Tied embeddings are one tensor in a
    safetensors file (it refuses shared storage); transformers ties lm_head on load."""
    out = {}
    for name, tensor in state.items():
        if tied and name == "output.weight":
            continue
        out[llama_format.hf_name(name)] = tensor.detach().contiguous()
    return out


def export_checkpoint(
    source: Path, tokenizer: Tokenizer, out: Path, dtype: torch.dtype | None = None
) -> Exported:
    """Write checkpoint `source` (verified against its meta.json) as an HF directory `out`,
    its weights in `dtype` (None: as model.pt holds them). CheckpointError or HfFormatError
    name what is wrong; FileExistsError if `out` holds something other than an earlier
    export."""
    from safetensors.torch import save

    meta = checkpoint.verify(source, files=("model.pt",))
    problem = vocab.problem(source, meta, tokenizer.vocab_size, sha256_file(tokenizer.file_path))
    if problem:  # a padded embedding is fine: config.json's vocab_size is the model's rows
        raise HfFormatError(
            "trainer.data", f"{problem}: use the checkpoint's own dataset", str(source)
        )
    state = torch.load(source / "model.pt", map_location="cpu", mmap=True, weights_only=True)
    tensors = hf_tensors(state, meta.model.tie_embeddings)
    if dtype is not None:
        tensors = {name: t.to(dtype) for name, t in tensors.items()}
    dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    special = hf_tokenizer.special_tokens(tokenizer)
    config = llama_format.hf_config(meta.model, meta.vocab_size, special, dtype)
    generation = {"bos_token_id": special.bos_id, "eos_token_id": special.eos_id}
    generation["pad_token_id"] = special.pad_id
    provenance = {
        "checkpoint": str(source),
        "step": meta.step,
        "kind": meta.kind,
        "dataset": meta.dataset,
        "checkpoint_files": {n: vars(d) for n, d in meta.files.items() if n == "model.pt"},
    }
    files = {
        llama_format.CONFIG_FILE: json_bytes(config),
        "generation_config.json": json_bytes(generation),
        llama_format.WEIGHTS_FILE: save(tensors, metadata={"format": "pt"}),
        PROVENANCE: json_bytes(provenance),
        **hf_tokenizer.hf_tokenizer_files(tokenizer, meta.model.max_seq_len, meta.kind == "SFT"),
    }
    ours = (out / PROVENANCE).is_file() or (out.is_dir() and not any(out.iterdir()))
    digests = publish(out, files, replaceable=ours)
    parameters = sum(t.numel() for t in tensors.values())
    return Exported(out, meta.step, digests, parameters)
