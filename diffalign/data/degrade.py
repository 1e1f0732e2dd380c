"""Semantically degraded prompts c⁻ for DDSPO (Kim et al., [arXiv:2512.23426](https://arxiv.org/abs/2512.23426)).

DDSPO's losing policy is the frozen model conditioned on a degraded prompt (docs/methods/algorithms.md#ddspo-data, step
2). Three degradations, each deterministic in ``(prompt, seed)`` and each returning up to ``num_variants`` distinct
prompts that are neither empty nor the original:

- ``random_removal`` (`random_word_removal`): drop 40–70 % of the whitespace-separated words, the paper's degradation
  for text–image alignment (authors' ``data_prep/random_removal.py``: up to 5 variants per prompt).
- ``attributes`` (`attribute_degradation`): one targeted edit per variant that removes or swaps a colour, count, shape
  or relation word, with the tiny world's vocabulary (`diffalign.world.render`) plus general English words, for the
  tiny world and GenEval/T2I-CompBench-style compositional prompts. A diffalign rule set, not from the paper.
- ``external`` (`PromptRewriter`): any callable, e.g. an LLM (the paper rewrites with LLaMA-3-8B-Instruct for the
  aesthetic setting). Off by default; diffalign ships none and never contacts a network for it.

`degrade_prompt` dispatches on the name.
"""

from __future__ import annotations

import hashlib
import importlib
import math
import re
from collections.abc import Callable
from fractions import Fraction
from typing import Protocol, runtime_checkable

import numpy as np

from diffalign.world.render import COLORS, COUNT_WORDS, RELATIONS, SHAPES

DEGRADATIONS = ("random_removal", "attributes", "external")

# General English vocabulary on top of the tiny world's (render.COLORS / COUNT_WORDS / SHAPES / RELATIONS).
COLOR_WORDS = tuple(dict.fromkeys([*COLORS, "black", "white", "orange", "purple", "pink", "brown", "gray", "grey",
                                   "cyan", "magenta", "violet", "gold", "silver"]))
NUMBER_WORDS = tuple(dict.fromkeys(["one", *COUNT_WORDS.values(), "four", "five", "six", "seven", "eight", "nine",
                                    "ten"]))
SHAPE_WORDS = tuple(dict.fromkeys([*SHAPES, "rectangle", "star", "heart", "hexagon", "pentagon", "diamond", "oval",
                                   "cube", "sphere", "cone", "cylinder"]))
RELATION_OPPOSITES = {"left of": "right of", "right of": "left of", "above": "below", "below": "above",
                      "on top of": "under", "under": "on top of", "in front of": "behind", "behind": "in front of",
                      "next to": "far from", "inside": "outside", "outside": "inside"}
RELATION_WORDS = tuple(dict.fromkeys([*RELATIONS, *RELATION_OPPOSITES]))
SHAPE_PLACEHOLDER = ("object", "objects")  # what a removed shape word becomes (keeps the phrase grammatical)


def _rng(prompt: str, seed: int, salt: str) -> np.random.Generator:
    """A generator that depends only on ``(seed, salt, prompt)`` (SHA-256), not on the prompt's position in a file."""
    digest = hashlib.sha256(f"{seed}\x00{salt}\x00{prompt}".encode()).digest()
    return np.random.default_rng(int.from_bytes(digest[:8], "little"))


def removal_range(num_words: int, min_fraction: float = 0.4, max_fraction: float = 0.7) -> tuple[int, int]:
    """Inclusive range ``(k_min, k_max)`` of words to drop from a prompt of `num_words` words so that the dropped
    fraction lies in ``[min_fraction, max_fraction]``: ``k_min = ceil(min_fraction · n)``, ``k_max = floor(max_fraction
    · n)``, in exact rational arithmetic (``0.4 · 15`` is 6, not 6.000000000000001). Empty (``k_min > k_max``) for
    one-word prompts at the defaults."""
    lo = math.ceil(Fraction(str(min_fraction)) * num_words)
    hi = math.floor(Fraction(str(max_fraction)) * num_words)
    return max(lo, 1), min(hi, num_words - 1)


