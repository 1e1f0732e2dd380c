"""DDSPO objective (arXiv:2512.23426; docs/methods/algorithms.md#ddspo): values at init, equality with Diffusion-DPO,
TF-CPP and DD-CPP targets recomputed independently, weights, random-condition removal, the flow x̂₀ branch, and
errors."""

from __future__ import annotations

import math
from contextlib import contextmanager

import pytest
import torch

from diffalign.models.tiny_random import build_tiny_random_policy
from diffalign.objectives.common import draw_timesteps_and_noise
from diffalign.objectives.ddspo import DDSPO, DDSPOConfig, ddspo_loss, rand_cond_probability
from diffalign.objectives.diffusion_dpo import DiffusionDPO
from diffalign.types import PreferenceBatch, PromptEmbeds

LN2 = math.log(2.0)
PROMPTS = ["a red circle", "two blue squares", "a green triangle left of a yellow square"]
DEGRADED = ["circle", "two blue", "a green a square"]


def make_batch(policy, seed: int = 0, bsz: int = 3) -> PreferenceBatch:
    gen = torch.Generator().manual_seed(seed)
    shape = (bsz, *policy.latent_shape)
    return PreferenceBatch(
        latents_w=torch.randn(shape, generator=gen),
        latents_l=torch.randn(shape, generator=gen),
        prompts=PROMPTS[:bsz],
        prompt_embeds=policy.encode_prompts(PROMPTS[:bsz], do_classifier_free_guidance=False),
        ids=torch.arange(bsz),
        degraded_prompts=DEGRADED[:bsz],
        degraded_prompt_embeds=policy.encode_prompts(DEGRADED[:bsz], do_classifier_free_guidance=False),
    )


def replay_draws(policy, batch, seed):
    """The (t, ε) the objective draws first from ``Generator().manual_seed(seed)``."""
    return draw_timesteps_and_noise(policy, tuple(batch.latents_w.shape), 0, None, torch.Generator().manual_seed(seed))


def unet_eps(policy, x, t, embeds):
    with torch.no_grad():
        return policy.unet(x, t, encoder_hidden_states=embeds.prompt_embeds).sample.float()


# ------------------------------------------------------------------------------------------------ the tests


