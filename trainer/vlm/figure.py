"""A picture of what a VLM answered: held-out images beside its answers, with the image and
with a blank one.

    python -m trainer.vlm.figure RUN_DIR OUT.png

reads RUN_DIR/vlm_eval.json (written by a VLM stage or an EVAL job) and the images of its
dataset's eval split, and writes a small PNG (each image scaled up 4x, nearest neighbour).
"""

import argparse
import io
import json
import os
import sys
from pathlib import Path

from PIL import Image, ImageDraw

from protos.files import write_atomic
from protos.paths import user_path
from trainer.data.image_loader import ImageSplit
from trainer.vlm.evaluate import REPORT

SCALE, TEXT_W, ROW_PAD = 4, 300, 6


def draw(report: dict) -> Image.Image:
    held = ImageSplit(report["dataset"], "eval")
    shown = report["examples"]
    side = held.manifest.image_size * SCALE
    row_h = side + ROW_PAD
    out = Image.new("RGB", (side + TEXT_W, row_h * len(shown)), (255, 255, 255))
    pen = ImageDraw.Draw(out)
    for i, ex in enumerate(shown):
        image = Image.fromarray(held.images[ex["image"]]).resize(
            (side, side), Image.Resampling.NEAREST
        )
        out.paste(image, (0, i * row_h))
        ok = "right" if ex["model"] == ex["answer"] else "WRONG"
        lines = [
            ex["question"].replace("question: ", "").replace(" answer:", ""),
            f"model:{ex['model']}  ({ok})",
            f"blank image:{ex['blank']}",
            f"reference:{ex['answer']}",
        ]
        for k, text in enumerate(lines):
            pen.text((side + 8, i * row_h + 4 + 14 * k), text, fill=(0, 0, 0))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir")
    p.add_argument("out")
    args = p.parse_args(argv)
    report_path = Path(user_path(args.run_dir)) / REPORT
    try:
        report = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"error: {report_path}: cannot read the VLM eval report: {e}", file=sys.stderr)
        return 2
    buf = io.BytesIO()
    draw(report).save(buf, format="PNG")
    out = user_path(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    write_atomic(out, buf.getvalue())
    print(f"wrote {len(report['examples'])} answered images to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
