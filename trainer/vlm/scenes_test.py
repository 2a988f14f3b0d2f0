"""The scene generator: deterministic from its seed, and its text is true of its pixels."""

import json
import random

import numpy as np

from trainer.vlm import scenes


def test_same_seed_same_files_other_seed_other_files(tmp_path):
    a, b, c = (tmp_path / n for n in "abc")
    scenes.write_scenes(str(a), 12, seed=3, size=32, vocab_size=300)
    scenes.write_scenes(str(b), 12, seed=3, size=32, vocab_size=300)
    scenes.write_scenes(str(c), 12, seed=4, size=32, vocab_size=300)
    for name in ("scenes.jsonl", "text.jsonl", "tokenizer.json", "images/000011.png"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "scenes.jsonl").read_bytes() != (c / "scenes.jsonl").read_bytes()


def test_answers_come_from_the_pixels():
    rng = random.Random(0)
    for _ in range(200):
        scene = scenes.random_scene(rng, 32)
        pixels = np.asarray(scenes.render(scene, 32)).astype(int)
        color = np.array(scenes.COLORS[scene.color])
        painted = np.abs(pixels - color).sum(-1) == 0
        assert painted.sum() > 0
        # every painted pixel is in a cell the scene names, and each named cell has paint
        half = 16
        for cell in range(4):
            ys, xs = (cell // 2) * half, (cell % 2) * half
            has = painted[ys : ys + half, xs : xs + half].any()
            assert has == (cell in scene.cells), (scene, cell)
        assert scene.answer(scenes.QuestionType.COUNT) == scenes.COUNTS[len(scene.cells) - 1]


def test_blank_is_background_only_and_records_cover_every_question(tmp_path):
    blank = np.asarray(scenes.render(None, 32))
    assert (blank == np.array(scenes.BACKGROUND)).all()
    path = scenes.write_scenes(str(tmp_path), 40, seed=0, size=32, vocab_size=300)
    rows = [json.loads(line) for line in open(path)]
    types = {r["type"] for r in rows}
    assert types == {"caption"} | {q.value for q in scenes.QuestionType}
    for r in rows:
        if r["type"] == "position":  # asked only of a single shape
            caption = next(c for c in rows if c["image"] == r["image"] and c["type"] == "caption")
            assert caption["text"].startswith("one ") and r["response"].strip() in caption["text"]
