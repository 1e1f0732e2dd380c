"""Offline preference pairs (Pick-a-Pic style rows) and a resumable batch sampler.

Row format (one dict per comparison, as in ``yuvalkirstain/pickapic_v2``):
``{"prompt": str, "image_0": image, "image_1": image, "label_0": 0 | 0.5 | 1}`` where ``label_0`` is the preference
for ``image_0``: 1 → image_0 wins, 0 → image_1 wins, 0.5 → tie. Images are uint8 `(H, W, C)` numpy arrays, float
`(C, H, W)` tensors in [0, 1], or PIL images.
"""

from __future__ import annotations

import logging
import numbers
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch
from PIL import Image

logger = logging.getLogger(__name__)

_REQUIRED_KEYS = ("prompt", "image_0", "image_1", "label_0")


class PreferenceData(Protocol):
    """What the preference loop (`diffalign.train.preference`) asks of a data set built from ``cfg.data``.

    ``prepare(policy, rewards)`` runs once before training (on-policy data such as `RankedPairs` samples and judges
    here; static data does nothing), then ``stats`` (a dict, empty for static data) is logged and ``len`` fixes the
    sampler; ``collate(indices)`` returns ``{"ids" (B,), "prompts", "images_w" (B, 3, H, W) in [0, 1] or "latents_w"
    (B, C, h, w)}`` plus the losers' ``images_l`` / ``latents_l`` for pairs and optionally ``degraded_prompts``. A data
    class may also define the classmethod ``check_config(cfg)``, which `diffalign.config.validation` runs before any
    model loads.
    """

    stats: dict

    def prepare(self, policy, rewards: dict) -> None: ...

    def __len__(self) -> int: ...

    def collate(self, indices: list[int]) -> dict[str, Any]: ...


def to_image_tensor(image: Any, where: str) -> torch.Tensor:
    """Converts one image to a float32 `(C, H, W)` tensor in [0, 1].

    Args:
        image: a uint8 `(H, W, C)` numpy array, a float `(C, H, W)` tensor in [0, 1], or a PIL image (converted to
            RGB).
        where (`str`): description of the source used in error messages, e.g. ``"row 3 image_1"``.

    Raises:
        ValueError: for another type, a non-uint8 array, a wrong number of dimensions or a tensor outside [0, 1].
    """
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    if isinstance(image, np.ndarray):
        if image.dtype != np.uint8 or image.ndim != 3:
            raise ValueError(
                f"{where}: numpy images must be uint8 (H, W, C); got dtype {image.dtype} with shape {image.shape}."
            )
        return torch.from_numpy(np.ascontiguousarray(image)).permute(2, 0, 1).float() / 255.0
    if isinstance(image, torch.Tensor):
        if image.ndim != 3 or not image.is_floating_point():
            raise ValueError(
                f"{where}: tensor images must be float (C, H, W) in [0, 1]; got {image.dtype} {tuple(image.shape)}."
            )
        if not torch.isfinite(image).all() or image.min() < 0 or image.max() > 1:
            raise ValueError(f"{where}: tensor image values must be finite and in [0, 1]; rescale it first.")
        return image.float()
    raise ValueError(f"{where}: unsupported image type {type(image).__name__}; use a uint8 HWC array or CHW tensor.")


