"""Model-based rewards (CLIP score, LAION aesthetic, PickScore, HPSv2, ImageReward) on tiny randomly initialised
versions of the real architectures, built in-process, saved to a temporary folder and loaded back through the same
local-folder code a user's real weights take. No downloads (conftest sets HF_HUB_OFFLINE=1).

docs/guides/field_cases.md: the aesthetic predictor needs normalised embeddings; preprocessing matches the reference
transform (range conversion before mean/std); no batch-composition effect."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from diffalign.rewards.aesthetic import Aesthetic
from diffalign.rewards.clip_score import ClipScore
from diffalign.rewards.hpsv2 import Hpsv2
from diffalign.rewards.pickscore import PickScore
from diffalign.rewards.preprocess import clip_preprocess, to_pixels

TINY_VIT_H = "diffalign-test-tiny-vit-h-14"
# ViT-H-14's open_clip config (embed 1024; vision 32 layers × 1280, patch 14; text 24 layers × 1024, BPE vocab
# 49408, 77 tokens) shrunk in width and depth only: same classes, same tokenizer, same preprocessing defaults.
TINY_VIT_H_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 28, "layers": 2, "width": 32, "head_width": 16, "patch_size": 14},
    "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 2},
}
PROMPTS = ["a red circle", "two blue squares", "a photo of " + "a very " * 30 + "yellow triangle", "dog"]


def images_uint8(n: int = 4, h: int = 40, w: int = 56, seed: int = 0) -> np.ndarray:
    """(n, H, W, 3) uint8 images with structure (gradients + blobs), non-square."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    out = []
    for _ in range(n):
        base = np.stack([xx / w, yy / h, (xx + yy) / (h + w)], -1) * rng.uniform(0.3, 1.0, 3)
        base += rng.normal(0, 0.1, (h, w, 3))
        out.append((np.clip(base, 0, 1) * 255).round().astype(np.uint8))
    return np.stack(out)


def as_unit(arrays: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(arrays).permute(0, 3, 1, 2).float() / 255.0


@pytest.fixture(scope="module")
def tiny_open_clip_dir(tmp_path_factory):
    """A tiny ViT-H-14-shaped open_clip model saved as <dir>/open_clip_model.safetensors."""
    import open_clip

    folder = tmp_path_factory.mktemp("tiny_open_clip")
    config_file = folder / f"{TINY_VIT_H}.json"
    config_file.write_text(json.dumps(TINY_VIT_H_CONFIG))
    open_clip.add_model_config(config_file)
    torch.manual_seed(0)
    model = open_clip.create_model(TINY_VIT_H, pretrained=None)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(folder / "open_clip_model.safetensors"))
    return folder


@pytest.fixture(scope="module")
def aesthetic_head_file(tmp_path_factory):
    """The improved-aesthetic-predictor layout (layers.{0,2,4,6,7}) with tiny sizes 16→32→8→8→4→1."""
    torch.manual_seed(1)
    sizes = {0: (32, 16), 2: (8, 32), 4: (8, 8), 6: (4, 8), 7: (1, 4)}
    state = {}
    for i, (out_f, in_f) in sizes.items():
        state[f"layers.{i}.weight"] = torch.randn(out_f, in_f) / in_f**0.5
        state[f"layers.{i}.bias"] = torch.randn(out_f) * 0.1
    path = tmp_path_factory.mktemp("aesthetic") / "aesthetic_mlp.safetensors"
    save_file(state, str(path))
    return path


