"""On-policy samples for data sets made by the policy before training (`FailurePairs`, `RankedPairs`): every prompt
sampled ``samples_per_prompt`` times, each sample from its own seeded generator, and judged by a reward."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from diffalign.methods import stream_seed
from diffalign.rewards.reward_set import submit
from diffalign.samplers.base import Sampler, build_sampler
from diffalign.samplers.rollout import rollout
from diffalign.world.prompts import load_prompts

_DATA_STREAM = 0xDA7A  # stream tag of on-policy data samples (`stream_seed`'s last field)


def sample_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The generator seed of on-policy data sample `sample_index` of prompt `prompt_index`: a 63-bit
    ``stream_seed(seed, prompt_index, sample_index, 0, 0xDA7A)``. Evaluation seeds image ``(s, p)`` with
    ``s * 1_000_003 + p`` (below 2^31 for any practical s, p), so a training sample never starts from the initial
    noise of an evaluated image (with the deterministic DDIM sampler the noise fixes much of the layout)."""
    return stream_seed(seed, prompt_index, sample_index, 0, _DATA_STREAM)


@dataclass
class JudgedSamples:
    """``images`` `(N, 3, H, W)` float32 in [0, 1] on the CPU, in job order (prompt 0's samples 0..g-1, then prompt 1's,
    ...); ``jobs`` the N ``(prompt_index, sample_index)``; ``scores`` `(N,)` float32; ``correct`` `(N,)` bool when the
    reward reports correctness (``info["correct"]``), else None."""

    images: torch.Tensor
    jobs: list[tuple[int, int]]
    scores: torch.Tensor
    correct: torch.Tensor | None


@torch.no_grad()
def sample_and_judge(policy, rows: list[dict], samples_per_prompt: int, reward, *, sampler: Sampler, batch_size: int,
                     seed: int, require_correct: str | None = None, preparation=None,
                     reward_name: str | None = None) -> JudgedSamples:
    """Samples ``samples_per_prompt`` images per row of `rows` (sample ``j`` of prompt ``i`` from a generator seeded
    with ``sample_seed(seed, i, j)``, by `sampler`), in batches of `batch_size`, and scores each batch with `reward` ``(images, prompts, rows)``.

    With a `preparation` (`diffalign.data.resumable.Preparation`, given by the training loop) every batch is a chunk
    written to the run folder as it is made, a chunk already there is read back instead of sampled again (a killed run
    continues where it stopped, with exactly the data of an uninterrupted run), a tqdm bar shows the progress, and a
    stop signal ends the preparation after the current chunk.

    A reward with a ``submit`` (a reward server, `diffalign.rewards.http`) judges batch k while batch k + 1 is sampled
    (`diffalign.rewards.reward_set.submit`); the data are the same.

    Raises:
        ValueError: with the message `require_correct`, when it is given and a batch's reward output reports no
            per-sample correctness (checked on every batch, so it stops after the first one).
    """
    jobs = [(i, j) for i in range(len(rows)) for j in range(samples_per_prompt)]
    starts = list(range(0, len(jobs), batch_size))
    store = None
    if preparation is not None:
        store = preparation.store("onpolicy-samples", {
            "rows": rows, "samples_per_prompt": samples_per_prompt, "sampler": dataclasses.asdict(sampler),
            "batch_size": batch_size,
            "seed": seed, "reward": reward_name, "data_stream": _DATA_STREAM}, len(starts))
    bar = tqdm(total=len(jobs), desc="on-policy data", unit="image",
               disable=preparation is None or not preparation.progress)
    images, scores, correct = [], [], []

    def finish(k: int, size: int, stored: dict | None, batch: torch.Tensor | None, future) -> None:
        if stored is None:  # judged now: keep and save it
            out = future.result()
            stored = {"images": batch, "scores": out.scores.float().cpu()}
            if "correct" in out.info:
                stored["correct"] = torch.as_tensor(out.info["correct"]).bool().cpu()
            if store is not None:
                store.save(k, stored)
        if require_correct is not None and "correct" not in stored:
            raise ValueError(require_correct)
        images.append(stored["images"])
        scores.append(stored["scores"])
        correct.append(stored.get("correct"))
        bar.update(size)
        if preparation is not None:
            if k + 1 == len(starts):
                bar.close()
            try:
                preparation.after_chunk(k + 1, len(starts), store.folder)
            except BaseException:
                bar.close()
                raise

    # a reward that scores in the background (a reward server) judges chunk k while chunk k + 1 is sampled; any other
    # reward is called at once (`submit`), so its chunk is finished before the next one is sampled, as before
    waiting = None  # the arguments of `finish` for the chunk being judged
    for k, start in enumerate(starts):
        chunk = jobs[start:start + batch_size]
        stored = store.load(k) if store is not None else None
        batch = future = None
        if stored is None:
            prompts = [rows[i]["prompt"] for i, _ in chunk]
            gens = [torch.Generator().manual_seed(sample_seed(seed, i, j)) for i, j in chunk]
            batch = rollout(policy, prompts, sampler, generator=gens, fuse_lora=True).images.float().cpu()
            future = submit(reward, batch, prompts, [rows[i] for i, _ in chunk])
        if waiting is not None:
            finish(*waiting)
            waiting = None
        if future is not None and not future.done():
            waiting = (k, len(chunk), stored, batch, future)
        else:
            finish(k, len(chunk), stored, batch, future)
    if waiting is not None:
        finish(*waiting)
    bar.close()
    has_correct = all(c is not None for c in correct)
    return JudgedSamples(torch.cat(images), jobs, torch.cat(scores), torch.cat(correct) if has_correct else None)