@pytest.mark.parametrize("cpp", ["tf", "off"])
def test_loss_is_ln2_when_policy_equals_reference(cpp):
    policy = build_tiny_random_policy(seed=0)  # fresh LoRA (B = 0): the adapter-disabled reference is the policy
    batch = make_batch(policy)
    loss, metrics = DDSPO(cpp=cpp)(policy, batch, generator=torch.Generator().manual_seed(1))
    assert loss.item() == pytest.approx(LN2, abs=1e-6)
    assert metrics["rewards/margins"].item() == 0.0 and metrics["implicit_acc"].item() == 0.0
    loss.backward()  # TF-CPP: z = 0 but the loser term already pushes away from the c⁻ score
    grads = [p.grad for p in policy.trainable_parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_cpp_off_equals_diffusion_dpo_on_same_batch_noise_and_timesteps(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy)
    batch = make_batch(policy)
    loss, metrics = DDSPO(beta=5000.0, cpp="off")(policy, batch, generator=torch.Generator().manual_seed(4))
    expected, expected_metrics = DiffusionDPO(beta=5000.0)(policy, batch, generator=torch.Generator().manual_seed(4))
    assert abs(loss.item() - LN2) > 1e-3  # not the trivial value
    assert torch.equal(loss, expected)
    for key, value in expected_metrics.items():
        assert torch.equal(metrics[key], value), key


def test_tf_cpp_winner_reference_term_is_exactly_zero_and_loss_matches_closed_form(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy)
    batch = make_batch(policy)
    beta = 200.0
    loss, metrics = DDSPO(beta=beta, cpp="tf")(policy, batch, generator=torch.Generator().manual_seed(2))
    assert metrics["ref_loss/chosen"].item() == 0.0
    assert metrics["ref_loss/rejected"].item() > 0.0

    # docs/methods/algorithms.md#ddspo: z = -β/2 [‖θ(x^w,c) − ref(x^w,c)‖² − ‖θ(x^l,c) − ref(x^l,c⁻)‖² + ‖ref(x^l,c) −
    # ref(x^l,c⁻)‖²]
    t, eps = replay_draws(policy, batch, 2)
    xw, xl = policy.add_noise(batch.latents_w, eps, t), policy.add_noise(batch.latents_l, eps, t)
    c, cm = batch.prompt_embeds, batch.degraded_prompt_embeds
    theta_w, theta_l = unet_eps(policy, xw, t, c), unet_eps(policy, xl, t, c)
    with policy.reference():
        ref_w, ref_l, ref_lm = unet_eps(policy, xw, t, c), unet_eps(policy, xl, t, c), unet_eps(policy, xl, t, cm)

    def mse(a, b):
        return ((a - b) ** 2).mean(dim=(1, 2, 3))

    z = -beta / 2 * (mse(theta_w, ref_w) - mse(theta_l, ref_lm) + mse(ref_l, ref_lm))
    assert loss.item() == pytest.approx(torch.nn.functional.softplus(-z).mean().item(), rel=1e-5)
    assert metrics["model_loss/rejected"].item() == pytest.approx(mse(theta_l, ref_lm).mean().item(), rel=1e-5)


def test_pair_shares_noise_and_timestep(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy)
    calls = []
    add_noise = policy.add_noise
    policy.add_noise = lambda x, n, t: (calls.append((n.clone(), t.clone())), add_noise(x, n, t))[1]
    DDSPO(cpp="tf")(policy, make_batch(policy), generator=torch.Generator().manual_seed(0))
    ((noise, timesteps),) = calls
    assert torch.equal(noise[:3], noise[3:]) and torch.equal(timesteps[:3], timesteps[3:])
    assert not torch.equal(noise[0], noise[1])


# ------------------------------------------------------------------------------------------------ weights, rand_cond


def test_linear_weighting_hand_computed():
    # z = -β/2 [(0.1 - 0.2) - (0.3 - 0.2)] = 1 for β = 10 (both pairs); ω = (0.25, 1): loss = mean(ω) · log(1 + e^-1)
    ones = torch.ones(2)
    loss, metrics = ddspo_loss(0.1 * ones, 0.3 * ones, 0.2 * ones, 0.2 * ones, beta=10.0,
                               weights=torch.tensor([0.25, 1.0]))
    assert loss.item() == pytest.approx(0.625 * math.log1p(math.exp(-1.0)), abs=1e-6)
    assert metrics["loss"].item() == pytest.approx(loss.item())
    with pytest.raises(ValueError, match="one weight per pair"):
        ddspo_loss(ones, ones, ones, ones, beta=1.0, weights=torch.ones(3))


def test_linear_weighting_in_the_objective(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy)
    batch = make_batch(policy, bsz=1)  # one pair: the weighted loss is ω_t times the unweighted one
    uniform, _ = DDSPO(cpp="tf")(policy, batch, generator=torch.Generator().manual_seed(3))
    linear, _ = DDSPO(cpp="tf", loss_weighting="linear")(policy, batch, generator=torch.Generator().manual_seed(3))
    t, _ = replay_draws(policy, batch, 3)
    assert linear.item() == pytest.approx(uniform.item() * t.item() / 999, rel=1e-5)


def test_rand_cond_probability_schedules():
    t = torch.tensor([0, 700, 1000])
    torch.testing.assert_close(rand_cond_probability(t, 1000, "sigmoid", 20.0),
                               torch.tensor([1 / (1 + math.exp(14)), 0.5, 1 / (1 + math.exp(-6))]))
    torch.testing.assert_close(rand_cond_probability(t, 1000, "exponential", 20.0),
                               torch.tensor([math.exp(-20), math.exp(-6), 1.0]))
    assert torch.equal(rand_cond_probability(t, 1000, "constant"), torch.ones(3))


def test_rand_cond_replaced_pairs_use_cpp_targets_and_unpaired_prompts(perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy)
    batch = make_batch(policy)
    kwargs = {"rand_cond": True, "rand_cond_schedule": "constant"}
    tf, m_tf = DDSPO(cpp="tf", **kwargs)(policy, batch, generator=torch.Generator().manual_seed(5))
    off, _ = DDSPO(cpp="off", **kwargs)(policy, batch, generator=torch.Generator().manual_seed(5))
    assert m_tf["rand_cond_rate"].item() == 1.0
    assert torch.equal(tf, off)  # every pair replaced, so cpp=off uses TF-CPP targets everywhere too
    plain, _ = DDSPO(cpp="tf")(policy, batch, generator=torch.Generator().manual_seed(5))
    assert abs(plain.item() - tf.item()) > 1e-6  # the conditions did change

    # the batch-shift source: with s drawn after t, ε and u, every pair takes pair (i + s) mod B's prompts
    gen = torch.Generator().manual_seed(5)
    draw_timesteps_and_noise(policy, tuple(batch.latents_w.shape), 0, None, gen)
    torch.rand(3, generator=gen)
    shift = int(torch.randint(1, 3, (1,), generator=gen))
    order = [(i + shift) % 3 for i in range(3)]
    shifted = make_batch(policy)
    shifted.prompt_embeds = batch.prompt_embeds.index(torch.tensor(order))
    shifted.degraded_prompt_embeds = batch.degraded_prompt_embeds.index(torch.tensor(order))
    expected, _ = DDSPO(cpp="tf")(policy, shifted, generator=torch.Generator().manual_seed(5))
    assert tf.item() == pytest.approx(expected.item(), rel=1e-6)


def test_rand_cond_from_a_prompt_pool(tmp_path, perturb_lora):
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy)
    pool = tmp_path / "extra.jsonl"
    pool.write_text('{"prompt": "three red triangles", "degraded_prompts": ["three"]}\n')
    objective = DDSPO(cpp="tf", rand_cond=True, rand_cond_schedule="constant", rand_cond_prompts=str(pool))
    loss, metrics = objective(policy, make_batch(policy, bsz=1), generator=torch.Generator().manual_seed(0))
    one = make_batch(policy, bsz=1)
    one.prompt_embeds = policy.encode_prompts(["three red triangles"], do_classifier_free_guidance=False)
    one.degraded_prompt_embeds = policy.encode_prompts(["three"], do_classifier_free_guidance=False)
    expected, _ = DDSPO(cpp="tf")(policy, one, generator=torch.Generator().manual_seed(0))
    assert metrics["rand_cond_rate"].item() == 1.0
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