@pytest.fixture(scope="module")
def tiny_pickscore_dir(tmp_path_factory):
    """A tiny transformers CLIPModel + CLIP BPE tokenizer + CLIPImageProcessor (shortest edge 30, crop 30), saved
    with save_pretrained like PickScore_v1 and its processor."""
    from open_clip.tokenizer import bytes_to_unicode
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    folder = tmp_path_factory.mktemp("tiny_pickscore")
    chars = list(bytes_to_unicode().values())
    merges = ["r e", "re d</w>", "c i", "ci r"]
    tokens = chars + [c + "</w>" for c in chars] + [m.replace(" ", "") for m in merges]
    tokens += ["<|startoftext|>", "<|endoftext|>"]
    vocab = {t: i for i, t in enumerate(dict.fromkeys(tokens))}
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    tokenizer = CLIPTokenizer(vocab=str(folder / "vocab.json"), merges=str(folder / "merges.txt"))
    tokenizer.save_pretrained(folder)
    CLIPImageProcessor(size={"shortest_edge": 30}, crop_size={"height": 30, "width": 30}).save_pretrained(folder)
    eos, bos = vocab["<|endoftext|>"], vocab["<|startoftext|>"]
    config = CLIPConfig(
        text_config={"vocab_size": len(vocab), "hidden_size": 32, "intermediate_size": 37, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "max_position_embeddings": 77, "eos_token_id": eos,
                     "bos_token_id": bos, "pad_token_id": eos},
        vision_config={"image_size": 30, "patch_size": 10, "hidden_size": 32, "intermediate_size": 37,
                       "num_hidden_layers": 2, "num_attention_heads": 2},
        projection_dim=16,
    )
    torch.manual_seed(0)
    CLIPModel(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def rewards(tiny_open_clip_dir, aesthetic_head_file, tiny_pickscore_dir):
    """Every model-based reward, loaded from local folders/files (value_range [0, 1])."""
    return {
        "clip_score": ClipScore(model_name=TINY_VIT_H, pretrained=str(tiny_open_clip_dir)),
        "tiny_world_clip": ClipScore(),
        "aesthetic": Aesthetic(head=str(aesthetic_head_file), clip_model_name=TINY_VIT_H,
                               clip_pretrained=str(tiny_open_clip_dir / "open_clip_model.safetensors")),
        "pickscore": PickScore(model=str(tiny_pickscore_dir), processor=str(tiny_pickscore_dir)),
        "hpsv2": Hpsv2(weights=str(tiny_open_clip_dir), model_name=TINY_VIT_H),
    }


REWARD_NAMES = ["clip_score", "tiny_world_clip", "aesthetic", "pickscore", "hpsv2"]


# ------------------------------------------------------------------------------------ no batch-composition effect


@pytest.mark.parametrize("name", REWARD_NAMES)
def test_batch_scores_equal_single_scores_and_follow_permutations(rewards, name):
    reward = rewards[name]
    images = as_unit(images_uint8())
    batch = reward(images, PROMPTS).scores
    assert batch.shape == (4,) and batch.dtype == torch.float32 and torch.isfinite(batch).all()
    single = torch.cat([reward(images[i:i + 1], PROMPTS[i:i + 1]).scores for i in range(4)])
    torch.testing.assert_close(batch, single, rtol=0, atol=1e-4)
    perm = [2, 0, 3, 1]
    permuted = reward(images[perm], [PROMPTS[i] for i in perm]).scores
    torch.testing.assert_close(permuted, batch[perm], rtol=0, atol=1e-4)
    assert len(set(batch.tolist())) > 1  # the tiny models are not constant


# ------------------------------------------------------------------------------------ the reference transform


@pytest.mark.parametrize("name", REWARD_NAMES)
def test_minus_one_one_tensor_unit_tensor_and_pil_give_the_same_score(rewards, tiny_open_clip_dir, aesthetic_head_file,
                                                                          tiny_pickscore_dir, name):
    reward = rewards[name]
    arrays = images_uint8()
    unit = reward(as_unit(arrays), PROMPTS).scores
    pil = reward([Image.fromarray(a) for a in arrays], PROMPTS).scores
    torch.testing.assert_close(pil, unit, rtol=0, atol=1e-4)
    symmetric_kwargs = {"value_range": (-1.0, 1.0)}
    symmetric = {
        "clip_score": lambda: ClipScore(model_name=TINY_VIT_H, pretrained=str(tiny_open_clip_dir), **symmetric_kwargs),
        "tiny_world_clip": lambda: ClipScore(**symmetric_kwargs),
        "aesthetic": lambda: Aesthetic(head=str(aesthetic_head_file), clip_model_name=TINY_VIT_H,
                                       clip_pretrained=str(tiny_open_clip_dir), **symmetric_kwargs),
        "pickscore": lambda: PickScore(model=str(tiny_pickscore_dir), processor=str(tiny_pickscore_dir),
                                       **symmetric_kwargs),
        "hpsv2": lambda: Hpsv2(weights=str(tiny_open_clip_dir), model_name=TINY_VIT_H, **symmetric_kwargs),
    }[name]()
    torch.testing.assert_close(symmetric(as_unit(arrays) * 2 - 1, PROMPTS).scores, unit, rtol=0, atol=1e-4)


def test_tensor_transform_matches_open_clip_pil_transform():
    """512 (W) × 768 (H): left half red, right half blue, top 10% green. The tensor path (shorter side → 224, i.e.
    224×336, centre crop) equals open_clip's own PIL transform for ViT-H-14 within 2/255, and the green band is cropped
    away (no squashing)."""
    import open_clip

    image = np.zeros((768, 512, 3), np.uint8)
    image[:, :256, 0] = 255
    image[:, 256:, 2] = 255
    image[:77] = (0, 255, 0)
    cfg = open_clip.get_model_config("ViT-H-14")
    size = cfg["vision_cfg"]["image_size"]
    transform = open_clip.image_transform(size, is_train=False)
    reference = transform(Image.fromarray(image))  # normalised with OpenAI CLIP mean/std
    mean, std = open_clip.OPENAI_DATASET_MEAN, open_clip.OPENAI_DATASET_STD
    ours = clip_preprocess(to_pixels(Image.fromarray(image)), size, mean, std)[0]
    unnormalise = lambda x: x * torch.tensor(std).view(3, 1, 1) + torch.tensor(mean).view(3, 1, 1)
    assert ours.shape == reference.shape == (3, 224, 224)
    assert (unnormalise(ours) - unnormalise(reference)).abs().max() <= 2 / 255
    assert unnormalise(ours)[1, 0].max() < 0.5  # first row is not green


def test_pickscore_transform_matches_clip_image_processor(rewards, tiny_pickscore_dir):
    from transformers import CLIPImageProcessor

    arrays = images_uint8(2, h=61, w=45)
    processor = CLIPImageProcessor.from_pretrained(tiny_pickscore_dir)
    reference = processor(images=[Image.fromarray(a) for a in arrays], return_tensors="pt").pixel_values
    ours = rewards["pickscore"]._transform(as_unit(arrays))
    assert ours.shape == reference.shape == (2, 3, 30, 30)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
    assert ((ours - reference) * std).abs().max() <= 3 / 255


# ------------------------------------------------------------------------------------ normalised embeddings


def test_aesthetic_score_is_unchanged_when_the_raw_embedding_is_scaled(rewards, monkeypatch):
    reward = rewards["aesthetic"]
    images = as_unit(images_uint8())
    before = reward(images, PROMPTS).scores
    seen_norms = []
    hook = reward.head.layers[0].register_forward_pre_hook(lambda _m, args: seen_norms.append(args[0].norm(dim=-1)))
    encode = reward.clip.encode_image
    for factor in (10.0, 0.1):
        monkeypatch.setattr(reward.clip, "encode_image", lambda x, f=factor, **kw: f * encode(x, **kw))
        out = reward(images, PROMPTS)
        torch.testing.assert_close(out.scores, before, rtol=0, atol=1e-5)
    hook.remove()
    torch.testing.assert_close(torch.cat(seen_norms), torch.ones(8), rtol=0, atol=1e-4)
    assert before.shape == (4,) and torch.isfinite(before).all()


def test_aesthetic_head_equals_a_hand_built_mlp_on_normalised_embeddings(rewards, aesthetic_head_file):
    from safetensors.torch import load_file

    reward = rewards["aesthetic"]
    state = load_file(str(aesthetic_head_file))
    images = as_unit(images_uint8())
    x = clip_preprocess(images, reward.image_size, reward.mean, reward.std)
    with torch.no_grad():
        e = reward.clip.encode_image(x)
    e = e / e.norm(dim=-1, keepdim=True)
    for i in (0, 2, 4, 6, 7):
        e = e @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    torch.testing.assert_close(reward(images).scores, e.squeeze(-1), rtol=0, atol=1e-5)


# --------------------------------------------------------------------------------------- score definitions


def test_pickscore_is_logit_scale_times_cosine(rewards, tiny_pickscore_dir):
    from transformers import AutoTokenizer, CLIPModel

    model = CLIPModel.from_pretrained(tiny_pickscore_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_pickscore_dir)
    images = as_unit(images_uint8())
    reward = rewards["pickscore"]
    text = tokenizer(PROMPTS, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        out = model(input_ids=text.input_ids, attention_mask=text.attention_mask, pixel_values=reward._transform(images))
    expected = out.logits_per_image.diagonal()  # = logit_scale.exp() · cos(image_i, text_i)
    torch.testing.assert_close(reward(images, PROMPTS).scores, expected, rtol=0, atol=1e-4)


def test_hpsv2_is_the_cosine_and_scale_multiplies_it(rewards, tiny_open_clip_dir):
    images = as_unit(images_uint8())
    scores = rewards["hpsv2"](images, PROMPTS).scores
    assert scores.abs().max() <= 1 + 1e-5
    scaled = Hpsv2(weights=str(tiny_open_clip_dir / "open_clip_model.safetensors"), model_name=TINY_VIT_H, scale=100.0)
    torch.testing.assert_close(scaled(images, PROMPTS).scores, 100 * scores, rtol=1e-5, atol=1e-4)


def test_differentiable_flag_controls_gradients(tiny_open_clip_dir):
    images = as_unit(images_uint8()).requires_grad_(True)
    frozen = Hpsv2(weights=str(tiny_open_clip_dir), model_name=TINY_VIT_H)
    assert not frozen.differentiable and not frozen(images, PROMPTS).scores.requires_grad
    live = Hpsv2(weights=str(tiny_open_clip_dir), model_name=TINY_VIT_H, differentiable=True)
    live(images, PROMPTS).scores.sum().backward()
    assert images.grad is not None and images.grad.abs().sum() > 0


def test_videos_average_frame_scores(rewards):
    reward = rewards["pickscore"]
    frames = as_unit(images_uint8())
    videos = torch.stack([frames[:2], frames[2:]])  # (2, F=2, 3, H, W)
    per_frame = reward(frames, ["a", "a", "b", "b"]).scores
    torch.testing.assert_close(reward(videos, ["a", "b"]).scores, per_frame.view(2, 2).mean(1), rtol=0, atol=1e-5)


# ------------------------------------------------------------------------------------------------ errors


def test_out_of_range_images_name_the_value_range_field(rewards):
    with pytest.raises(ValueError, match=r"reward.clip_score.value_range.*\[-1, 1\]"):
        rewards["clip_score"](as_unit(images_uint8()) * 2 - 1, PROMPTS)


@pytest.mark.parametrize("build, field", [
    (lambda tmp: Aesthetic(head=None), "reward.aesthetic.head is required"),
    (lambda tmp: Aesthetic(head=str(tmp / "absent.safetensors")), "reward.aesthetic.head"),
    (lambda tmp: Hpsv2(weights=None), "reward.hpsv2.weights is required"),
    (lambda tmp: Hpsv2(weights=str(tmp / "absent_folder")), "reward.hpsv2.weights"),
    (lambda tmp: ClipScore(model_name="ViT-L-14"), "reward.clip_score.pretrained is required"),
    (lambda tmp: ClipScore(model_name="ViT-L-14", pretrained="openai"), "HF_HUB_OFFLINE"),
    (lambda tmp: PickScore(), "reward.pickscore.model"),
    (lambda tmp: PickScore(model=str(tmp / "nowhere")), "no such local file or folder"),
])
def test_absent_weights_say_where_to_put_them(tmp_path, build, field):
    with pytest.raises((FileNotFoundError, ValueError), match=field) as info:
        build(tmp_path)
    assert any(word in str(info.value) for word in ("pass reward.", "Put ", "Save ", "Download ")), str(info.value)


def test_pickled_weights_are_refused_with_the_conversion_command(tmp_path):
    (tmp_path / "HPS_v2.1_compressed.pt").write_bytes(b"not read")
    with pytest.raises(ValueError, match=r"pickle.*safetensors.*save_file"):
        Hpsv2(weights=str(tmp_path / "HPS_v2.1_compressed.pt"), model_name=TINY_VIT_H)


def test_image_reward_without_its_package_names_the_extra():
    from diffalign.rewards.image_reward import ImageRewardScore

    pytest.importorskip("open_clip")
    try:
        import ImageReward  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match=r"pip install \"diffalign\[imagereward\]\""):
            ImageRewardScore()
    else:
        pytest.skip("the ImageReward package is installed here")