def spaced_rows(rows: list[dict], n: int) -> list[dict]:
    """`n` rows evenly spaced through `rows` (``rows[i * len(rows) // n]``), or cycling through them when `n` is larger."""
    return [rows[(i * len(rows)) // n if n <= len(rows) else i % len(rows)] for i in range(n)]


class PreparedPairs:
    """The pair store of a data set made by `prepare(policy, rewards)` (`FailurePairs`, `RankedPairs`): subclasses fill
    ``self.pairs`` (dicts with ``id``, ``prompt``, ``image_w``, ``image_l`` and optionally ``metadata``) in `prepare`."""

    pairs: list[dict] | None = None

    @classmethod
    def check_config(cls, cfg) -> None:
        """Checks of a run config before any model loads (`diffalign.config.validation`): the prompt file, and a
        judging reward (``data.reward``) that is among the selected training rewards.

        Raises:
            ValueError, FileNotFoundError: naming the field and the fix.
        """
        from diffalign.config.checks import choice, integer, seed, target_attribute

        d = cfg.data
        integer(d, "num_prompts", "data", ge=1, nullable=True)  # (null: every prompt, failure_pairs)
        integer(d, "samples_per_prompt", "data", ge=1)
        if d.get("sampler") is not None:
            build_sampler(d.sampler, "data.sampler")
        integer(d, "batch_size", "data", ge=1)
        seed(d, "seed", "data")
        choice(d, "losers", "data", ("failures", "all"))
        load_prompts(cfg.data.prompts, field="data.prompts")
        if isinstance(cfg.data.reward, str) and cfg.data.reward not in (cfg.reward or {}):
            raise ValueError(f"data.reward={cfg.data.reward!r} (the reward that judges the on-policy samples) is not "
                             f"among the selected rewards {sorted(cfg.reward or {})}; add it with "
                             f"reward=[{cfg.data.reward}] or set data.reward to one of them")
        target = ((cfg.reward or {}).get(cfg.data.reward) or {}).get("_target_") if isinstance(cfg.data.reward, str) \
            else None
        if (getattr(cls, "requires_correctness", False) and target and target.startswith("diffalign.rewards.")
                and not target_attribute(target, "judges_correctness")):
            raise ValueError(f"data.reward={cfg.data.reward!r} does not report per-sample correctness (info['correct']"
                             f"), which data={cls.__name__} needs to tell failures from successes; pass a verifier "
                             "reward, e.g. data.reward=geneval_shapes with reward=[geneval_shapes]")

    def __len__(self) -> int:
        if self.pairs is None:
            raise RuntimeError(f"{type(self).__name__}.prepare(policy, rewards) must run before the pairs are used")
        return len(self.pairs)

    def __getitem__(self, k: int) -> dict:
        return self.pairs[k]

    def collate(self, indices: list[int]) -> dict:
        """Stacks pairs into ``{"ids" (B,), "prompts", "images_w" (B,3,H,W), "images_l" (B,3,H,W)}``, plus
        ``"metadata"`` when the pairs carry it."""
        items = [self.pairs[k] for k in indices]
        batch = {"ids": torch.tensor([it["id"] for it in items], dtype=torch.long),
                 "prompts": [it["prompt"] for it in items]}
        if items and "metadata" in items[0]:
            batch["metadata"] = [it["metadata"] for it in items]
        batch["images_w"] = torch.stack([it["image_w"] for it in items])
        batch["images_l"] = torch.stack([it["image_l"] for it in items])
        return batch
