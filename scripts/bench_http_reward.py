"""How much of a served reward's time the online loop hides behind the rollouts
(docs/guides/rewards.md#rewards-served-over-http).

Serves a stand-in judge on loopback (``brightness`` after a sleep of ``--ms-per-image`` per image: the time a remote
model would take, spent off this machine's CPU) and runs short tiny-model Flow-GRPO jobs with ``reward=[http]``,
alternately with the overlap (each rollout batch of ``--rollout-batch`` images sent while the next is sampled) and
without it (the whole epoch scored after its rollouts, as a synchronous reward is), and prints the epoch times and the
last epoch's reward mean (equal in both modes).

    OMP_NUM_THREADS=1 python scripts/bench_http_reward.py
    OMP_NUM_THREADS=1 python scripts/bench_http_reward.py --ms-per-image 200 --groups 8 --repeats 3

Dev tool only; never imported by the package.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra

from diffalign.config.compose import CONFIG_DIR, setup_hydra
from diffalign.rewards import futures
from diffalign.rewards.brightness import Brightness
from diffalign.rewards.server import RewardServer
from diffalign.train.online import train


class SlowJudge:
    """`brightness` after sleeping `seconds_per_image` per image."""

    name, differentiable = "slow_judge", False

    def __init__(self, seconds_per_image: float):
        self.seconds_per_image = seconds_per_image

    def __call__(self, images, prompts, metadata=None):
        time.sleep(self.seconds_per_image * len(images))
        return Brightness()(images, prompts)


def run(url: str, out: Path, args: argparse.Namespace) -> tuple[list[float], float]:
    """Epoch seconds and the last epoch's reward mean of one tiny Flow-GRPO run scored by the server at `url`."""
    setup_hydra()
    GlobalHydra.instance().clear()
    overrides = [f"output_dir={out}", "model=tiny_random", "method=flow_grpo", "sampler=ddim",
                 f"online.num_epochs={args.epochs}", f"online.groups_per_epoch={args.groups}", "online.group_size=4",
                 f"online.rollout_batch_size={args.rollout_batch}", f"trainer.batch_size={4 * args.groups}",
                 "sampler.num_inference_steps=4", "online.checkpointing_epochs=0", "trainer.log_with=none",
                 "eval.enabled=false", "reward=[http]", f"reward.http.url={url}", "reward.http.image_format=float32"]
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    train(cfg)
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return [h["epoch_seconds"] for h in history], history[-1]["reward/http/mean"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ms-per-image", type=float, default=50.0, help="the judge's time per image")
    parser.add_argument("--groups", type=int, default=4, help="prompts per epoch (4 samples each)")
    parser.add_argument("--rollout-batch", type=int, default=4, help="online.rollout_batch_size")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    server = RewardServer(SlowJudge(args.ms_per_image / 1000), ("127.0.0.1", 0))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    has_submit = futures.has_submit
    times: dict[str, list[float]] = {"overlapped": [], "after the rollouts": []}
    rewards = set()
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in times:  # alternately, so that both see the same machine state
                futures.has_submit = has_submit if mode == "overlapped" else (lambda reward: False)
                seconds, reward = run(server.url, Path(tmp) / f"{mode.split()[0]}-{repeat}", args)
                times[mode] += seconds
                rewards.add(round(reward, 9))
    futures.has_submit = has_submit
    server.shutdown()
    judge = args.ms_per_image / 1000 * 4 * args.groups
    print(f"\n{4 * args.groups} images per epoch in rollout batches of {args.rollout_batch}; the judge takes "
          f"{judge:.2f} s per epoch")
    for mode, seconds in times.items():
        print(f"scored {mode:>18}: median epoch {statistics.median(seconds):.2f} s over {len(seconds)} epochs")
    print(f"last-epoch reward means: {sorted(rewards)} (one value: both modes train identically)")


if __name__ == "__main__":
    main()