def random_word_removal(
    prompt: str,
    seed: int = 0,
    num_variants: int = 5,
    min_fraction: float = 0.4,
    max_fraction: float = 0.7,
    max_trials: int = 20,
) -> list[str]:
    """Degraded variants of `prompt` by random word removal (DDSPO, arXiv:2512.23426;
    docs/methods/algorithms.md#ddspo-data).

    Each trial draws ``k`` uniformly from `removal_range` (so 40–70 % of the ``n`` words go, exactly) and drops ``k``
    distinct word positions, keeping the others in order, joined by single spaces. Distinct results are collected in
    draw order until `num_variants` are found or `max_trials` trials ran, so short prompts get fewer variants (a
    two-word prompt has only two). Words are split on whitespace, punctuation stays attached, as in the authors'
    script. Deviation from that script, which draws a fraction in [0.4, 0.7] and floors it with a minimum of one word:
    on short prompts it can drop under 40 % (1 of 3 words); here the count itself is drawn from the allowed range.

    Args:
        prompt (`str`): the original prompt c.
        seed (`int`, defaults to 0): with the prompt, fixes the result (independent of other prompts).
        num_variants (`int`, defaults to 5): at most this many distinct variants, ≥ 1 (paper: 5).
        min_fraction (`float`, defaults to 0.4), max_fraction (`float`, defaults to 0.7): the dropped fraction's range,
            0 < min ≤ max < 1.
        max_trials (`int`, defaults to 20): draws before giving up on more variants, ≥ `num_variants`.

    Returns:
        `list[str]`: 1 to `num_variants` distinct degraded prompts, none empty and none equal to `prompt`.

    Raises:
        ValueError: if `prompt` has fewer than two words (no number of dropped words is in the range and leaves a
            non-empty prompt; the message says to use ``degradation=attributes`` or drop the prompt), or for arguments
            out of range.
    """
    if num_variants < 1 or max_trials < num_variants:
        raise ValueError(f"num_variants={num_variants} must be >= 1 and max_trials={max_trials} >= num_variants.")
    if not 0 < min_fraction <= max_fraction < 1:
        raise ValueError(f"need 0 < min_fraction <= max_fraction < 1, got {min_fraction}, {max_fraction}.")
    words = prompt.split()
    k_min, k_max = removal_range(len(words), min_fraction, max_fraction)
    if k_min > k_max:
        raise ValueError(
            f"prompt {prompt!r} has {len(words)} word(s): dropping {min_fraction:.0%}-{max_fraction:.0%} of them "
            "would leave it unchanged or empty. Use degradation=attributes (swaps a word instead) or drop the prompt."
        )
    rng = _rng(prompt, seed, "random_removal")
    variants: list[str] = []
    for _ in range(max_trials):
        k = int(rng.integers(k_min, k_max + 1))
        drop = set(rng.choice(len(words), size=k, replace=False).tolist())
        variant = " ".join(w for i, w in enumerate(words) if i not in drop)
        if variant != prompt and variant not in variants:
            variants.append(variant)
        if len(variants) == num_variants:
            break
    return variants


def _word_pattern(words: tuple[str, ...]) -> re.Pattern:
    # longest first, so "right of" wins over a shorter overlapping term; whole words only, case-insensitive
    alternatives = "|".join(re.escape(w) for w in sorted(words, key=len, reverse=True))
    return re.compile(rf"\b(?:{alternatives})\b", re.IGNORECASE)


_SHAPE_FORMS = {**{s: s for s in SHAPE_WORDS}, **{s + "s": s for s in SHAPE_WORDS}}
_PATTERNS = {
    "color": _word_pattern(COLOR_WORDS),
    "count": _word_pattern(NUMBER_WORDS),
    "shape": _word_pattern(tuple(_SHAPE_FORMS)),
    "relation": _word_pattern(RELATION_WORDS),
}


