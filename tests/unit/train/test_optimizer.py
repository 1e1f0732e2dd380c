"""The optimizer is the ``trainer.optimizer`` node (``_target_``, built with `hydra.utils.instantiate`) and the LR
schedule is `diffusers.optimization.get_scheduler`'s, stepped after each update as the diffusers training scripts and
Diffusion-DPO's released ``train.py`` step it: each LR below is written out by hand from that formula (``s / W``
warmup, so the first update of a warmed-up run has LR 0; then constant or a half cosine), not recomputed with it."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import compose_cfg
from omegaconf import OmegaConf

from diffalign.config.checks import ConfigError, check_renamed_keys
from diffalign.config.validation import validate_train_config
from diffalign.train.checks import LR_SCHEDULERS
from diffalign.train.common import build_lr_scheduler, build_optimizer, prepare_training

# (kind, warmup, total updates) -> the LR factor before each update, by hand
HAND = {
    ("constant_with_warmup", 0, 4): [1.0, 1.0, 1.0, 1.0],
    ("constant_with_warmup", 3, 6): [0.0, 1 / 3, 2 / 3, 1.0, 1.0, 1.0],
    # warmup 0, ½; then the half cosine over the 4 steps after warmup: cos(0), cos(π/4), cos(π/2), cos(3π/4) → ½(1 + ·)
    ("cosine", 2, 6): [0.0, 0.5, 1.0, 0.5 + math.sqrt(2) / 4, 0.5, 0.5 - math.sqrt(2) / 4],
    ("cosine", 0, 4): [1.0, 0.5 + math.sqrt(2) / 4, 0.5, 0.5 - math.sqrt(2) / 4],
}


def _lrs(kind: str, warmup: int, total: int, build=build_lr_scheduler) -> list[float]:
    """The LR before each of `total` updates of a fresh AdamW with lr 2, as the loops step it, under the scheduler
    ``build(optimizer, warmup, total, kind)``."""
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    scheduler = build(optimizer, warmup, total, kind)
    seen = []
    for _ in range(total):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_every_lr_schedule_gives_the_hand_sequence():
    assert {kind for kind, _, _ in HAND} == set(LR_SCHEDULERS)
    for (kind, warmup, total), factors in HAND.items():
        assert _lrs(kind, warmup, total) == pytest.approx([2.0 * f for f in factors], abs=1e-12), (kind, warmup)


def test_a_warmed_up_runs_first_update_changes_no_weight_as_in_the_released_code():
    """Diffusion-DPO's released ``train.py`` (diffusers' `get_scheduler`, stepped after ``optimizer.step()``) makes
    its first warmed-up update with LR 0: plain SGD (no moments) then leaves the weight where it was, and the second
    update moves it by lr · (1 / W) · grad."""
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=2.0)
    scheduler = build_lr_scheduler(optimizer, 4, 8, "constant_with_warmup")
    moved = []
    for _ in range(2):
        optimizer.zero_grad()
        (3.0 * weight).sum().backward()  # gradient 3
        optimizer.step()
        scheduler.step()
        moved.append(weight.item())
    assert moved == pytest.approx([0.0, -2.0 * (1 / 4) * 3.0], abs=1e-12)


def test_the_default_optimizer_is_adamw_with_the_nodes_values():
    cfg = compose_cfg(["trainer.optimizer.lr=3e-4", "trainer.optimizer.betas=[0.8,0.95]",
                       "trainer.optimizer.weight_decay=0.01", "trainer.optimizer.eps=1e-6"])
    assert cfg.trainer.optimizer._target_ == "torch.optim.AdamW"
    param = torch.nn.Parameter(torch.zeros(2))
    optimizer = build_optimizer(cfg.trainer.optimizer, [param])
    assert type(optimizer) is torch.optim.AdamW and optimizer.param_groups[0]["params"][0] is param
    group = optimizer.param_groups[0]
    assert (group["lr"], tuple(group["betas"]), group["weight_decay"], group["eps"]) == (3e-4, (0.8, 0.95), 0.01, 1e-6)


class _Policy:
    """What `prepare_training` uses of a policy: a denoiser and its trainable parameters."""

    def __init__(self):
        self.denoiser = torch.nn.Linear(2, 1, bias=False)
        with torch.no_grad():
            self.denoiser.weight.copy_(torch.tensor([[1.0, -2.0]]))

    def trainable_parameters(self):
        return list(self.denoiser.parameters())

    def set_forward_module(self, module):
        self.denoiser = module


def test_another_optimizer_is_selected_with_its_target(tmp_path):
    """torch.optim.SGD with momentum through the loops' own `prepare_training`: one update moves the weight by
    -lr · grad (SGD's first momentum buffer is the gradient itself), the LR schedule applying its first factor (1
    without warmup)."""
    from accelerate import Accelerator

    cfg = compose_cfg([f"output_dir={tmp_path}", "trainer.log_with=none", "trainer.cpu=true",
                       "trainer.optimizer._target_=torch.optim.SGD", "~trainer.optimizer.betas",
                       "~trainer.optimizer.eps", "+trainer.optimizer.momentum=0.9", "trainer.optimizer.lr=0.5",
                       "trainer.lr_warmup_steps=0"])
    validate_train_config(cfg)
    policy = _Policy()
    params, optimizer, scheduler = prepare_training(Accelerator(cpu=True), policy, cfg.trainer, total_updates=4)
    assert isinstance(optimizer.optimizer, torch.optim.SGD) and optimizer.param_groups[0]["momentum"] == 0.9
    assert scheduler.get_last_lr() == [0.5]
    policy.denoiser(torch.tensor([[3.0, 1.0]])).sum().backward()  # d/dw (w · x) = x = (3, 1)
    optimizer.step()
    # factor 1 on lr 0.5: w = (1, -2) - 0.5 · (3, 1)
    assert params[0].detach().tolist() == [[1.0 - 1.5, -2.0 - 0.5]]


@pytest.mark.parametrize("overrides,expected", [
    (["trainer.optimizer._target_=torch.optim.SGD"],
     r"^trainer.optimizer.betas is not an argument of torch.optim.SGD; drop it with ~trainer.optimizer.betas"),
    (["trainer.optimizer._target_=torch.optim.NoSuchAdam"],
     r"^trainer.optimizer._target_=torch.optim.NoSuchAdam cannot be imported"),
    (["trainer.optimizer.lr=0"], r"^trainer.optimizer.lr must be a number > 0, got 0"),
    (["trainer.optimizer.betas=[0.9,1.0]"], r"^trainer.optimizer.betas must be two numbers in \[0, 1\)"),
    (["trainer.optimizer.eps=0"], r"^trainer.optimizer.eps must be a number > 0, got 0"),
    # an old key added with + (as Hydra's refusal of the bare override suggests) names its new key
    (["+trainer.learning_rate=1e-3"], r"^trainer.learning_rate was renamed: set trainer.optimizer.lr instead"),
    (["+trainer.adam_beta2=0.99"], r"^trainer.adam_beta2 was renamed: set trainer.optimizer.betas \(the second"),
])
def test_a_bad_optimizer_node_is_refused_before_any_work(tmp_path, overrides, expected):
    cfg = compose_cfg([f"output_dir={tmp_path}", "trainer.log_with=none", *overrides])
    with pytest.raises(ConfigError, match=expected) as refused:
        validate_train_config(cfg)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("override,new", [("trainer.learning_rate=1e-3", "trainer.optimizer.lr"),
                                          ("+trainer.adam_weight_decay=0", "trainer.optimizer.weight_decay"),
                                          ("~trainer.adam_epsilon", "trainer.optimizer.eps")])
def test_an_old_key_on_the_command_line_names_the_new_one(override, new):
    with pytest.raises(ConfigError, match=f"was renamed: set {new} instead"):
        check_renamed_keys(["recipe=tiny_dpo", override])
    check_renamed_keys(["trainer.optimizer.lr=1e-3", "recipe=tiny_dpo"])  # the new keys pass


def test_no_shipped_recipe_sets_an_old_key():
    """Every recipe composes (an old key in a recipe fails Hydra's merge into the structured trainer node)."""
    from pathlib import Path

    from diffalign.config.compose import CONFIG_DIR

    for recipe in sorted(Path(CONFIG_DIR, "recipe").glob("*.yaml")):
        node = OmegaConf.load(recipe).get("trainer") or {}
        old = {"learning_rate", "adam_beta1", "adam_beta2", "adam_weight_decay", "adam_epsilon"}
        assert not old & set(node), recipe
