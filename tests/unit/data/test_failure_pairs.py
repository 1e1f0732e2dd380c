"""data=failure_pairs: losers are exactly the policy's samples that the reward judges wrong, winners are renders of the
same prompt that the verifier accepts, and bad settings fail with the field named."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import EveryOtherCorrect, step_sampler

from diffalign.data.failure_pairs import FailurePairs
from diffalign.data.onpolicy import sample_seed
from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.rewards.geneval_shapes import GenevalShapes
from diffalign.samplers.rollout import rollout
from diffalign.types import RewardOutput
from diffalign.world.prompts import load_prompts
from diffalign.world.verifier import verify

DDIM1 = {"name": "ddim", "num_inference_steps": 1, "eta": 0.0}  # the data's sampler (DDIM eta 0), with fewer steps
DDIM2 = {"name": "ddim", "num_inference_steps": 2, "eta": 0.0}


class NoCorrectness:
    modality = "image"

    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(torch.zeros(images.shape[0]))


class AllCorrect(NoCorrectness):
    def __call__(self, images, prompts, metadata=None):
        return RewardOutput(torch.ones(images.shape[0]), info={"correct": torch.ones(images.shape[0], dtype=torch.bool)})


def _uint8(image: torch.Tensor) -> np.ndarray:
    return (image.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)


@pytest.fixture(scope="module")
def policy():
    return build_tiny_random_policy(seed=0)


def test_losers_are_the_wrong_samples_and_winners_are_verified_renders(policy):
    data = FailurePairs(num_prompts=3, samples_per_prompt=2, sampler=DDIM2, batch_size=4, seed=5,
                        reward="judge")
    data.prepare(policy, {"judge": EveryOtherCorrect()})
    # jobs in order (prompt 0, sample 0), (0, 1), (1, 0), ...: every second one is judged wrong
    assert [(p["prompt_index"], p["sample_index"]) for p in data.pairs] == [(0, 1), (1, 1), (2, 1)]
    assert data.stats == {"num_samples": 6, "num_pairs": 3, "accuracy": 0.5}
    rows = load_prompts("train")
    for pair in data.pairs:
        i, j = pair["prompt_index"], pair["sample_index"]
        assert pair["prompt"] == data.rows[i]["prompt"] == rows[(i * len(rows)) // 3]["prompt"]
        # the loser is the policy's own sample for the documented seed, recomputed here on its own
        gen = torch.Generator().manual_seed(sample_seed(5, i, j))
        image = rollout(policy, [pair["prompt"]],
                        step_sampler(policy, num_inference_steps=2, guidance_scale=4.0, noise=0.0), generator=[gen]).images[0].float()
        assert torch.allclose(pair["image_l"], image, atol=1e-6)
        # the winner is a ground-truth render of the same prompt: the real verifier accepts it
        assert pair["image_w"].shape == (3, 32, 32)
        assert verify(_uint8(pair["image_w"]), data.rows[i]).correct
    every = FailurePairs(num_prompts=3, samples_per_prompt=2, sampler=DDIM2, batch_size=4, seed=5,
                         reward="judge", losers="all")
    every.prepare(policy, {"judge": EveryOtherCorrect()})  # the ablation: every sample a loser, verdicts ignored
    assert [(p["prompt_index"], p["sample_index"]) for p in every.pairs] == [(i, j) for i in range(3) for j in range(2)]
    assert torch.equal(every.pairs[1]["image_l"], data.pairs[0]["image_l"])
    batch = data.collate([2, 0])
    assert batch["images_w"].shape == batch["images_l"].shape == (2, 3, 32, 32)
    assert batch["ids"].tolist() == [2, 0] and batch["prompts"] == [data.pairs[2]["prompt"], data.pairs[0]["prompt"]]


def test_with_the_verifier_every_loser_fails_it_and_preparation_is_deterministic(policy):
    def make():
        data = FailurePairs(num_prompts=4, samples_per_prompt=2, sampler=DDIM2, batch_size=8)
        data.prepare(policy, {"geneval_shapes": GenevalShapes()})
        return data

    a, b = make(), make()
    assert len(a) == a.stats["num_pairs"] >= 1
    for pair in a.pairs:
        assert not verify(_uint8(pair["image_l"]), pair["metadata"]).correct
    assert [p["id"] for p in a.pairs] == [p["id"] for p in b.pairs]
    assert all(torch.equal(x["image_l"], y["image_l"]) and torch.equal(x["image_w"], y["image_w"])
               for x, y in zip(a.pairs, b.pairs))


def test_bad_settings_name_the_field(policy, tmp_path):
    with pytest.raises(ValueError, match="data.num_prompts"):
        FailurePairs(num_prompts=0)
    with pytest.raises(ValueError, match="data.samples_per_prompt"):
        FailurePairs(samples_per_prompt=0)
    with pytest.raises(ValueError, match="data.losers"):
        FailurePairs(losers="worst")
    with pytest.raises(ValueError, match="data.sampler.num_inference_steps must be an integer >= 1, got 0"):
        FailurePairs(sampler={"name": "ddim", "num_inference_steps": 0})
    txt = tmp_path / "dogs.txt"
    txt.write_text("a photo of a dog\n")
    with pytest.raises(ValueError, match="data.prompts=.*'include'"):
        FailurePairs(prompts=str(txt))
    data = FailurePairs(num_prompts=1, samples_per_prompt=1, sampler=DDIM1)
    with pytest.raises(ValueError, match="data.reward='geneval_shapes' is not among"):
        data.prepare(policy, {"other": AllCorrect()})
    with pytest.raises(RuntimeError, match="prepare"):
        len(data)
    data = FailurePairs(num_prompts=1, samples_per_prompt=1, sampler=DDIM1, reward="plain")
    with pytest.raises(ValueError, match="does not report per-sample correctness"):
        data.prepare(policy, {"plain": NoCorrectness()})
    data = FailurePairs(num_prompts=1, samples_per_prompt=2, sampler=DDIM1, reward="easy")
    with pytest.raises(ValueError, match="judged all 2 samples correct"):
        data.prepare(policy, {"easy": AllCorrect()})


def test_the_training_loop_refuses_fewer_pairs_than_one_batch(tmp_path):
    from conftest import compose_cfg

    from diffalign.train.preference import train

    cfg = compose_cfg([f"output_dir={tmp_path}", "model=tiny_random", "data=failure_pairs", "data.num_prompts=2",
                       "data.samples_per_prompt=1", "data.sampler.num_inference_steps=1", "data.losers=all", "trainer.batch_size=4",
                       "trainer.max_steps=1", "trainer.log_with=none", "eval.enabled=false"])
    with pytest.raises(ValueError, match=r"holds 2 items, fewer than one global batch \(trainer.batch_size=4"):
        train(cfg)


def test_training_samples_never_start_from_an_evaluated_images_noise():
    """Evaluation seeds image (s, p) with s * 1_000_003 + p; on-policy data seeds are 63-bit stream seeds, so none of
    the default data's 594 × 4 samples (data seeds 0-2) shares its initial noise with an evaluated image of 16 seeds."""
    from diffalign.evaluation.generation import image_seed

    data_seeds = {sample_seed(d, i, j) for d in range(3) for i in range(594) for j in range(4)}
    assert len(data_seeds) == 3 * 594 * 4
    eval_seeds = {image_seed(s, p) for s in range(16) for p in range(594)}
    assert not data_seeds & eval_seeds and min(data_seeds) > max(eval_seeds)


def test_a_data_reward_that_is_not_selected_is_refused_before_any_model_loads(tmp_path):
    from conftest import compose_cfg

    from diffalign.config.validation import validate_train_config

    cfg = compose_cfg([f"output_dir={tmp_path}", "reward=[jpeg_compressibility]"])  # the default data judges with
    with pytest.raises(ValueError, match=r"data.reward='geneval_shapes'.*reward=\[geneval_shapes\]"):  # the verifier
        validate_train_config(cfg)
    validate_train_config(compose_cfg([f"output_dir={tmp_path}"]))
