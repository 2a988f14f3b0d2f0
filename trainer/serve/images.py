"""Images in a chat request, for a served VLM (trainer/jobs/serve.py).

A message's `content` is a string, or OpenAI's list of content parts: `{"type": "text",
"text": ...}` and `{"type": "image_url", "image_url": {"url": "data:image/png;base64,..."}}`.
The server reaches no network: an image comes inline, as a base64 data URL. It is decoded by
precook's own `load_image` (RGB, shorter side resized, center-cropped), so the served model
sees an image's pixels exactly as training saw them. The model was trained on rows laid out
`[image tokens] <bos> text`, so a request holds at most MAX_IMAGES images, and the image's
tokens go in front of the text (whichever part came first), at positions that take KV-cache
blocks like any token's. Every problem is an ImageInputError naming the field, e.g.
`messages[0].content[1].image_url.url`, which the API answers with HTTP 400.
"""

import base64
import binascii
import io
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from trainer.data.images import load_image

MAX_IMAGES = 1  # the VLM trained with one image in front of the text
MAX_IMAGE_BYTES = 20 * 2**20  # of one decoded image file (OpenAI's limit, 20 MB)


class ImageInputError(ValueError):
    def __init__(self, param: str, problem: str):
        super().__init__(f"{param}: {problem}")
        self.param = param


@dataclass(frozen=True)
class PromptImages:
    """How the served model reads an image: its side in pixels, the positions it takes, and
    the encoder, (B, size, size, 3) uint8 -> (B, tokens, model dim) (VisionLanguageModel's
    embed_images: the one the `generate` job uses)."""

    size: int
    tokens: int
    embed: Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ImagePart:
    param: str  # where it is in the request, for errors
    url: str


def content_parts(content: str | list[dict[str, Any]], param: str) -> tuple[str, list[ImagePart]]:
    """(the text of `content`, its image parts in order)."""
    if isinstance(content, str):
        return content, []
    texts, images = [], []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type")
        if kind == "text":
            text = part.get("text")
            if not isinstance(text, str):
                raise ImageInputError(f"{where}.text", "a text part needs `text`, a string")
            texts.append(text)
        elif kind == "image_url":
            image_url = part.get("image_url")
            url = image_url.get("url") if isinstance(image_url, dict) else None
            if not isinstance(url, str):
                raise ImageInputError(
                    f"{where}.image_url.url", "an image_url part needs `image_url: {url: ...}`"
                )
            images.append(ImagePart(f"{where}.image_url.url", url))
        else:
            raise ImageInputError(f"{where}.type", f"{kind!r}: expected 'text' or 'image_url'")
    return "".join(texts), images


def decode_image(part: ImagePart, size: int) -> np.ndarray:
    """The (size, size, 3) uint8 pixels of a `data:image/...;base64,` URL."""
    scheme = part.url.split(":", 1)[0].lower() if ":" in part.url else ""
    if scheme in ("http", "https"):
        raise ImageInputError(
            part.param,
            "this server fetches nothing from the network: send the image inline, as a "
            "data:image/png;base64,... URL",
        )
    header, comma, payload = part.url.partition(",")
    if scheme != "data" or not comma or not header.endswith(";base64"):
        raise ImageInputError(part.param, "expected a data:image/...;base64,... URL")
    media = header[len("data:") : -len(";base64")]
    if not media.startswith("image/"):
        raise ImageInputError(part.param, f"a data URL of {media or 'no type'!r}, not an image")
    try:
        raw = base64.b64decode(payload, validate=True)
    except binascii.Error as e:
        raise ImageInputError(part.param, f"not valid base64 ({e})") from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise ImageInputError(part.param, f"{len(raw):,} bytes; at most {MAX_IMAGE_BYTES:,}")
    try:
        return load_image(io.BytesIO(raw), size)
    except Exception as e:  # PIL raises many kinds (UnidentifiedImageError, OSError, ...)
        raise ImageInputError(
            part.param, f"not a readable image ({type(e).__name__}: {e})"
        ) from None


def request_image(images: list[ImagePart], reads: PromptImages | None) -> np.ndarray | None:
    """The one image of a request (None: none), checked against what the model reads."""
    if not images:
        return None
    if reads is None:
        raise ImageInputError(images[0].param, "this model is a text model: it reads no images")
    if len(images) > MAX_IMAGES:
        raise ImageInputError(
            images[MAX_IMAGES].param,
            f"{len(images)} images; this model reads at most {MAX_IMAGES} per request",
        )
    return decode_image(images[0], reads.size)
