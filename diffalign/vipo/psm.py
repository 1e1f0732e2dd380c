r"""ViPO's Perceptual Structuring Module (PSM) and advantage maps (docs/methods/algorithms.md#vipo-perceptual-maps;
arXiv:2511.18719 Eq. 5–8).

For each decoded sample (each frame of a video):

1. patch tokens F ∈ R^{N×d} from a frozen backbone (`diffalign.vipo.backbones`);
2. PCA of the mean-centred tokens, K components (default 3): projections z_j and explained-variance ratios λ_j. The
   sign of a principal axis is arbitrary; diffalign fixes it as scikit-learn ≥ 1.5 does (`svd_flip` on the axes: the
   loading of largest magnitude of each axis is positive), so the map is deterministic;
3. aggregation into one patch-grid map S: ``"weighted"`` (the released code) Σ_j λ_j z'_j clipped to [0, 1], with each
   component normalised *reversed*, z'_j = (max z_j − z_j)/(max z_j − min z_j) (``orientation="reverse"``, as both
   official training scripts; ``"forward"`` flips it); ``"average"`` the mean of the z'_j; ``"first"`` z'_1 only;
4. Gaussian smoothing on the patch grid (σ = 1; 0 disables), min-max normalisation. The smoothing follows
   `scipy.ndimage.gaussian_filter`, which both released scripts call with its defaults: mode "reflect" (the border
   sample repeated, d c b a | a b c d | d c b a) and a kernel of radius int(4σ + 0.5) (``padding="reflect"``,
   ``truncate=4``); ``padding="replicate", truncate=3`` is diffalign's earlier smoothing;
5. antialiased bilinear resampling to the latent grid (h, w), min-max normalisation;
6. video: the per-frame maps (F, h, w) are resampled (trilinear) to the latent frame count F_lat, smoothed along time
   with a Gaussian (σ = 0.3, the same padding and truncate), and min-max normalised over the whole volume;
7. any failure (an exception, a non-finite value, or a constant map with nothing to normalise) gives an all-ones map
   for that sample, i.e. plain GRPO for it; the number of such fallbacks is reported.

Advantage maps (Eq. 8): A_i^p = clip(M_i(p) · A_i, ±5). Since M ≥ 0 the sign of A_i is kept at every position.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

AGGREGATIONS = ("weighted", "average", "first")
ORIENTATIONS = ("reverse", "forward")
PADDINGS = ("reflect", "replicate")


def minmax(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(x − min)/(max − min) over `dims`, and a bool mask (over the remaining dims) of the slices that were constant
    (those are returned as ones)."""
    lo, hi = x.amin(dim=dims, keepdim=True), x.amax(dim=dims, keepdim=True)
    span = hi - lo
    flat = span <= 1e-8 * (1 + hi.abs())
    out = torch.where(flat, torch.ones_like(x), (x - lo) / torch.where(flat, torch.ones_like(span), span))
    return out, flat.reshape(flat.shape[0], -1).any(dim=1)


def gaussian_kernel1d(sigma: float, truncate: float = 4.0, device=None) -> torch.Tensor:
    """A normalised 1-D Gaussian of std `sigma` with radius r = int(truncate · σ + 0.5), `(2r + 1,)` float64: the kernel
    of `scipy.ndimage.gaussian_filter1d` (``scipy/ndimage/_filters.py``, `_gaussian_kernel1d` with order 0)."""
    radius = int(truncate * sigma + 0.5)
    x = torch.arange(-radius, radius + 1, dtype=torch.float64, device=device)
    k = torch.exp(-0.5 * (x / sigma) ** 2)
    return k / k.sum()


def _padded_indices(n: int, radius: int, padding: str, device=None) -> torch.Tensor:
    """Indices into a length-`n` axis for positions −radius … n − 1 + radius: ``"reflect"`` is scipy's mode of that
    name (the axis mirrored about its edges with the edge sample repeated, period 2n, so any radius works);
    ``"replicate"`` repeats the edge sample (torch's ``F.pad(mode="replicate")``)."""
    i = torch.arange(-radius, n + radius, device=device)
    if padding == "replicate":
        return i.clamp(0, n - 1)
    j = i.remainder(2 * n)
    return torch.where(j >= n, 2 * n - 1 - j, j)


def check_smoothing(padding: str, truncate: float) -> None:
    """Checks the smoothing options (`smooth_1d`'s `padding` and `truncate`).

    Raises:
        ValueError: naming ``method.smoothing_padding`` or ``method.smoothing_truncate`` and the valid values.
    """
    if padding not in PADDINGS:
        raise ValueError(f"method.smoothing_padding={padding!r} must be one of {PADDINGS}.")
    if truncate <= 0:
        raise ValueError(f"method.smoothing_truncate={truncate} must be > 0 (scipy's default: 4.0).")


