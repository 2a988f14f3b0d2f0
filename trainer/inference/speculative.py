"""Speculative decoding's draft: prompt lookup (n-grams), which needs no second model.

A greedy request's next tokens often repeat its context (code, quotes, lists, a summary of the
prompt): the draft is the k tokens that followed the most recent earlier occurrence of the
sequence's last n tokens (the longest n <= 3 that occurs; vLLM's ngram proposer, Saxena's
prompt lookup decoding). The engine runs the last token and the draft through the model in one
step and keeps the draft's tokens up to the first that differs from the model's own greedy
choice, plus that choice: the output is plain greedy decoding's, the model's logits at the
same positions deciding every token (engine.py), in fewer steps when drafts are accepted.
Sampled requests do not speculate (their draws would consume their generator differently).
"""

MAX_NGRAM = 3


def ngram_draft(tokens: list[int], k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens."""
    end = len(tokens)
    for n in range(min(MAX_NGRAM, end - 1), 0, -1):
        suffix = tokens[end - n :]
        for start in range(end - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k]
    return []