# ------------------------------------------------------------------------------------------------------------ DD-CPP


def test_dd_cpp_targets_are_the_target_loras(tmp_path, perturb_lora):
    for name, seed, rank in (("winner", 11, 2), ("loser", 12, 4)):  # any rank, independent of the policy's
        phi = build_tiny_random_policy(seed=0, lora_rank=rank)
        perturb_lora(phi, seed=seed)
        phi.save_lora_weights(tmp_path / name)
    policy = build_tiny_random_policy(seed=0)
    perturb_lora(policy)
    n_trainable = len(policy.trainable_parameters())
    objective = DDSPO(beta=8000.0, cpp="dd", target_lora_w=str(tmp_path / "winner"),
                      target_lora_l=str(tmp_path / "loser"))
    batch = make_batch(policy)
    with pytest.raises(ValueError, match="setup"):
        objective(policy, batch)
    before = unet_eps(policy, batch.latents_w, torch.tensor([500] * 3), batch.prompt_embeds)
    objective.setup(policy)
    assert len(policy.trainable_parameters()) == n_trainable
    torch.testing.assert_close(unet_eps(policy, batch.latents_w, torch.tensor([500] * 3), batch.prompt_embeds), before)

    loss, metrics = objective(policy, batch, generator=torch.Generator().manual_seed(7))
    assert torch.isfinite(loss)
    t, eps = replay_draws(policy, batch, 7)
    xw, xl = policy.add_noise(batch.latents_w, eps, t), policy.add_noise(batch.latents_l, eps, t)
    targets = {}
    for name, x in (("winner", xw), ("loser", xl)):
        phi = build_tiny_random_policy(seed=0, lora_rank=2 if name == "winner" else 4)
        phi.load_lora_weights(tmp_path / name)
        targets[name] = unet_eps(phi, x, t, batch.prompt_embeds)
    with policy.reference():
        ref_w, ref_l = unet_eps(policy, xw, t, batch.prompt_embeds), unet_eps(policy, xl, t, batch.prompt_embeds)
    assert metrics["ref_loss/chosen"].item() == pytest.approx(((ref_w - targets["winner"]) ** 2).mean().item(), rel=1e-5)
    assert metrics["ref_loss/rejected"].item() == pytest.approx(((ref_l - targets["loser"]) ** 2).mean().item(), rel=1e-5)
    loss.backward()
    assert all(p.grad is not None for p in policy.trainable_parameters())
    assert all(not p.requires_grad for p in objective.targets.params) and objective.targets.params


# -------------------------------------------------------------------------------------------------------- flow models


class FakeFlowPolicy:
    """The flow-model protocol (like the SD3 adapter): predict returns a velocity, x_σ = (1-σ)x₀ + σε, target ε − x₀,
    the network is fed t = 1000σ. A tiny UNet plays the transformer; its LoRA-disabled self is the reference."""

    prediction_type = "flow"

    def __init__(self, policy):
        self.inner = policy
        self.scheduler = policy.scheduler  # only config.num_train_timesteps (1000) is read

    def predict(self, latents, timesteps, prompt_embeds: PromptEmbeds, guidance_scale: float = 1.0):
        return self.inner.predict(latents, timesteps, prompt_embeds, guidance_scale)

    def add_noise(self, latents, noise, timesteps):
        sigma = (timesteps.float() / 1000).view(-1, 1, 1, 1)
        return (1 - sigma) * latents + sigma * noise

    def training_target(self, latents, noise, timesteps):
        return noise - latents

    @contextmanager
    def reference(self):
        with self.inner.reference():
            yield self