def check_psm_options(aggregation: str, orientation: str, num_components: int, smoothing_padding: str,
                      smoothing_truncate: float) -> None:
    """Checks `PerceptualStructuring`'s options, before any backbone is built.

    Raises:
        ValueError: naming the ``method.`` field and its valid values.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"method.aggregation={aggregation!r} must be one of {AGGREGATIONS}.")
    if orientation not in ORIENTATIONS:
        raise ValueError(f"method.orientation={orientation!r} must be one of {ORIENTATIONS}.")
    if num_components < 1:
        raise ValueError(f"method.num_components={num_components} must be >= 1 (the paper uses 3).")
    check_smoothing(smoothing_padding, smoothing_truncate)


def smooth_1d(x: torch.Tensor, sigma: float, dim: int, padding: str = "reflect", truncate: float = 4.0
              ) -> torch.Tensor:
    """Gaussian smoothing of `x` along `dim` (identity for σ ≤ 0 or a length-1 axis).

    With the defaults it is `scipy.ndimage.gaussian_filter1d(x, sigma, axis=dim)` (mode "reflect", truncate 4.0, which
    the released ViPO scripts use); ``padding="replicate", truncate=3`` is diffalign's earlier smoothing (the same as
    its former radius ⌈3σ⌉ whenever that equals int(3σ + 0.5), e.g. for the shipped σ = 1 and 0.3).

    Args:
        x (`torch.Tensor`): any shape, float.
        sigma (`float`): the Gaussian's std, in samples of `dim`.
        dim (`int`): the axis.
        padding (`str`, defaults to "reflect"): "reflect" (scipy's mode "reflect") or "replicate".
        truncate (`float`, defaults to 4.0): kernel radius int(truncate · σ + 0.5).

    Returns:
        `torch.Tensor` of `x`'s shape and dtype.

    Raises:
        ValueError: for an unknown `padding` or a non-positive `truncate`.
    """
    check_smoothing(padding, truncate)
    if sigma <= 0 or x.shape[dim] == 1:
        return x
    k = gaussian_kernel1d(sigma, truncate, x.device).to(x.dtype)
    r = (len(k) - 1) // 2
    moved = x.movedim(dim, -1)
    shape = moved.shape
    flat = moved.reshape(-1, 1, shape[-1])
    flat = flat.index_select(2, _padded_indices(shape[-1], r, padding, x.device))
    out = F.conv1d(flat, k.view(1, 1, -1)).reshape(shape)
    return out.movedim(-1, dim)


def smooth_2d(x: torch.Tensor, sigma: float, padding: str = "reflect", truncate: float = 4.0) -> torch.Tensor:
    """Separable Gaussian smoothing of `(N, h, w)` maps over the last two axes: with the defaults
    `scipy.ndimage.gaussian_filter(x[n], sigma)` for every n."""
    return smooth_1d(smooth_1d(x, sigma, -1, padding, truncate), sigma, -2, padding, truncate)


def pca_components(tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-image PCA of `(N, P, d)` tokens: projections `(N, P, K)` and explained-variance ratios `(N, K)`
    (K = min(k, P, d)); axes oriented as scikit-learn's `svd_flip` (largest-magnitude loading positive)."""
    x = tokens.double() - tokens.double().mean(dim=1, keepdim=True)
    _, s, vh = torch.linalg.svd(x, full_matrices=False)
    k = min(k, s.shape[1])
    vh = vh[:, :k]
    idx = vh.abs().argmax(dim=2, keepdim=True)
    sign = torch.sign(torch.gather(vh, 2, idx))
    sign = torch.where(sign == 0, torch.ones_like(sign), sign)
    proj = x @ (vh * sign).transpose(1, 2)
    var = s**2
    ratio = var[:, :k] / var.sum(dim=1, keepdim=True).clamp_min(1e-30)
    return proj.float(), ratio.float()


class PerceptualStructuring:
    """The PSM: decoded samples → allocation maps on the latent grid, values in [0, 1].

    Args:
        backbone: a `diffalign.vipo.backbones.VisionBackbone` (or a spec string for `build_backbone`).
        num_components (`int`, defaults to 3): K.
        aggregation (`str`): "weighted" (default, released code), "average" or "first".
        orientation (`str`): "reverse" (default, released code) or "forward" normalisation of each component.
        spatial_sigma (`float`, defaults to 1.0): Gaussian σ on the patch grid (0 disables).
        temporal_sigma (`float`, defaults to 0.3): Gaussian σ along latent frames (video only; 0 disables).
        smoothing_padding (`str`, defaults to "reflect"): border handling of both smoothings, "reflect"
            (`scipy.ndimage.gaussian_filter`'s default, as the released scripts) or "replicate" (`smooth_1d`).
        smoothing_truncate (`float`, defaults to 4.0): kernel radius int(truncate · σ + 0.5) (scipy's default).
        batch_size (`int`): frames per backbone forward.

    Raises:
        ValueError: for an unknown aggregation/orientation/padding, K < 1, or a non-positive truncate.
    """

    def __init__(self, backbone, num_components: int = 3, aggregation: str = "weighted",
                 orientation: str = "reverse", spatial_sigma: float = 1.0, temporal_sigma: float = 0.3,
                 smoothing_padding: str = "reflect", smoothing_truncate: float = 4.0, batch_size: int = 64):
        check_psm_options(aggregation, orientation, num_components, smoothing_padding, smoothing_truncate)
        if isinstance(backbone, str) or backbone is None:
            from diffalign.vipo.backbones import build_backbone

            backbone = build_backbone(backbone)
        self.backbone, self.num_components = backbone, num_components
        self.aggregation, self.orientation = aggregation, orientation
        self.spatial_sigma, self.temporal_sigma, self.batch_size = spatial_sigma, temporal_sigma, batch_size
        self.smoothing_padding, self.smoothing_truncate = smoothing_padding, smoothing_truncate

    def patch_maps(self, frames: torch.Tensor) -> torch.Tensor:
        """Steps 1–4 for `(N, 3, H, W)` frames: `(N, gh, gw)` maps in [0, 1] (NaN where a frame failed)."""
        tokens = torch.cat([self.backbone.patch_tokens(frames[s:s + self.batch_size])
                            for s in range(0, len(frames), self.batch_size)])
        n, gh, gw, d = tokens.shape
        tokens = tokens.reshape(n, gh * gw, d)
        broken = ~torch.isfinite(tokens).reshape(n, -1).all(dim=1)  # one bad frame must not sink the batch's SVD
        proj, ratio = pca_components(torch.where(broken[:, None, None], torch.zeros_like(tokens), tokens),
                                     self.num_components)
        lo, hi = proj.amin(dim=1, keepdim=True), proj.amax(dim=1, keepdim=True)
        span = (hi - lo).clamp_min(1e-12)
        z = (hi - proj) / span if self.orientation == "reverse" else (proj - lo) / span
        if self.aggregation == "weighted":
            s = (z * ratio[:, None, :]).sum(dim=2).clamp(0, 1)
        elif self.aggregation == "average":
            s = z.mean(dim=2)
        else:
            s = z[:, :, 0]
        s = smooth_2d(s.reshape(n, gh, gw), self.spatial_sigma, self.smoothing_padding, self.smoothing_truncate)
        s, flat = minmax(s, (1, 2))
        s[flat | broken] = float("nan")
        return s

    @torch.no_grad()
    def __call__(self, samples: torch.Tensor, latent_grid: tuple[int, ...]) -> tuple[torch.Tensor, dict]:
        """Maps for `samples` — images `(B, 3, H, W)` or videos `(B, F, 3, H, W)` in [0, 1] — on `latent_grid`
        `(h, w)` (images) or `(F_lat, h, w)` (videos).

        Returns:
            (`(B, *latent_grid)` float32 maps in [0, 1], ``{"fallback": (B,) bool, "map_mean": float}``).
        """
        video = samples.ndim == 5
        b = len(samples)
        grid = tuple(int(g) for g in latent_grid)
        fallback = torch.zeros(b, dtype=torch.bool)
        try:
            frames = samples.reshape(-1, *samples.shape[-3:]).float()
            s = self.patch_maps(frames)  # (B·F, gh, gw)
            bad = ~torch.isfinite(s).reshape(s.shape[0], -1).all(dim=1)
            s = torch.nan_to_num(s, nan=1.0)
            s = F.interpolate(s[:, None], size=grid[-2:], mode="bilinear", antialias=True, align_corners=False)[:, 0]
            s, flat = minmax(s, (1, 2))
            bad |= flat
            if video:
                nf = samples.shape[1]
                s, bad = s.reshape(b, nf, *grid[-2:]), bad.reshape(b, nf).any(dim=1)
                f_lat = grid[0] if len(grid) == 3 else 1
                if f_lat != nf:
                    s = F.interpolate(s[:, None], size=(f_lat, *grid[-2:]), mode="trilinear", align_corners=False)[:, 0]
                s = smooth_1d(s, self.temporal_sigma, 1, self.smoothing_padding, self.smoothing_truncate)
                s, flat = minmax(s, (1, 2, 3))
                bad |= flat
                if len(grid) == 2:
                    s = s[:, 0]
            fallback |= bad.cpu()
            s = s.clamp(0, 1)
            s[fallback.to(s.device)] = 1.0
        except Exception:  # noqa: BLE001 — all-ones map on failure: docs/methods/algorithms.md#vipo-perceptual-maps
            s = torch.ones((b, *grid))
            fallback[:] = True
        if tuple(s.shape[1:]) != grid:
            s, fallback[:] = torch.ones((b, *grid)), True
        return s.float(), {"fallback": fallback, "map_mean": float(s.mean())}


def advantage_maps(maps: torch.Tensor, advantages: torch.Tensor, clip: float | None = 5.0) -> torch.Tensor:
    """A_i^p = clip(M_i(p) · A_i, ±clip) (Eq. 8): `(B, *grid)` from `(B, *grid)` maps and `(B,)` advantages, or
    `(B, R, *grid)` from `(B, R)` advantages (one per reward, ViPO-Wan's A^VQ·M and A^MQ·M)."""
    adv = advantages.float().to(maps.device)
    if adv.ndim == 2:
        maps = maps.unsqueeze(1)
        adv = adv.reshape(*adv.shape, *([1] * (maps.ndim - 2)))
    else:
        adv = adv.reshape(-1, *([1] * (maps.ndim - 1)))
    out = maps.float() * adv
    return out.clamp(-clip, clip) if clip is not None else out
