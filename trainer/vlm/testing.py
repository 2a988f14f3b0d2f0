"""The tests' tiny VLM job: 16 x 16 synthetic scenes (4 image tokens each), a 2-layer language
model, a 1-layer encoder; YAML-shaped, for trainer/testing.py's write_job."""

from pathlib import Path

from trainer.vlm import scenes

SCENE_SIZE = 16
VOCAB = 384


def write_scenes(root: Path, count: int = 300) -> Path:
    """`count` scenes (seed 0) under root/scenes; the directory."""
    scenes.write_scenes(str(root / "scenes"), count, seed=0, size=SCENE_SIZE, vocab_size=VOCAB)
    return root / "scenes"


def vlm_job(root: Path, kind: str = "VLM", steps: int = 120, **trainer) -> dict:
    """A job on root/scenes (write_scenes) with its cache in root/cache; `trainer` updates its
    sections, e.g. train={"grad_accum": 2}."""
    sections: dict[str, dict[str, object]] = {
        "data": {
            "input": str(root / "scenes" / "scenes.jsonl"),
            "format": "JSONL_IMAGE",
            "tokenizer": "BPE_FILE",
            "tokenizer_path": str(root / "scenes" / "tokenizer.json"),
            "seq_len": 24,
            "eval_fraction": 0.2,
            "cache_dir": str(root / "cache"),
        },
        "model": {"dim": 128, "n_layers": 2, "n_heads": 4},
        "vision": {
            "image_size": SCENE_SIZE,
            "patch_size": 4,
            "pixel_shuffle": 2,
            "dim": 64,
            "n_layers": 1,
            "stage": "FINETUNE",
        },
        "optim": {"lr": 1e-3, "warmup_steps": 10},
        "train": {"steps": steps, "micro_batch": 32, "log_every": 40},
        "checkpoint": {"every_steps": 0},
    }
    for name, fields in trainer.items():
        sections.setdefault(name, {}).update(fields)
    return {"name": "vlm", "kind": kind, "trainer": sections}
