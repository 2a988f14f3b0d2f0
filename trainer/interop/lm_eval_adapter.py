"""Kitchen's model behind lm-evaluation-harness's `LM` interface.

Every request is scored as Kitchen's model saw its documents: `<bos>` first, then the text.
- loglikelihood(context, continuation): log p(continuation | <bos> context) and whether greedy
  decoding would produce it. The pair is tokenized whole and split where the context's tokens
  end (its trailing whitespace moved to the continuation), as the harness's HF model does.
- loglikelihood_rolling(text): log p(text | <bos>), in windows of the model's context length,
  each window conditioned on the tokens before it (the harness's rolling windows).
- generate_until(context, {until, max_gen_toks}): greedy decoding of every request as one
  batch on the inference engine (trainer/inference/offline.py), cut at the first stop string.
"""

import torch
import torch.nn.functional as F
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from trainer.data.tokenizer import Tokenizer
from trainer.inference import offline
from trainer.inference.engine import SamplingParams

DEFAULT_MAX_GEN_TOKS = 256


class KitchenLM(LM):
    def __init__(self, model: torch.nn.Module, tokenizer: Tokenizer, max_len: int, batch_size: int):
        super().__init__()
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_len = max_len
        self.batch_size = batch_size
        self._device = next(model.parameters()).device

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(<bos> + context tokens, continuation tokens), as the harness's HF model splits:
        the context's trailing whitespace moves to the continuation, the pair is tokenized
        whole and cut where the context's own tokens end."""
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tokenizer.encode(context + continuation)
        n = len(self.tokenizer.encode(context))
        return [self.tokenizer.bos_id] + whole[:n], whole[n:]

    @torch.no_grad()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(sum log p(target | prefix), target is the greedy choice) per (prefix, target),
        both cut from the left to the model's context length, in batches."""
        out: list[tuple[float, bool]] = []
        for i in range(0, len(pairs), self.batch_size):
            rows = []
            for prefix, target in pairs[i : i + self.batch_size]:
                ids = (prefix + target)[-(self.max_len + 1) :]
                rows.append((ids[:-1], min(len(target), len(ids) - 1)))
            width = max(len(ids) for ids, _ in rows)
            batch = torch.zeros(len(rows), width, dtype=torch.long)
            for r, (ids, _) in enumerate(rows):  # right padding: causal rows ignore it
                batch[r, : len(ids)] = torch.tensor(ids)
            batch = batch.to(self._device)
            positions = torch.arange(width, device=self._device).expand(len(rows), -1)
            logp = F.log_softmax(self.model(batch, positions).float(), dim=-1)
            for r, (ids, n) in enumerate(rows):
                full = (pairs[i + r][0] + pairs[i + r][1])[-(self.max_len + 1) :]
                wanted = torch.tensor(full[-n:], device=self._device)
                scores = logp[r, len(ids) - n : len(ids)]
                picked = scores.gather(-1, wanted[:, None]).sum()
                out.append((float(picked), bool((scores.argmax(-1) == wanted).all())))
        return out

    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        return self._score([self._split(*r.args) for r in requests])

    def loglikelihood_rolling(self, requests) -> list[float]:
        out = []
        for r in requests:
            tokens = self.tokenizer.encode(r.args[0])
            windows = get_rolling_token_windows(
                token_list=tokens,
                prefix_token=self.tokenizer.bos_id,
                max_seq_len=self.max_len,
                context_len=1,
            )
            pairs = [make_disjoint_window(w) for w in windows]
            out.append(sum(score for score, _ in self._score(pairs)))
        return out

    def generate_until(self, requests) -> list[str]:
        prompts, params = [], []
        for r in requests:
            context, kwargs = r.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(kwargs.get("max_gen_toks", DEFAULT_MAX_GEN_TOKS))
            keep = max(1, self.max_len - limit)  # room for the answer within the context length
            ids = ([self.tokenizer.bos_id] + self.tokenizer.encode(context))[-keep:]
            prompts.append(offline.Prompt(ids))
            stop = tuple(s for s in until if s)
            params.append(SamplingParams(max_tokens=limit, temperature=0, stop=stop))
        done = offline.generate(
            self.model, prompts, params, eos_id=self.tokenizer.eos_id, max_len=self.max_len,
            decode=self.tokenizer.decode, vocab=self.tokenizer.vocab_size,
        )  # fmt: skip
        return [c.text for c in done]
