"""Ask a served VLM about an image, with the official `openai` client (docs/vlm.md).

    ask --endpoint http://127.0.0.1:8322 --model NAME IMAGE QUESTION [--wait 300] [--api-key-file F]

sends one chat request holding the image, inline as a base64 data URL (the server fetches
nothing from the network), and the question after it; greedy (temperature 0). Prints the
answer and the token counts: the image's tokens are part of prompt_tokens.
"""

import argparse
import base64
import mimetypes

import openai

from protos.exposure import read_secret_file
from protos.paths import user_path
from trainer.serve.endpoint import wait_healthy


def data_url(image: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(image).decode()}"


def image_message(image: bytes, question: str, media: str = "image/png") -> dict:
    """A user turn of OpenAI content parts: the image, then the question."""
    parts = [
        {"type": "image_url", "image_url": {"url": data_url(image, media)}},
        {"type": "text", "text": question},
    ]
    return {"role": "user", "content": parts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ask", description=__doc__.split("\n\n")[0])
    p.add_argument("--endpoint", required=True, help="the serve job's http://HOST:PORT")
    p.add_argument("--model", required=True, help="the model name it serves")
    p.add_argument("--wait", type=float, default=0, help="seconds to wait for /health first")
    p.add_argument("--max-tokens", type=int, default=4)
    p.add_argument("--api-key-file", help="the server's API key (its serve.api_key_file)")
    p.add_argument("image", help="an image file (PNG, JPEG, ...)")
    p.add_argument("question")
    args = p.parse_args(argv)
    path = user_path(args.image)
    media = mimetypes.guess_type(path)[0] or "application/octet-stream"
    with open(path, "rb") as f:
        message = image_message(f.read(), args.question, media)
    endpoint = args.endpoint.rstrip("/")
    if args.wait:
        wait_healthy(endpoint, args.wait)
    key = (
        read_secret_file(user_path(args.api_key_file), "--api-key-file")
        if args.api_key_file
        else ""
    )
    # The client insists on a key; a server without serve.api_key_file ignores it.
    client = openai.OpenAI(base_url=endpoint + "/v1", api_key=key or "none", max_retries=0)
    try:
        answer = client.chat.completions.create(
            model=args.model, messages=[message], max_tokens=args.max_tokens, temperature=0
        )
    except openai.APIStatusError as e:  # the server's 400 names the field
        raise SystemExit(f"error: HTTP {e.status_code}: {e.body}") from None
    usage = answer.usage
    print(f"{args.question}{answer.choices[0].message.content}")
    if usage is not None:
        tokens = f"prompt tokens {usage.prompt_tokens} (the image's included)"
        print(f"{tokens}, answer tokens {usage.completion_tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
