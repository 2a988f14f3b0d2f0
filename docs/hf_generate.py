"""Load an exported Kitchen model with Hugging Face transformers alone, and answer a prompt
greedily (docs/interop.md): what any transformers user runs, no Kitchen code involved.

    ./bazel run //docs:hf_generate -- hf/guide-sft "What does os.path.join() do?\n"

A tokenizer with a chat template (an exported SFT model) renders the prompt as a user turn;
otherwise the prompt is plain text after BOS.
"""

import argparse

from protos.paths import user_path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model_dir", help="a Hugging Face model directory (config.json, ...)")
    p.add_argument("prompt", help=r"the user's turn; \n is a newline, as in a YAML string")
    p.add_argument("--max-new-tokens", type=int, default=40)
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = user_path(args.model_dir)
    prompt = args.prompt.replace("\\n", "\n")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    if tokenizer.chat_template:
        chat = [{"role": "user", "content": prompt}]
        ids = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    else:
        ids = tokenizer(prompt).input_ids
    n = sum(t.numel() for t in model.parameters())
    print(f"{type(model).__name__}, {n:,} parameters, {type(tokenizer).__name__}")
    print(f"prompt tokens: {list(ids)}")
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=False
        )
    print(tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