class PreferencePairs:
    """Preference pairs ``(prompt, image_w, image_l, id)`` ordered winner-first, ties never counted as wins
    (docs/guides/field_cases.md#preference-ties-and-winner-order).

    Follows the Diffusion-DPO data preparation (arXiv:2311.12908 §5; its ``train.py``): ties are removed, and the
    images are swapped only when ``label_0 == 0``. The id of a pair is the index of its row in `rows`, so ids stay
    stable when ties are removed.

    Args:
        rows (`Sequence[dict]`): rows with keys ``prompt``, ``image_0``, ``image_1``, ``label_0``.
        keep_ties (`bool`, defaults to `False`): keep tied rows in `ties` (as ``(prompt, image_0, image_1, id)``)
            instead of dropping them. Ties never become pairs: a tie has no winner.
        load_image (`Callable[[Any, str], torch.Tensor]`, defaults to `to_image_tensor`): turns a row's image value
            into a float32 `(C, H, W)` tensor in [0, 1] when a pair is read (so images can stay as bytes or paths
            until then); its second argument describes the image for error messages.

    Attributes:
        ties (`list[tuple]`): the tied rows when `keep_ties`, else empty.
        num_ties (`int`): number of tied rows found (dropped unless `keep_ties`).

    Raises:
        ValueError: naming the row, if a key is missing or ``label_0`` is not one of 0, 0.5, 1.
    """

    def __init__(
        self,
        rows: Sequence[dict[str, Any]],
        keep_ties: bool = False,
        load_image: Callable[[Any, str], torch.Tensor] = to_image_tensor,
    ):
        self.load_image = load_image
        self._pairs: list[tuple[str, Any, Any, int]] = []
        self.ties: list[tuple[str, Any, Any, int]] = []
        self.num_ties = 0
        for row_id, row in enumerate(rows):
            missing = [key for key in _REQUIRED_KEYS if key not in row]
            if missing:
                raise ValueError(
                    f"preference row {row_id} lacks keys {missing}; each row needs {list(_REQUIRED_KEYS)}."
                )
            label = row["label_0"]
            if isinstance(label, bool) or not isinstance(label, numbers.Real) or float(label) not in (0.0, 0.5, 1.0):
                raise ValueError(
                    f"preference row {row_id} has label_0={label!r}; expected 1 (image_0 wins), 0 (image_1 wins) or "
                    "0.5 (tie). Fix or filter the row."
                )
            if label == 0.5:
                self.num_ties += 1
                if keep_ties:
                    self.ties.append((row["prompt"], row["image_0"], row["image_1"], row_id))
            elif label == 1:
                self._pairs.append((row["prompt"], row["image_0"], row["image_1"], row_id))
            else:
                self._pairs.append((row["prompt"], row["image_1"], row["image_0"], row_id))
        if self.num_ties and not keep_ties:
            logger.info("%d tie%s dropped", self.num_ties, "" if self.num_ties == 1 else "s")

    @property
    def num_ties_dropped(self) -> int:
        """Tied rows removed from the data (0 when `keep_ties`)."""
        return 0 if self.ties else self.num_ties

    def __len__(self) -> int:
        return len(self._pairs)

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor, torch.Tensor, int]:
        """Returns ``(prompt, image_w, image_l, id)`` with float32 `(C, H, W)` images in [0, 1]."""
        prompt, image_w, image_l, row_id = self._pairs[index]
        return (
            prompt,
            self.load_image(image_w, f"row {row_id} winner"),
            self.load_image(image_l, f"row {row_id} loser"),
            row_id,
        )

    def winner(self, index: int) -> tuple[str, torch.Tensor, int]:
        """Returns ``(prompt, image_w, id)`` without reading the loser."""
        prompt, image_w, _, row_id = self._pairs[index]
        return prompt, self.load_image(image_w, f"row {row_id} winner"), row_id

    def collate(self, indices: Sequence[int], winners_only: bool = False) -> dict[str, Any]:
        """Stacks the pairs at `indices` into a batch.

        Args:
            indices (`Sequence[int]`): pair indices.
            winners_only (`bool`, defaults to False): leave out (and do not read) the losers.

        Returns:
            `dict` with ``prompts`` (`list[str]`), ``images_w`` and, unless `winners_only`, ``images_l`` (`(B, C, H,
            W)` float32 in [0, 1]; map to [-1, 1] with ``2x - 1`` before VAE encoding) and ``ids`` (`(B,)` int64 row
            ids).

        Raises:
            ValueError: if the images of the batch differ in shape (resize/crop them beforehand).
        """
        if winners_only:
            items = [self.winner(i) for i in indices]
            images = [item[1] for item in items]
        else:
            items = [self[i] for i in indices]
            images = [image for item in items for image in item[1:3]]
        shapes = {tuple(image.shape) for image in images}
        if len(shapes) != 1:
            raise ValueError(f"pairs {list(indices)} have images of shapes {sorted(shapes)}; resize them to one size.")
        batch = {
            "prompts": [item[0] for item in items],
            "images_w": torch.stack([item[1] for item in items]),
            "ids": torch.tensor([item[-1] for item in items], dtype=torch.long),
        }
        if not winners_only:
            batch["images_l"] = torch.stack([item[2] for item in items])
        return batch


