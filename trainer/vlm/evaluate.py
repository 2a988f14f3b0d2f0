"""Does the model use the image? Answer accuracy per question type on held-out images, beside
chance and beside the same model shown a blank image.

Each held-out question is answered greedily (at most as many tokens as the longest answer of
its type, stopping at <eos>) and counted right when the decoded answer equals the reference.
Chance is a uniform guess among the answers of that type seen in training. The blank-image
baseline asks the same questions with every image replaced by one flat color (the mean of the
training images): what the language model can answer from the question alone, its priors. A
model that reads the image beats it; one that only learned the answer distribution does not.
"""

import numpy as np
import torch

from trainer.data.image_loader import ImageSplit
from trainer.data.tokenizer import load_tokenizer
from trainer.inference import offline
from trainer.inference.engine import FinishReason, SamplingParams

REPORT = "vlm_eval.json"
BATCH = 64


def answer(
    model, images: torch.Tensor, prompts: torch.Tensor, max_new: int, eos_id: int
) -> list[list[int]]:
    """Greedy answers (token ids, <eos> excluded) to prompts, one per image, decoded together
    on the inference engine (trainer/inference/offline.py)."""
    asked = [offline.Prompt(p, image) for p, image in zip(prompts.tolist(), images, strict=True)]
    done = offline.generate(
        model.lm, asked, SamplingParams(max_tokens=max_new, temperature=0), eos_id=eos_id,
        embed_images=model.embed_images, image_tokens=model.image_tokens,
    )  # fmt: skip
    return [c.token_ids[:-1] if c.finish is FinishReason.STOP else c.token_ids for c in done]


def _questions(split: ImageSplit, eos_id: int):
    """(row, prompt ids, answer ids) of every row that has a question type and whose answer
    fits in the row whole (a truncated answer has no <eos>: no reference to compare with)."""
    for r in np.flatnonzero(split.rows[:, 2] >= 0):
        targets = np.flatnonzero(split.targets[r])
        n = int(split.rows[r, 1])
        if len(targets) == 0 or split.tokens[r, n - 1] != eos_id:
            continue
        first = int(targets[0])
        if first <= 1:  # a caption: no question before it
            continue
        yield int(r), split.tokens[r, :first].tolist(), split.tokens[r, first : n - 1].tolist()


def evaluate(model, dataset: str, device, examples_per_type: int = 2) -> dict:
    """Accuracy per question type (with chance and the blank-image baseline) as a dict."""
    model.eval()
    tok = load_tokenizer(dataset)
    train, held = ImageSplit(dataset, "train"), ImageSplit(dataset, "eval")
    types = held.manifest.question_types
    answers: dict[int, set] = {q: set() for q in range(len(types))}
    for r, _, ans in _questions(train, tok.eos_id):
        answers[int(train.rows[r, 2])].add(tuple(ans))
    mean = (
        np.asarray(train.images, dtype=np.float64).mean(axis=(0, 1, 2)) if len(train.images) else 0
    )
    blank_pixel = torch.tensor(np.round(mean), dtype=torch.uint8)
    groups: dict[tuple[int, int], list] = {}
    for r, prompt, ans in _questions(held, tok.eos_id):
        groups.setdefault((int(held.rows[r, 2]), len(prompt)), []).append((r, prompt, ans))
    right = {q: [0, 0, 0] for q in range(len(types))}  # image right, blank right, asked
    shown: list[dict] = []
    for (q, _), items in sorted(groups.items()):
        longest = max((len(a) for a in answers[q]), default=4) + 1
        for i in range(0, len(items), BATCH):
            chunk = items[i : i + BATCH]
            rows = np.array([c[0] for c in chunk])
            images = torch.from_numpy(np.ascontiguousarray(held.images[held.rows[rows, 0]])).to(
                device
            )
            prompts = torch.tensor([c[1] for c in chunk], device=device)
            blank = blank_pixel.to(device).expand_as(images).contiguous()
            seen = answer(model, images, prompts, longest, tok.eos_id)
            guessed = answer(model, blank, prompts, longest, tok.eos_id)
            for (r, prompt, ans), a, b in zip(chunk, seen, guessed, strict=True):
                right[q][0] += a == ans
                right[q][1] += b == ans
                right[q][2] += 1
                # a few of each type, each on an image not shown yet
                image = int(held.rows[r, 0])
                of_type = sum(s["type"] == types[q] for s in shown)
                fresh = all(s["image"] != image for s in shown)
                if fresh and of_type < examples_per_type:
                    shown.append(
                        {
                            "image": image,
                            "type": types[q],
                            "question": tok.decode(prompt),
                            "answer": tok.decode(ans),
                            "model": tok.decode(a),
                            "blank": tok.decode(b),
                        }
                    )
    model.train()
    per_type = {
        types[q]: {
            "questions": n,
            "accuracy": ok / n,
            "blank_image_accuracy": blank_ok / n,
            "chance": 1 / max(len(answers[q]), 1),
        }
        for q, (ok, blank_ok, n) in right.items()
        if n
    }
    return {"dataset": dataset, "per_type": per_type, "examples": shown}


def describe(report: dict) -> str:
    lines = ["held-out answer accuracy (image / blank image / chance):"]
    for name, r in report["per_type"].items():
        lines.append(
            f"  {name:<9} {r['accuracy']:6.1%} / {r['blank_image_accuracy']:6.1%} / "
            f"{r['chance']:5.1%}  ({r['questions']} questions)"
        )
    return "\n".join(lines)
