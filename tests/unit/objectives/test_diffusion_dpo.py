"""Diffusion-DPO objective (arXiv:2311.12908 Eq. 14): hand-computed losses, the loss at initialisation, no
reference aliasing and fp32 losses from half-precision outputs (docs/guides/field_cases.md)."""

import copy
import logging
import math
from contextlib import contextmanager

import pytest
import torch
from diffusers import DDIMScheduler, UNet2DConditionModel
from peft import LoraConfig

from diffalign.objectives.common import per_sample_mse
from diffalign.objectives.diffusion_dpo import DiffusionDPO, DiffusionDPOConfig, diffusion_dpo_loss
from diffalign.types import PreferenceBatch, PromptEmbeds

LN2 = math.log(2.0)


@pytest.fixture(autouse=True, scope="module")
def one_intra_op_thread():
    """The tiny UNet's kernels are far too small to gain from intra-op threads, and on a busy 2-core machine the
    OpenMP spin-waits made this file ~30x slower; restored after the module."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def tiny_unet() -> UNet2DConditionModel:
    """A "tiny UNet": real diffusers UNet, seed 0, latents (4, 8, 8), text width 32."""
    torch.manual_seed(0)
    return UNet2DConditionModel(
        sample_size=8,
        in_channels=4,
        out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        attention_head_dim=8,
        norm_num_groups=8,
    )


class TinyPolicy:
    """The slice of `StableDiffusionPolicy`'s interface the objective uses, around a real UNet.

    The reference is either a frozen deep copy (`reference_unet`) or the same UNet with its LoRA adapter disabled.
    Every `add_noise` and `predict` call is recorded so tests can check what the objective drew and ran.
    """

    prediction_type = "epsilon"

    def __init__(self, unet: UNet2DConditionModel, reference_unet: UNet2DConditionModel | None = None):
        self.unet = unet
        self.reference_unet = reference_unet
        self.scheduler = DDIMScheduler(
            num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear"
        )
        self._in_reference = False
        self.noise_calls: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.predict_calls: list[dict] = []

    def predict(self, latents, timesteps, prompt_embeds: PromptEmbeds, guidance_scale: float = 1.0):
        net = self.reference_unet if self._in_reference and self.reference_unet is not None else self.unet
        self.predict_calls.append(
            {"reference": self._in_reference, "grad": torch.is_grad_enabled(), "guidance": guidance_scale}
        )
        return net(latents, timesteps, encoder_hidden_states=prompt_embeds.prompt_embeds).sample

    def add_noise(self, latents, noise, timesteps):
        self.noise_calls.append((noise.clone(), timesteps.clone()))
        return self.scheduler.add_noise(latents, noise, timesteps)

    def training_target(self, latents, noise, timesteps):
        return noise

    @contextmanager
    def reference(self):
        self._in_reference = True
        if self.reference_unet is None:
            self.unet.disable_adapters()
        try:
            yield
        finally:
            self._in_reference = False
            if self.reference_unet is None:
                self.unet.enable_adapters()

    def trainable_parameters(self):
        return [p for p in self.unet.parameters() if p.requires_grad]


def frozen_copy(unet):
    ref = copy.deepcopy(unet).eval()
    ref.requires_grad_(False)
    return ref


def make_batch(bsz: int = 2, seed: int = 0) -> PreferenceBatch:
    gen = torch.Generator().manual_seed(seed)
    return PreferenceBatch(
        latents_w=torch.randn(bsz, 4, 8, 8, generator=gen),
        latents_l=torch.randn(bsz, 4, 8, 8, generator=gen),
        prompts=[f"prompt {i}" for i in range(bsz)],
        prompt_embeds=PromptEmbeds(torch.randn(bsz, 5, 32, generator=gen)),
        ids=torch.arange(bsz),
    )


# ----------------------------------------------------------------------------------------------- loss arithmetic


def test_hand_computed_loss():
    # z = -β/2 [(0.1 - 0.2) - (0.3 - 0.2)] = -5 · (-0.2) = 1.0; loss = log(1 + e^-1)
    loss, metrics = diffusion_dpo_loss(
        torch.tensor([0.1]), torch.tensor([0.3]), torch.tensor([0.2]), torch.tensor([0.2]), beta=10.0
    )
    assert loss.item() == pytest.approx(0.313262, abs=1e-6)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-1.0)), abs=1e-6)
    assert metrics["implicit_acc"].item() == 1.0
    assert metrics["rewards/chosen"].item() == pytest.approx(0.5, abs=1e-6)  # -5 · (0.1 - 0.2)
    assert metrics["rewards/rejected"].item() == pytest.approx(-0.5, abs=1e-6)  # -5 · (0.3 - 0.2)
    assert metrics["rewards/margins"].item() == pytest.approx(1.0, abs=1e-6)
    assert metrics["model_loss/rejected"].item() == pytest.approx(0.3)
    assert metrics["saturated"].item() == 0


def test_loss_mean_over_pairs_and_tie_is_not_a_win():
    # pair 0: z = 1.0 (as above); pair 1: policy == reference, z = 0 -> -log σ(0) = ln 2, not counted as correct.
    loss, metrics = diffusion_dpo_loss(
        torch.tensor([0.1, 0.4]), torch.tensor([0.3, 0.7]), torch.tensor([0.2, 0.4]), torch.tensor([0.2, 0.7]), 10.0
    )
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1.0)) + LN2) / 2, abs=1e-6)
    assert metrics["implicit_acc"].item() == 0.5


def test_saturation_is_counted_and_warned(caplog):
    # z = -β/2 · ((1 - 0) - (0 - 0)) = -50 and +50 for the second pair: only z = +50 is saturated (loss ~0, ~0
    # gradient); z = -50 has loss 50 and the full gradient
    with caplog.at_level(logging.WARNING, logger="diffalign.objectives.diffusion_dpo"):
        loss, metrics = diffusion_dpo_loss(
            torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0]), torch.zeros(2), torch.zeros(2), beta=100.0
        )
    assert metrics["saturated"].item() == 1
    assert loss.item() == pytest.approx(25.0, abs=1e-4)  # (50 + ~0) / 2
    assert "1 of 2 pairs had z > 30" in caplog.text


def test_loss_gradient_matches_closed_form():
    # d/dℓθw of -log σ(z) = σ(-z) · β/2 ; z = 1, β = 10 -> σ(-1) · 5
    model_w = torch.tensor([0.1], requires_grad=True)
    loss, _ = diffusion_dpo_loss(model_w, torch.tensor([0.3]), torch.tensor([0.2]), torch.tensor([0.2]), beta=10.0)
    loss.backward()
    assert model_w.grad.item() == pytest.approx(5.0 / (1.0 + math.e), abs=1e-6)


def test_beta_maps_to_twice_the_diffusers_example_beta():
    # diffusers examples/research_projects/diffusion_dpo/train_diffusion_dpo.py (sigmoid loss, default beta_dpo 2500):
    #   model_diff = ℓθw − ℓθl, ref_diff = ℓrefw − ℓrefl, loss = −logsigmoid(beta_dpo · (ref_diff − model_diff)).mean()
    # Losses on a 2^-12 grid, so every difference below is exact in float32 (u = 2^-12):
    #   model_diff = (−2u, 0, 3u), ref_diff = (0, −3u, u), ref_diff − model_diff = (2u, −3u, −2u)
    #   beta_dpo · (…) = 2500 · (2, −3, −2) / 4096 = (1.220703125, −1.8310546875, −1.220703125)
    #   loss = mean(log(1 + e^−x)) = (0.258528 + 1.979685 + 1.479231) / 3 = 1.239148
    u = 2.0**-12
    model_w = torch.tensor([0.25, 0.125, 0.5])
    model_l = torch.tensor([0.25 + 2 * u, 0.125, 0.5 - 3 * u])
    ref_w = torch.tensor([0.25 + u, 0.125 - 2 * u, 0.5 + u])
    ref_l = torch.tensor([0.25 + u, 0.125 + u, 0.5])
    beta_diffusers = 2500.0
    x = [beta_diffusers * k * u for k in (2, -3, -2)]
    assert x == [1.220703125, -1.8310546875, -1.220703125]
    expected = sum(math.log1p(math.exp(-v)) for v in x) / 3
    assert expected == pytest.approx(1.239148, abs=1e-6)
    loss, metrics = diffusion_dpo_loss(model_w, model_l, ref_w, ref_l, beta=2 * beta_diffusers)
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["rewards/margins"].item() == pytest.approx(sum(x) / 3, rel=1e-6)  # our z is diffusers' logit
    # the same β in both (no factor 2) is a different loss: diffusers' loss with 2500 is ours with 5000
    wrong, _ = diffusion_dpo_loss(model_w, model_l, ref_w, ref_l, beta=beta_diffusers)
    assert abs(wrong.item() - expected) > 0.1


@pytest.mark.parametrize("beta", [0.0, -1.0])
def test_nonpositive_beta_raises_naming_field(beta):
    with pytest.raises(ValueError, match="method.beta"):
        DiffusionDPO(beta=beta)
    with pytest.raises(ValueError, match="beta"):
        diffusion_dpo_loss(torch.zeros(1), torch.zeros(1), torch.zeros(1), torch.zeros(1), beta=beta)


def test_config_matches_init():
    cfg = DiffusionDPOConfig()
    module = DiffusionDPO(beta=cfg.beta, timestep_min=cfg.timestep_min, timestep_max=cfg.timestep_max)
    assert cfg._target_ == f"{DiffusionDPO.__module__}.{DiffusionDPO.__qualname__}"
    assert module.beta == 5000.0 and DiffusionDPO.data_flow == "pairs"


def test_bad_timestep_range_raises():
    with pytest.raises(ValueError, match="method.timestep_max"):
        DiffusionDPO(timestep_min=500, timestep_max=100)
    policy = TinyPolicy(tiny_unet(), frozen_copy(tiny_unet()))
    with pytest.raises(ValueError, match="method.timestep_max"):
        DiffusionDPO(timestep_max=1000)(policy, make_batch())


def test_per_sample_mse_fp16_is_fp32_mean():
    gen = torch.Generator().manual_seed(0)
    pred, target = torch.randn(3, 4, 2, 5, 5, generator=gen), torch.randn(3, 4, 2, 5, 5, generator=gen)
    out = per_sample_mse(pred.half(), target.half())
    expected = torch.stack([((p.half().float() - t.half().float()) ** 2).mean() for p, t in zip(pred, target)])
    assert out.dtype == torch.float32 and out.shape == (3,)
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match="shape"):
        per_sample_mse(pred, target[:2])


# ------------------------------------------------------------------------------------------------- loss at init


@pytest.mark.parametrize("reference", ["deep_copy", "lora_disabled"])
def test_loss_is_ln2_at_init_and_winner_and_loser_share_noise(reference):
    unet = tiny_unet()
    if reference == "lora_disabled":
        unet.requires_grad_(False)
        unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
        policy = TinyPolicy(unet)
    else:
        policy = TinyPolicy(unet, frozen_copy(unet))
    batch = make_batch(bsz=2)
    loss, metrics = DiffusionDPO(beta=5000.0)(policy, batch, generator=torch.Generator().manual_seed(0))

    assert loss.item() == pytest.approx(LN2, abs=1e-5)
    assert metrics["implicit_acc"].item() == 0.0  # inside term exactly 0, which is not > 0
    assert metrics["rewards/margins"].item() == 0.0

    # one (t, ε) per pair, shared by winner (rows :B) and loser (rows B:)
    ((noise, timesteps),) = policy.noise_calls
    assert noise.shape == (4, 4, 8, 8) and timesteps.shape == (4,)
    assert torch.equal(noise[:2], noise[2:]) and torch.equal(timesteps[:2], timesteps[2:])
    assert not torch.equal(noise[0], noise[1])
    assert ((timesteps >= 0) & (timesteps <= 999)).all()

    # policy with grad, reference without, both unguided on the full 2B batch
    assert [(c["reference"], c["grad"], c["guidance"]) for c in policy.predict_calls] == [
        (False, True, 1.0),
        (True, False, 1.0),
    ]

    loss.backward()
    grads = [p.grad for p in policy.trainable_parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    assert sum(g.abs().sum().item() for g in grads) > 0


def test_loss_matches_independent_computation():
    """Recomputes the loss from the drawn (t, ε) with our own q-sample and direct UNet calls."""
    ref = frozen_copy(tiny_unet())
    unet = tiny_unet()
    with torch.no_grad():
        for p in unet.parameters():
            p.add_(0.01 * torch.randn_like(p))
    policy = TinyPolicy(unet, ref)
    batch = make_batch(bsz=3, seed=1)
    beta = 200.0
    loss, metrics = DiffusionDPO(beta=beta)(policy, batch, generator=torch.Generator().manual_seed(3))

    ((noise, t),) = policy.noise_calls
    betas = torch.linspace(0.00085**0.5, 0.012**0.5, 1000, dtype=torch.float64) ** 2
    abar = torch.cumprod(1 - betas, 0)[t].float().view(-1, 1, 1, 1)
    x0 = torch.cat([batch.latents_w, batch.latents_l])
    xt = abar.sqrt() * x0 + (1 - abar).sqrt() * noise
    cond = torch.cat([batch.prompt_embeds.prompt_embeds] * 2)
    with torch.no_grad():
        err_model = ((unet(xt, t, encoder_hidden_states=cond).sample - noise) ** 2).mean(dim=(1, 2, 3))
        err_ref = ((ref(xt, t, encoder_hidden_states=cond).sample - noise) ** 2).mean(dim=(1, 2, 3))
    z = -beta / 2 * ((err_model[:3] - err_ref[:3]) - (err_model[3:] - err_ref[3:]))
    expected = torch.log1p(torch.exp(-z)).mean()

    assert loss.item() == pytest.approx(expected.item(), rel=1e-4, abs=1e-6)
    assert abs(loss.item() - LN2) > 1e-4
    assert metrics["implicit_acc"].item() == pytest.approx((z > 0).float().mean().item())


def test_generator_reproducible_and_timestep_range():
    policy = TinyPolicy(tiny_unet(), frozen_copy(tiny_unet()))
    objective = DiffusionDPO(beta=10.0, timestep_min=250, timestep_max=250)
    objective(policy, make_batch(), generator=torch.Generator().manual_seed(5))
    objective(policy, make_batch(), generator=torch.Generator().manual_seed(5))
    (n1, t1), (n2, t2) = policy.noise_calls
    assert torch.equal(n1, n2) and torch.equal(t1, t2)
    assert (t1 == 250).all()


# ---------------------------------------------------------------------------------------------------- no aliasing


def test_reference_never_aliases_the_policy():
    checkpoint = tiny_unet()
    initial = {k: v.clone() for k, v in checkpoint.state_dict().items()}
    policy_unet = copy.deepcopy(checkpoint).train()
    reference = frozen_copy(checkpoint)
    policy = TinyPolicy(policy_unet, reference)
    objective = DiffusionDPO(beta=5000.0)
    optimizer = torch.optim.AdamW(policy.trainable_parameters(), lr=1e-3)
    batch = make_batch(bsz=2)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        loss, _ = objective(policy, batch, generator=gen)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    loss, _ = objective(policy, batch, generator=gen)

    policy_ptrs = {p.data_ptr() for p in policy_unet.state_dict().values()}
    for name, tensor in reference.state_dict().items():
        assert torch.equal(tensor, initial[name]), name
        assert tensor.data_ptr() not in policy_ptrs, name
    assert all(not p.requires_grad for p in reference.parameters())
    assert not reference.training
    moved = max((p - initial[n]).abs().max().item() for n, p in policy_unet.named_parameters())
    assert moved > 0
    assert loss.item() != pytest.approx(LN2, abs=1e-6)


# ------------------------------------------------------------------- with the package's StableDiffusionPolicy


def test_with_tiny_random_stable_diffusion_policy(perturb_lora):
    from diffalign.models.tiny_random import build_tiny_random_policy

    policy = build_tiny_random_policy(seed=0)  # fresh LoRA: B = 0, so adapter-disabled reference == policy
    prompts = ["a red circle", "two blue squares"]
    embeds = policy.encode_prompts(prompts, do_classifier_free_guidance=False)
    gen = torch.Generator().manual_seed(0)
    shape = (2, *policy.latent_shape)
    batch = PreferenceBatch(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen), prompts, embeds)
    objective = DiffusionDPO(beta=5000.0)
    loss, metrics = objective(policy, batch, generator=torch.Generator().manual_seed(1))
    assert loss.item() == pytest.approx(LN2, abs=1e-5) and metrics["implicit_acc"].item() == 0.0
    loss.backward()
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in policy.trainable_parameters())

    perturb_lora(policy)
    loss, _ = objective(policy, batch, generator=torch.Generator().manual_seed(1))
    assert torch.isfinite(loss) and abs(loss.item() - LN2) > 1e-4
