"""A word-level tokenizer over the shapes world's vocabulary, built in-process (no hub files).

It is a `transformers.PreTrainedTokenizerFast` around a `tokenizers` WordLevel model with a whitespace pre-tokenizer and
a ``[BOS] $A [EOS]`` post-processor, so `StableDiffusionPipeline` uses it unchanged (padding to ``model_max_length``,
truncation, the empty negative prompt for classifier-free guidance).
"""

from __future__ import annotations

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from diffalign.world.render import COLORS, COUNT_WORDS, RELATIONS, SHAPES, plural

SPECIAL_TOKENS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
MODEL_MAX_LENGTH = 12


def vocabulary() -> list[str]:
    """Every token of the world, specials first: 4 specials + 19 words = 23 tokens."""
    words = ["a", "and"] + list(COUNT_WORDS.values()) + list(COLORS)
    words += [w for s in SHAPES for w in (s, plural(s))]
    for rel in RELATIONS:
        words += [w for w in rel.split() if w not in words]
    return SPECIAL_TOKENS + list(dict.fromkeys(words))


VIDEO_WORDS = ["moving", "staying", "still", "up", "down"]  # "left", "right" are already words of the image world
VIDEO_MODEL_MAX_LENGTH = 16  # "a red circle moving left and a green triangle staying still" is 11 words + BOS/EOS


def build_tokenizer(video: bool = False) -> PreTrainedTokenizerFast:
    """Builds the world's tokenizer: ``model_max_length`` 12, pad ``[PAD]`` (id 0), BOS id 1, EOS id 2, UNK id 3.
    ``video=True`` appends `VIDEO_WORDS` (the image ids are unchanged) and allows 16 tokens, for the video captions of
    `diffalign.world.video`."""
    words = vocabulary() + (VIDEO_WORDS if video else [])
    vocab = {tok: i for i, tok in enumerate(words)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(
        single="[BOS] $A [EOS]", special_tokens=[("[BOS]", vocab["[BOS]"]), ("[EOS]", vocab["[EOS]"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        model_max_length=VIDEO_MODEL_MAX_LENGTH if video else MODEL_MAX_LENGTH,
        pad_token="[PAD]",
        bos_token="[BOS]",
        eos_token="[EOS]",
        unk_token="[UNK]",
    )
