"""Synthetic scenes: shapes of one color and kind on a 2x2 grid, with text read off the scene.

    python -m trainer.vlm.scenes OUT_DIR --scenes 2000 [--seed 0] [--size 32]

writes OUT_DIR/images/NNNNNN.png and OUT_DIR/scenes.jsonl, a JSONL_IMAGE file (one record per
line: an image path relative to the file, and a caption or a question and its answer) that
precook reads exactly as it reads real images on disk; OUT_DIR/text.jsonl, the same text without
the images (a JSONL corpus to pretrain the language model on: the normal path starts a VLM from
a text checkpoint); and OUT_DIR/tokenizer.json, a byte-level BPE trained on that text, which
both precooks use (`tokenizer: bpe_file`) so the text model's token ids carry over. Everything
comes from the seed: the same seed and size give byte-identical files.

A scene holds 1-4 copies of one shape in one color, each in its own cell of a 2x2 grid, jittered
within the cell. Every scene gives a caption ("two red circles.") and one question of each type:
color, shape, count, and position (only for a single shape: which corner it is in).
"""

import argparse
import enum
import io
import json
import os
import random
import sys
from dataclasses import dataclass

from PIL import Image, ImageDraw

from protos.files import fsync_dir, write_atomic, write_bytes
from protos.paths import user_path

COLORS = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (230, 200, 30),
    "purple": (150, 60, 190),
}
SHAPES = ("circle", "square", "triangle")
COUNTS = ("one", "two", "three", "four")
CELLS = ("top left", "top right", "bottom left", "bottom right")
BACKGROUND = (245, 245, 245)


class QuestionType(enum.Enum):
    COLOR = "color"
    SHAPE = "shape"
    COUNT = "count"
    POSITION = "position"


QUESTIONS = {
    QuestionType.COLOR: "what color are the shapes?",
    QuestionType.SHAPE: "what shape are they?",
    QuestionType.COUNT: "how many shapes are there?",
    QuestionType.POSITION: "where is the shape?",
}


@dataclass(frozen=True)
class Scene:
    color: str
    shape: str
    cells: tuple[int, ...]  # indices into CELLS, one per shape
    jitter: tuple[tuple[int, int, int], ...]  # (dx, dy, size shrink) per shape, in pixels

    def answer(self, question: QuestionType) -> str | None:
        """The answer to `question` about this scene (None: not asked of it)."""
        if question is QuestionType.COLOR:
            return self.color
        if question is QuestionType.SHAPE:
            return self.shape
        if question is QuestionType.COUNT:
            return COUNTS[len(self.cells) - 1]
        return CELLS[self.cells[0]] if len(self.cells) == 1 else None

    def caption(self) -> str:
        n = len(self.cells)
        noun = self.shape if n == 1 else f"{self.shape}s"
        where = (
            "at the " + " and ".join(CELLS[c] for c in self.cells) if n < 4 else "in every corner"
        )
        return f"{COUNTS[n - 1]} {self.color} {noun} {where}."


def _slack(size: int) -> int:
    """How far (pixels) a shape may move off its cell's center, and shrink."""
    return max(size // 32, 1)


def random_scene(rng: random.Random, size: int) -> Scene:
    n = rng.randint(1, 4)
    cells = tuple(sorted(rng.sample(range(4), n)))
    slack = _slack(size)
    jitter = tuple(
        (rng.randint(-slack, slack), rng.randint(-slack, slack), rng.randint(0, slack))
        for _ in cells
    )
    return Scene(rng.choice(tuple(COLORS)), rng.choice(SHAPES), cells, jitter)


def render(scene: Scene | None, size: int) -> Image.Image:
    """The scene as an RGB image of size x size; None gives the blank background."""
    image = Image.new("RGB", (size, size), BACKGROUND)
    if scene is None:
        return image
    draw = ImageDraw.Draw(image)
    half, slack = size // 2, _slack(size)
    for cell, (dx, dy, shrink) in zip(scene.cells, scene.jitter, strict=True):
        cx = (cell % 2) * half + half // 2 + dx
        cy = (cell // 2) * half + half // 2 + dy
        r = max(half // 2 - 1 - slack - shrink, 2)  # jittered, it stays inside its cell
        box = (cx - r, cy - r, cx + r, cy + r)
        fill = COLORS[scene.color]
        if scene.shape == "circle":
            draw.ellipse(box, fill=fill)
        elif scene.shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    return image


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", optimize=False)
    return buf.getvalue()


def records(scene: Scene, image_path: str) -> list[dict[str, str]]:
    """The JSONL_IMAGE records of one scene: its caption and every question asked of it."""
    out = [{"image": image_path, "text": scene.caption(), "type": "caption"}]
    for question in QuestionType:
        answer = scene.answer(question)
        if answer is not None:
            out.append(
                {
                    "image": image_path,
                    "prompt": f"question: {QUESTIONS[question]} answer:",
                    "response": f" {answer}",
                    "type": question.value,
                }
            )
    return out


def _jsonl(rows: list[dict[str, str]]) -> bytes:
    return "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows).encode()


def write_scenes(out_dir: str, scenes: int, seed: int, size: int, vocab_size: int) -> str:
    """Render `scenes` scenes from `seed` under out_dir; returns the JSONL file's path."""
    from trainer.data.tokenizer import train_bpe

    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    rows: list[dict[str, str]] = []
    for i in range(scenes):
        scene = random_scene(rng, size)
        rel = f"images/{i:06d}.png"
        write_bytes(os.path.join(out_dir, rel), png_bytes(render(scene, size)))
        rows += records(scene, rel)
    fsync_dir(os.path.join(out_dir, "images"))
    texts = [r.get("prompt", "") + r.get("response", "") + r.get("text", "") for r in rows]
    write_atomic(os.path.join(out_dir, "text.jsonl"), _jsonl([{"text": t} for t in texts]))
    train_bpe(texts, vocab_size).save(out_dir)
    path = os.path.join(out_dir, "scenes.jsonl")
    write_atomic(path, _jsonl(rows))
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--scenes", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--size", type=int, default=32, help="pixels (square)")
    p.add_argument("--vocab-size", type=int, default=384, help="of tokenizer.json")
    args = p.parse_args(argv)
    if args.scenes < 1 or args.size < 8:
        p.error("--scenes must be at least 1 and --size at least 8")
    out = user_path(args.out_dir)
    path = write_scenes(out, args.scenes, args.seed, args.size, args.vocab_size)
    print(
        f"wrote {args.scenes} scenes ({args.size}x{args.size}) and their records to {path}; "
        f"their text to text.jsonl, its tokenizer to tokenizer.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
