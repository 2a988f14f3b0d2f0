"""Write a small supervised fine-tuning set for the guides (docs/sft.md): questions about the
Python standard library's public functions and classes, each answered with the first sentence of
its docstring.

    ./bazel run //docs:make_sft_data -- data/chat.jsonl [--max-pairs 4000]
        [--tokenizer-from .state/runs/j2/checkpoints/step_00000060]

One JSON object per line, {"prompt": "...", "response": "..."}: the JSONL_CHAT format precook
reads (`trainer.data.format: jsonl_chat`). A model pretrained on the standard library has seen
every one of these docstrings, but never as an answer to a question: fine-tuning teaches the
format, not the facts.

Fine-tuning must keep the token ids the model learned: `--tokenizer-from CHECKPOINT` copies the
tokenizer of the dataset that checkpoint was trained on (its meta.json names the dataset) beside
the data, as `tokenizer.json`, for the SFT config's `data.tokenizer_path`.
"""

import argparse
import ast
import json
import os
import sys
import sysconfig

from protos.files import write_atomic
from protos.paths import user_path

SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_files(root: str) -> list:
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIPPED_DIRS and not d.startswith("."))
        out += [os.path.join(dirpath, n) for n in filenames if n.endswith(".py")]
    return sorted(out, key=lambda p: os.path.relpath(p, root))


def module_name(path: str, root: str) -> str:
    name = os.path.relpath(path, root)[: -len(".py")].replace(os.sep, ".")
    return name.removesuffix(".__init__")


def first_sentence(doc: str) -> str:
    """The docstring's first sentence: its first paragraph up to the first full stop."""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph[: end + 1] if end >= 0 else paragraph


def pairs_in(path: str, module: str):
    """(prompt, response) for each public top-level function and class with a docstring."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return  # a few stdlib files are deliberately broken test fixtures
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        first = first_sentence(ast.get_docstring(node) or "")
        if not 10 <= len(first) <= 150:
            continue
        if isinstance(node, ast.ClassDef):
            yield f"What is {module}.{node.name}?\n", first
        else:
            yield f"What does {module}.{node.name}() do?\n", first


class BadInput(Exception):
    """A flag that cannot work; the message names it."""


def tokenizer_of(checkpoint: str) -> str:
    """The tokenizer.json of the dataset the checkpoint was trained on."""
    meta_path = os.path.join(checkpoint, "meta.json")
    try:
        with open(meta_path) as f:
            dataset = json.load(f)["dataset"]
    except (OSError, ValueError, KeyError) as e:
        raise BadInput(f"--tokenizer-from: {meta_path}: cannot read the dataset: {e}") from None
    source = os.path.join(dataset, "tokenizer.json")
    if not os.path.exists(source):
        raise BadInput(
            f"--tokenizer-from: {source} does not exist (a cl100k model needs no copy: use "
            "tokenizer: cl100k; a deleted cache: precook the pretraining data again)"
        )
    return source


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="make_sft_data", description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the .jsonl file to write (relative to where you run the command)")
    p.add_argument("--max-pairs", type=int, default=4000, help="stop after this many pairs")
    p.add_argument(
        "--tokenizer-from",
        metavar="CHECKPOINT",
        help="a pretraining checkpoint dir: copy its tokenizer.json beside OUT",
    )
    args = p.parse_args(argv)
    try:
        if args.max_pairs < 1:
            raise BadInput(f"--max-pairs: {args.max_pairs} must be at least 1")
        checkpoint = user_path(args.tokenizer_from) if args.tokenizer_from else ""
        tokenizer = tokenizer_of(checkpoint) if checkpoint else ""
    except BadInput as e:
        print(f"make_sft_data: {e}", file=sys.stderr)
        return 2
    root = sysconfig.get_paths()["stdlib"]
    lines, seen, files = [], set(), 0
    for path in stdlib_files(root):
        module = module_name(path, root)
        if any(part.startswith("_") for part in module.split(".")):
            continue  # private modules
        files += 1
        for prompt, response in pairs_in(path, module):
            if prompt not in seen:
                seen.add(prompt)
                lines.append(json.dumps({"prompt": prompt, "response": response}) + "\n")
        if len(lines) >= args.max_pairs:
            break
    lines = lines[: args.max_pairs]
    out = user_path(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_atomic(out, "".join(lines))
    print(f"wrote {len(lines):,} prompt/response pairs from {files:,} files of {root} to {out}")
    print(f"e.g. {lines[len(lines) // 2].strip()}")
    if tokenizer:
        copied = os.path.join(os.path.dirname(out), "tokenizer.json")
        with open(tokenizer, "rb") as f:
            write_atomic(copied, f.read())
        print(f"copied {tokenizer} (the tokenizer {checkpoint} learned) to {copied}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
