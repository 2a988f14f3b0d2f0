"""A Kitchen tokenizer as Hugging Face files: tokenizer.json + tokenizer_config.json that
`PreTrainedTokenizerFast` (AutoTokenizer) loads with no custom code.

Kitchen lays out every document as `<bos> text <eos>` itself (precook) and never lets
`encode` add specials. The exported tokenizer.json gets a post-processor that prepends BOS, so
`tokenizer(text).input_ids` in transformers is what Kitchen's model saw at the start of a
document: `[bos] + encode(text)`; tokenizer_config.json says so (`add_bos_token`), which is
what lm-eval's `hf` backend and serving engines read. (lm-eval 0.4.13 also prepends its own
prefix token to a perplexity request's text: docs/eval.md gives the model argument that makes
its perplexities Kitchen's.) An SFT checkpoint also gets a chat template that renders
Kitchen's SFT layout, `<bos> prompt response <eos>` (no role markers: precook adds none).
"""

import json

from trainer.data.tokenizer import HF_FILE, Tokenizer
from trainer.interop.llama_format import HfFormatError, SpecialTokens

CONFIG_FILE = "tokenizer_config.json"
# Kitchen's SFT layout as a Jinja chat template: the prompt, then the response closed by EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)


def special_tokens(tok: Tokenizer) -> SpecialTokens:
    return SpecialTokens(tok.bos_id, tok.eos_id, tok.pad_id)


def hf_tokenizer_files(tok: Tokenizer, max_len: int, chat: bool) -> dict[str, bytes]:
    """{file name: bytes} of the exported tokenizer; HfFormatError for a vocabulary that has
    no tokenizer.json (cl100k comes from tiktoken)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    if tok.kind != "bpe":
        raise HfFormatError(
            "trainer.data.tokenizer",
            f"{tok.kind} has no tokenizer.json to export; export supports the byte-level BPE "
            "tokenizers (BPE_TRAIN, BPE_FILE)",
        )
    backend = HFTokenizer.from_file(tok.file_path)  # a fresh copy: the caller's stays as it is
    bos = backend.id_to_token(tok.bos_id)
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1", special_tokens=[(bos, tok.bos_id)]
    )
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": backend.id_to_token(tok.eos_id),
        "pad_token": backend.id_to_token(tok.pad_id),
        "model_max_length": max_len,
        # Said as well as done (the post-processor): transformers rebuilds the post-processor
        # from this flag, so `add_bos_token=False` (lm-eval's model argument) turns it off.
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
    }
    if chat:
        config["chat_template"] = CHAT_TEMPLATE
    return {
        HF_FILE: backend.to_str(pretty=True).encode("utf-8"),
        CONFIG_FILE: (json.dumps(config, indent=1, sort_keys=True) + "\n").encode("utf-8"),
    }