class ResumableSampler:
    """Epoch-wise batches of dataset indices whose position survives a checkpoint (accelerate's
    loaders once replayed a different order after a resume:
    docs/guides/field_cases.md#mid-epoch-resume-replays-the-data-order).

    Epoch ``e`` uses the permutation ``torch.randperm(num_items, generator=torch.Generator().manual_seed(seed + e))``
    (or ``0..num_items-1`` without shuffle), cut into consecutive batches. Iterating yields the *remaining* batches
    of the current epoch and then advances to the next epoch, so an epoch-based loop reads::

        while sampler.epoch < num_epochs:
            for indices in sampler:
                ...  # train; save sampler.state_dict() with the checkpoint

    and a step-based loop calls `next_batch()` once per micro-batch.

    The position counts a batch as consumed as soon as it is yielded, so a state saved while processing it resumes
    at the following batch.

    Args:
        num_items (`int`): dataset length, ≥ 1.
        batch_size (`int`): indices per batch, ≥ 1 (per process).
        seed (`int`): base seed of the permutations.
        shuffle (`bool`, defaults to `True`): permute each epoch.
        drop_last (`bool`, defaults to `True`): drop the last incomplete batch of an epoch.

    Raises:
        ValueError: if `num_items` or `batch_size` < 1, or `drop_last` leaves no batch.
    """

    def __init__(self, num_items: int, batch_size: int, seed: int, shuffle: bool = True, drop_last: bool = True):
        if num_items < 1:
            raise ValueError(f"num_items={num_items} must be ≥ 1; the preference dataset is empty.")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be ≥ 1.")
        if drop_last and batch_size > num_items:
            raise ValueError(
                f"batch_size={batch_size} exceeds num_items={num_items} with drop_last=True, so an epoch has no batch; "
                "lower the batch size or set drop_last=False."
            )
        self.num_items, self.batch_size, self.seed = num_items, batch_size, seed
        self.shuffle, self.drop_last = shuffle, drop_last
        self.epoch = 0
        self.position = 0

    def __len__(self) -> int:
        """Batches per epoch."""
        full, rest = divmod(self.num_items, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def epoch_order(self, epoch: int) -> list[int]:
        """The index order of `epoch` (all `num_items` indices, before batching)."""
        if not self.shuffle:
            return list(range(self.num_items))
        return torch.randperm(self.num_items, generator=torch.Generator().manual_seed(self.seed + epoch)).tolist()

    def __iter__(self) -> Iterator[list[int]]:
        order = self.epoch_order(self.epoch)
        while self.position < len(self):
            start = self.position * self.batch_size
            self.position += 1
            yield order[start : start + self.batch_size]
        self.epoch += 1
        self.position = 0

    def next_batch(self) -> list[int]:
        """The next batch, moving on to the next epoch when the current one is exhausted (for step-based loops).

        Interleaves exactly with iteration: ``next_batch()`` after a state where ``position == len(self)`` starts
        epoch ``epoch + 1`` at its first batch.

        Returns:
            `list[int]`: `batch_size` dataset indices (fewer only for the last batch of an epoch without
            `drop_last`).
        """
        if self.position >= len(self):
            self.epoch += 1
            self.position = 0
        order = self.epoch_order(self.epoch)
        start = self.position * self.batch_size
        self.position += 1
        return order[start : start + self.batch_size]

    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position"}``: the current epoch and the number of its batches already yielded."""
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Restores a `state_dict`; the sampler must be built with the same arguments as the saved one.

        Raises:
            ValueError: if keys are missing or the position is outside ``0..len(self)``.
        """
        if set(state) != {"epoch", "position"}:
            raise ValueError(f"sampler state has keys {sorted(state)}; expected ['epoch', 'position'].")
        if not 0 <= state["position"] <= len(self) or state["epoch"] < 0:
            raise ValueError(
                f"sampler state {state} does not fit {len(self)} batches per epoch; was the batch size or data changed?"
            )
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
