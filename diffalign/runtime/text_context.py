"""Prompts longer than a text encoder's context: counted, truncated by the caller as diffusers does, and reported once
per prompt.

The diffusion models' text encoders (`diffalign.models.stable_diffusion.StableDiffusionPolicy`) and every
text-conditioned reward (CLIP score, HPSv2, PickScore, ImageReward) read at most their context's tokens (77 for
CLIP, 35 for ImageReward's BLIP, 12 in the tiny world) and drop the rest. A `TruncationWarner` per encoder warns
the first time it sees each such prompt, naming the prompt, its length, the context and who truncates; inside a
training loop or an evaluation these warnings are counted and reported once per logging interval
(`diffalign.runtime.console.warn_repeated`, kind ``truncated_prompts``), with the last such prompt as the example.
"""

from __future__ import annotations

import logging

from diffalign.runtime.console import literal, warn_repeated


def token_count(tokenizer, text: str) -> int | None:
    """The number of tokens `tokenizer` makes of `text` before truncation, special tokens included; None for a
    tokenizer it does not know.

    Knows Hugging Face tokenizers (``tokenizer(text).input_ids``), open_clip's `SimpleTokenizer` (``encode`` plus the
    start and end tokens) and open_clip's `HFTokenizer` / `SigLipTokenizer` (their ``.tokenizer``).
    """
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None and callable(inner) and hasattr(tokenizer, "context_length"):  # open_clip's HFTokenizer
        return len(inner(text).input_ids)
    if hasattr(tokenizer, "encode") and hasattr(tokenizer, "context_length") and not callable(inner):
        return len(tokenizer.encode(text)) + 2  # open_clip's SimpleTokenizer: <start> ... <end>
    if callable(tokenizer) and hasattr(tokenizer, "model_max_length"):  # transformers
        return len(tokenizer(text).input_ids)
    return None


class TruncationWarner:
    """Warns once per prompt that a text encoder reads only the first `max_length` tokens of it.

    Args:
        who (`str`): the encoder, named in the message: "the text encoder" (a diffusion model), or e.g.
            "reward.clip_score's text encoder".
        logger (`logging.Logger`): where the warning goes (the caller's module logger).
        consequence (`str`): what the truncation means, appended to the message (e.g. "the rest is ignored").
        key (`str`): the kind of warning counted by `diffalign.runtime.console.warn_repeated` (e.g.
            ``"truncated_prompts/pickscore"`` for a reward's encoder).
    """

    def __init__(self, who: str, logger: logging.Logger, consequence: str = "the rest is ignored",
                 key: str = "truncated_prompts"):
        self.who, self.logger, self.consequence, self.key = who, logger, consequence, key
        self.warned: set[str] = set()

    def check(self, tokenizer, prompts, max_length: int) -> None:
        """Logs the warning for every prompt of `prompts` longer than `max_length` tokens of `tokenizer` (each prompt
        once per warner). Prompts already reported are not tokenised again."""
        for text in prompts:
            if text in self.warned:
                continue
            n = token_count(tokenizer, text)
            if n is not None and n > max_length:
                self.warned.add(text)
                said = f"{self.who} reads only the first {max_length}, {self.consequence}"
                warn_repeated(self.logger, self.key, f"{{count}} prompt(s) longer than {max_length} tokens: "
                              f"{literal(said)}; the last: {literal(repr(text))} has {n} tokens", count=1,
                              once=f"prompt {text!r} has {n} tokens; {said}")
