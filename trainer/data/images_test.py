"""Image+text precook: splits by image, the content-addressed cache, bad images skipped and
listed (or failing the job), bad lines named by file and line, IMAGE_DIR, exact resume."""

import json

import numpy as np
import pytest
from PIL import Image

from protos import job_pb2, trainer_config_pb2
from protos.validation import resolve_trainer
from trainer.data.errors import CorpusError
from trainer.data.image_loader import ImageRowLoader
from trainer.data.images import precook_images
from trainer.vlm import scenes


def config(input_path, fmt="JSONL_IMAGE", **vision) -> trainer_config_pb2.TrainerConfig:
    cfg = trainer_config_pb2.TrainerConfig()
    cfg.data.input = str(input_path)
    cfg.data.format = getattr(trainer_config_pb2, fmt)
    cfg.data.vocab_size = 300
    cfg.data.seq_len = 64
    cfg.data.eval_fraction = 0.25
    cfg.vision.image_size = 16
    for k, v in vision.items():
        setattr(cfg.vision, k, v)
    return resolve_trainer(cfg, job_pb2.VLM)


@pytest.fixture
def scene_dir(tmp_path):
    scenes.write_scenes(str(tmp_path / "s"), 20, seed=1, size=16, vocab_size=300)
    return tmp_path / "s"


def test_precook_keeps_an_images_records_together_and_hits_the_cache(scene_dir, tmp_path):
    cfg = config(scene_dir / "scenes.jsonl")
    first = precook_images(cfg, str(tmp_path / "cache"), show_progress=False)
    m = first.manifest
    assert not first.cache_hit
    assert m.splits["train"].images == 15 and m.splits["eval"].images == 5
    assert m.splits["train"].truncated_tokens == 0
    assert set(m.question_types) == {"caption", "color", "shape", "count", "position"}
    images = np.fromfile(f"{first.path}/eval/images.bin", dtype=np.uint8).reshape(-1, 16, 16, 3)
    png = np.asarray(Image.open(scene_dir / "images" / "000003.png"))  # record 3: held out
    assert any((im == png).all() for im in images)
    again = precook_images(cfg, str(tmp_path / "cache"), show_progress=False)
    assert again.cache_hit and again.path == first.path
    # one changed pixel of one image is a new dataset
    im = Image.open(scene_dir / "images" / "000007.png")
    im.putpixel((0, 0), (1, 2, 3))
    im.save(scene_dir / "images" / "000007.png")
    changed = precook_images(cfg, str(tmp_path / "cache"), show_progress=False)
    assert not changed.cache_hit and changed.path != first.path


def test_unreadable_images_are_skipped_and_listed_or_fail_the_job(scene_dir, tmp_path):
    (scene_dir / "images" / "000002.png").write_bytes(b"not a png")
    (scene_dir / "images" / "000005.png").unlink()
    ds = precook_images(
        config(scene_dir / "scenes.jsonl"), str(tmp_path / "c1"), show_progress=False
    )
    skipped = ds.manifest.skipped_images
    assert len(skipped) == 2
    assert "000002.png" in skipped[0] and "scenes.jsonl:" in skipped[0]
    assert "000005.png" in skipped[1]
    counts = ds.manifest.splits
    assert counts["train"].images + counts["eval"].images == 18
    strict = config(scene_dir / "scenes.jsonl", bad_images=trainer_config_pb2.FAIL_ON_BAD)
    with pytest.raises(CorpusError, match=r"scenes.jsonl:\d+: .*000002.png: not a readable image"):
        precook_images(strict, str(tmp_path / "c2"), show_progress=False)


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("{not json", "invalid JSON"),
        ('["a list"]', "expected a JSON object"),
        ('{"text": "no image"}', "no field 'image'"),
        ('{"image": "images/000000.png", "text": 3}', "field 'text' is a int"),
    ],
)
def test_a_malformed_line_is_an_error_naming_file_and_line(scene_dir, tmp_path, line, problem):
    path = scene_dir / "scenes.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(4, line)
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(CorpusError, match=rf"scenes.jsonl:5: .*{problem}"):
        precook_images(config(path), str(tmp_path / "cache"), show_progress=False)


def test_image_dir_reads_images_with_captions_beside_them(tmp_path):
    d = tmp_path / "photos"
    d.mkdir()
    for i, color in enumerate([(255, 0, 0), (0, 0, 255), (0, 255, 0), (9, 9, 9)]):
        Image.new("RGB", (40, 24), color).save(d / f"p{i}.png")  # not square: resized, cropped
        (d / f"p{i}.txt").write_text(f"a photo number {i}\n")
    ds = precook_images(config(d, "IMAGE_DIR"), str(tmp_path / "cache"), show_progress=False)
    assert ds.manifest.splits["train"].records + ds.manifest.splits["eval"].records == 4
    loader = ImageRowLoader(ds.path, "train", batch_size=2)
    b = next(loader)
    assert b["images"].shape == (2, 16, 16, 3)
    (d / "p9.png").write_bytes((d / "p0.png").read_bytes())
    with pytest.raises(CorpusError, match=r"p9.png: no caption beside it"):
        precook_images(config(d, "IMAGE_DIR"), str(tmp_path / "cache"), show_progress=False)


def test_loader_labels_only_targets_and_resumes_exactly(scene_dir, tmp_path):
    ds = precook_images(
        config(scene_dir / "scenes.jsonl"), str(tmp_path / "cache"), show_progress=False
    )
    records = [json.loads(s) for s in (scene_dir / "scenes.jsonl").read_text().splitlines()]
    assert ds.manifest.splits["train"].records + ds.manifest.splits["eval"].records == len(records)
    loader = ImageRowLoader(ds.path, "train", batch_size=5, seed=7)
    for _ in range(9):  # into the second epoch
        next(loader)
    saved = loader.state_dict()
    expected = [next(loader) for _ in range(4)]
    resumed = ImageRowLoader(ds.path, "train", batch_size=5, seed=7)
    resumed.load_state_dict(saved)
    for want in expected:
        got = next(resumed)
        for key in want:
            assert np.array_equal(got[key].numpy(), want[key].numpy()), key
    b = expected[0]
    labelled = b["labels"] != -100
    # a label is the next token, and only answers (or whole captions) are labelled
    assert (b["labels"][:, :-1][labelled[:, :-1]] == b["input_ids"][:, 1:][labelled[:, :-1]]).all()
    question = b["qtype"] >= 0
    assert labelled.sum(1).min() >= 1 and question.any()


def test_text_precook_refuses_image_formats_naming_the_field():
    from protos.config_yaml import ConfigError
    from protos.validation import resolve_data

    data = trainer_config_pb2.DataConfig(format=trainer_config_pb2.JSONL_IMAGE, input="x.jsonl")
    with pytest.raises(ConfigError, match=r"data.format: JSONL_IMAGE holds images"):
        resolve_data(data)
