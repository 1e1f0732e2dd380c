"""Rewards say when they truncate (issue 19 item 7): every text-conditioned reward warns once per prompt that is
longer than its text encoder's context, as the diffusion model's own text encoder does
(`diffalign.runtime.text_context.TruncationWarner`, shared with `StableDiffusionPolicy`)."""

from __future__ import annotations

import logging

import pytest
import torch

from diffalign.runtime.text_context import TruncationWarner, token_count
from diffalign.world.tokenizer import build_tokenizer

LONG = "a red circle left of a green square and a blue triangle above a yellow circle"  # 16 words


def _warnings(caplog, marker: str) -> list[str]:
    return [r.getMessage() for r in caplog.records if marker in r.getMessage()]


def test_clip_score_warns_once_per_long_prompt_and_scores_the_truncated_prompt(caplog):
    from diffalign.rewards.clip_score import ClipScore

    reward = ClipScore()  # the tiny world's CLIP: a 12-token context ([BOS] + 10 words + [EOS])
    images = torch.rand(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    kept = " ".join(LONG.split()[:10])
    with caplog.at_level(logging.WARNING, logger="diffalign.rewards.loading"):
        long = reward(images, [LONG, LONG]).scores
        reward(images, [LONG, "a red circle"])
    said = _warnings(caplog, "reward.clip_score's text encoder reads only the first 12")
    assert len(said) == 1 and repr(LONG) in said[0] and "has 18 tokens" in said[0]
    assert "the score judges the truncated prompt" in said[0]
    torch.testing.assert_close(long, reward(images, [kept, kept]).scores, rtol=0, atol=1e-6)  # what it judged
    with caplog.at_level(logging.WARNING, logger="diffalign.rewards.loading"):
        reward(images, [kept, "a red circle"])
    assert len(_warnings(caplog, "reads only the first")) == 1  # prompts that fit: nothing more


def test_open_clip_token_counts_are_the_tokens_before_truncation():
    """open_clip's BPE tokenizer (ViT-L/14's, bundled with open_clip): the count equals the number of tokens it makes
    with a context long enough not to cut, start and end tokens included."""
    import open_clip

    tokenizer = open_clip.get_tokenizer("ViT-L-14")
    text = " ".join(["a photograph of a red circle"] * 15)
    assert token_count(tokenizer, text) == int((tokenizer([text], context_length=1000)[0] != 0).sum()) > 77
    assert token_count(tokenizer, "a red circle") == int((tokenizer(["a red circle"])[0] != 0).sum())


class _Stop(Exception):
    pass


def test_pickscore_and_image_reward_warn_with_their_own_contexts(caplog):
    """PickScore (CLIP-H, 77 tokens) and ImageReward (BLIP, 35 tokens), built around a tokenizer without their
    weights: the warning comes before their models run (here: models that stop the call)."""
    from diffalign.rewards.image_reward import BLIP_CONTEXT, ImageRewardScore
    from diffalign.rewards.pickscore import TEXT_CONTEXT, PickScore

    tokenizer = build_tokenizer()
    pick = PickScore.__new__(PickScore)
    pick.tokenizer, pick.value_range = tokenizer, [0.0, 1.0]
    pick.device, pick.dtype = torch.device("cpu"), torch.float32
    pick.resize = pick.crop = 32
    pick.mean = pick.std = (0.5, 0.5, 0.5)
    pick.differentiable = False
    pick._truncation = TruncationWarner("reward.pickscore's text encoder",
                                        logging.getLogger("diffalign.rewards.pickscore"))

    class StopModel:
        def get_image_features(self, **kwargs):
            raise _Stop

    pick.model = StopModel()
    over_77 = " ".join(["a red circle"] * 27)  # 81 words + [BOS] [EOS]
    with caplog.at_level(logging.WARNING), pytest.raises(_Stop):
        pick(torch.rand(1, 3, 32, 32), [over_77])
    assert len(_warnings(caplog, f"reward.pickscore's text encoder reads only the first {TEXT_CONTEXT}")) == 1

    scorer = ImageRewardScore.__new__(ImageRewardScore)
    scorer.value_range = [0.0, 1.0]
    scorer._truncation = TruncationWarner("reward.image_reward's text encoder (BLIP)",
                                          logging.getLogger("diffalign.rewards.image_reward"))

    class Blip:
        pass

    class Model:
        blip = Blip()

        def score(self, prompt, images):
            return 0.0

    Model.blip.tokenizer = tokenizer
    scorer.model = Model()
    over_35 = " ".join(["a red circle"] * 12)  # 36 words
    with caplog.at_level(logging.WARNING):
        scorer(torch.rand(2, 3, 32, 32), [over_35, over_35])
        scorer(torch.rand(1, 3, 32, 32), ["a red circle"])
    said = _warnings(caplog, f"(BLIP) reads only the first {BLIP_CONTEXT}")
    assert len(said) == 1 and "has 38 tokens" in said[0]


def test_the_diffusion_models_text_encoder_uses_the_same_warner(caplog):
    from diffalign.models.tiny_random import build_tiny_random_policy

    policy = build_tiny_random_policy(seed=0)
    with caplog.at_level(logging.WARNING, logger="diffalign.models.stable_diffusion"):
        policy.encode_prompts([LONG], do_classifier_free_guidance=False)
        policy.encode_prompts([LONG, LONG], do_classifier_free_guidance=False)
    said = _warnings(caplog, "the text encoder reads only the first")
    assert len(said) == 1 and said[0].startswith(f"prompt {LONG!r} has 18 tokens")