def _match_case(new: str, old: str) -> str:
    return new[:1].upper() + new[1:] if old[:1].isupper() else new


def attribute_edits(prompt: str) -> list[tuple[str, str, int, int, str]]:
    """Every single-attribute edit of `prompt` as ``(kind, op, start, end, replacement)``: the characters
    ``prompt[start:end]`` become `replacement`.

    Rules (kind: op → result), matched on whole words, case-insensitively:

    - colour: remove (the word and one following space go) | swap to another colour word;
    - count (number words one–ten): remove | swap to another number ≥ 2 (a plural noun stays plural);
    - shape (singular or plural): remove → "object(s)" | swap to another shape, same number;
    - relation: remove → "and" (both objects stay, the relation goes) | swap to its opposite ("left of" ↔ "right of",
      "above" ↔ "below", ...).

    Colour, shape and relation swaps draw from the tiny world's words when the original is one of them (so a tiny-
    world prompt stays in the world's vocabulary), else from the general list.
    """
    edits: list[tuple[str, str, int, int, str]] = []
    for kind, pattern in _PATTERNS.items():
        for m in pattern.finditer(prompt):
            word, start, end = m.group(0), m.start(), m.end()
            low = word.lower()
            if kind == "color":
                end_rm = end + 1 if prompt[end:end + 1] == " " else end
                edits.append((kind, "remove", start, end_rm, ""))
                pool = tuple(COLORS) if low in COLORS else COLOR_WORDS
                edits += [(kind, "swap", start, end, _match_case(c, word)) for c in pool if c != low]
            elif kind == "count":
                end_rm = end + 1 if prompt[end:end + 1] == " " else end
                edits.append((kind, "remove", start, end_rm, ""))
                pool = tuple(COUNT_WORDS.values()) if low in COUNT_WORDS.values() else NUMBER_WORDS[1:]
                edits += [(kind, "swap", start, end, _match_case(n, word)) for n in pool if n != low]
            elif kind == "shape":
                base, is_plural = _SHAPE_FORMS[low], low != _SHAPE_FORMS[low]
                edits.append((kind, "remove", start, end, _match_case(SHAPE_PLACEHOLDER[is_plural], word)))
                pool = SHAPES if base in SHAPES else SHAPE_WORDS
                edits += [(kind, "swap", start, end, _match_case(s + ("s" if is_plural else ""), word))
                          for s in pool if s != base]
            else:
                edits.append((kind, "remove", start, end, "and"))
                edits.append((kind, "swap", start, end, RELATION_OPPOSITES[low]))
    return edits


def attribute_degradation(prompt: str, seed: int = 0, num_variants: int = 5, max_trials: int = 50) -> list[str]:
    """Degraded variants of `prompt`, each with one colour, count, shape or relation word removed or swapped
    (`attribute_edits` lists the rules).

    Each trial picks an attribute kind present in the prompt uniformly, then remove or swap with probability ½ each,
    then one edit of that kind and op uniformly; distinct results (spaces normalised) are kept in draw order. A prompt
    with none of these words falls back to `random_word_removal` with the same seed (documented fallback).

    Args:
        prompt (`str`): the original prompt c.
        seed (`int`, defaults to 0): with the prompt, fixes the result.
        num_variants (`int`, defaults to 5): at most this many distinct variants, ≥ 1.
        max_trials (`int`, defaults to 50): draws before giving up on more variants.

    Returns:
        `list[str]`: 1 to `num_variants` distinct degraded prompts, none empty and none equal to `prompt`.

    Raises:
        ValueError: if `num_variants` < 1, or the prompt has no attribute word and fewer than two words (from the
            fallback).
    """
    if num_variants < 1:
        raise ValueError(f"num_variants={num_variants} must be >= 1.")
    edits = attribute_edits(prompt)
    if not edits:
        return random_word_removal(prompt, seed=seed, num_variants=num_variants, max_trials=max(max_trials,
                                                                                                 num_variants))
    rng = _rng(prompt, seed, "attributes")
    kinds = sorted({e[0] for e in edits})
    variants: list[str] = []
    for _ in range(max_trials):
        kind = kinds[int(rng.integers(len(kinds)))]
        ops = sorted({e[1] for e in edits if e[0] == kind})
        op = ops[int(rng.integers(len(ops)))]
        choices = [e for e in edits if e[0] == kind and e[1] == op]
        _, _, start, end, replacement = choices[int(rng.integers(len(choices)))]
        variant = " ".join((prompt[:start] + replacement + prompt[end:]).split())
        if variant and variant != prompt and variant not in variants:
            variants.append(variant)
        if len(variants) == num_variants:
            break
    return variants