@pytest.mark.parametrize("cpp", ["tf", "off"])
def test_flow_x0_space_at_init_and_equivalence_with_velocity_space(cpp, perturb_lora):
    policy = FakeFlowPolicy(build_tiny_random_policy(seed=0))
    batch = make_batch(policy.inner, bsz=1)
    loss, _ = DDSPO(cpp=cpp, prediction_space="x0")(policy, batch, generator=torch.Generator().manual_seed(0))
    assert loss.item() == pytest.approx(LN2, abs=1e-6)

    # docs/methods/algorithms.md#forward-processes: ‖x̂₀ − x₀‖² = σ² ‖v̂ − u‖² per sample, and the CPP targets map the
    # same way
    perturb_lora(policy.inner)
    _, m_x0 = DDSPO(cpp=cpp, prediction_space="x0")(policy, batch, generator=torch.Generator().manual_seed(0))
    _, m_v = DDSPO(cpp=cpp, prediction_space="native")(policy, batch, generator=torch.Generator().manual_seed(0))
    t, _ = replay_draws(policy, batch, 0)
    sigma2 = (t.item() / 1000) ** 2
    for key in ("model_loss/chosen", "model_loss/rejected", "ref_loss/rejected"):
        assert m_x0[key].item() == pytest.approx(sigma2 * m_v[key].item(), rel=1e-4), key


# ------------------------------------------------------------------------------------------------------------ errors


def test_config_matches_init_and_bad_fields_are_named():
    cfg = DDSPOConfig()
    assert cfg._target_ == f"{DDSPO.__module__}.{DDSPO.__qualname__}"
    fields = {k: v for k, v in vars(cfg).items() if k != "_target_"}
    objective = DDSPO(**fields)
    assert objective.beta == 16000.0 and objective.cpp == "tf" and DDSPO.data_flow == "pairs"
    for kwargs, field in (({"beta": 0}, "method.beta"), ({"cpp": "both"}, "method.cpp"),
                          ({"loss_weighting": "sigmoid"}, "method.loss_weighting"),
                          ({"prediction_space": "eps"}, "method.prediction_space"),
                          ({"cpp": "dd"}, "method.target_lora_w"),
                          ({"timestep_min": 5, "timestep_max": 1}, "method.timestep_max")):
        with pytest.raises(ValueError, match=field):
            DDSPO(**kwargs)


def test_call_time_errors_name_the_fix():
    policy = build_tiny_random_policy(seed=0)
    batch = make_batch(policy)
    batch.degraded_prompt_embeds = None
    with pytest.raises(ValueError, match="data=ddspo_pairs"):
        DDSPO(cpp="tf")(policy, batch)
    DDSPO(cpp="off")(policy, batch)  # Diffusion-DPO targets need no c⁻
    with pytest.raises(ValueError, match="prediction_space=native"):
        DDSPO(cpp="off", prediction_space="x0")(policy, batch)
    one = make_batch(policy, bsz=1)
    with pytest.raises(ValueError, match="batch_size >= 2"):
        DDSPO(rand_cond=True, rand_cond_schedule="constant")(policy, one)


@pytest.mark.slow
def test_ddcpp_targets_command_writes_loras_that_ddspo_loads(tmp_path):
    """``diffalign-ddcpp-targets`` (its entry point, run in this process: a child's start is not what is checked)."""
    from hydra.core.global_hydra import GlobalHydra

    from diffalign.train import ddcpp_targets

    out = tmp_path / "ddcpp"
    args = ["--out", str(out), "--steps", "2", "--batch-size", "2", "--rank", "2", "--device", "cpu", "--",
            "model=tiny_random", "data=shapes_pairs", "data.num_pairs=4"]
    GlobalHydra.instance().clear()
    ddcpp_targets.main(args)
    policy = build_tiny_random_policy(seed=0)
    objective = DDSPO(cpp="dd", beta=8000.0, target_lora_w=str(out / "winner"), target_lora_l=str(out / "loser"))
    objective.setup(policy)
    loss, _ = objective(policy, make_batch(policy), generator=torch.Generator().manual_seed(0))
    assert loss.item() == pytest.approx(LN2, abs=1e-6)  # policy = reference; the targets differ from both