@runtime_checkable
class PromptRewriter(Protocol):
    """An external degradation, e.g. an LLM asked to remove or alter the key nouns and attributes of a prompt (the
    paper's LLaMA-3-8B-Instruct few-shot rewriting, docs/methods/algorithms.md#ddspo-data).

    ``rewriter(prompt, num_variants, seed)`` returns candidate degraded prompts; `degrade_prompt` strips them and drops
    empty ones, the original and duplicates. Select one with ``degradation=external`` and an import string
    ``"package.module:factory"`` (`load_rewriter`); the factory is called with no arguments and returns the rewriter,
    so model weights load once. Nothing here downloads anything.
    """

    def __call__(self, prompt: str, num_variants: int, seed: int) -> list[str]: ...


def load_rewriter(spec: str) -> PromptRewriter:
    """Imports ``"package.module:factory"`` and returns ``factory()``.

    Raises:
        ValueError: if `spec` is not of that form, or the module or attribute is missing.
        TypeError: if the factory's result is not callable.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"rewriter={spec!r} must be an import string 'package.module:factory'.")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"rewriter={spec!r} cannot be imported: {err}") from None
    rewriter = factory()
    if not callable(rewriter):
        raise TypeError(f"rewriter={spec!r}: {attr}() returned a non-callable {type(rewriter).__name__}.")
    return rewriter


def degrade_prompt(
    prompt: str,
    degradation: str = "random_removal",
    seed: int = 0,
    num_variants: int = 5,
    rewriter: Callable[[str, int, int], list[str]] | None = None,
) -> list[str]:
    """Degraded variants of `prompt` with the named degradation (module docstring).

    Args:
        prompt (`str`): the original prompt.
        degradation (`str`, defaults to "random_removal"): "random_removal", "attributes" or "external".
        seed (`int`, defaults to 0): fixes the result with the prompt (passed on to an external rewriter).
        num_variants (`int`, defaults to 5): at most this many variants.
        rewriter (`PromptRewriter`, *optional*): required for "external", ignored otherwise.

    Returns:
        `list[str]`: 1 to `num_variants` distinct degraded prompts, none empty, none equal to `prompt`.

    Raises:
        ValueError: for an unknown degradation, "external" without a rewriter, a rewriter that returns nothing usable,
            or a prompt the degradation cannot degrade (see `random_word_removal`).
    """
    if degradation == "random_removal":
        return random_word_removal(prompt, seed=seed, num_variants=num_variants)
    if degradation == "attributes":
        return attribute_degradation(prompt, seed=seed, num_variants=num_variants)
    if degradation != "external":
        raise ValueError(f"degradation={degradation!r} must be one of {list(DEGRADATIONS)}.")
    if rewriter is None:
        raise ValueError("degradation=external needs a rewriter: pass rewriter='package.module:factory' (a "
                         "PromptRewriter, e.g. a local LLM); it is off by default.")
    variants = []
    for variant in rewriter(prompt, num_variants, seed):
        variant = " ".join(str(variant).split())
        if variant and variant != prompt and variant not in variants:
            variants.append(variant)
    if not variants:
        raise ValueError(f"the external rewriter returned no usable degraded prompt for {prompt!r} (all empty, equal "
                         "to the prompt, or none).")
    return variants[:num_variants]
