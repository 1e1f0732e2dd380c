"""Real-size architectures on CPU: one training step of every applicable method on the real SD1.5, SDXL,
SD3.5-Medium and Wan2.1-T2V-1.3B architectures, and on real-width, reduced-depth slices of FLUX.1-dev and
Wan2.2-T2V-A14B, with random weights.

Each architecture is built from its published configs (``configs/arch/*.json``, copied from the hub repos they name;
nothing is downloaded), randomly initialised, written once as a diffusers folder with ``save_pretrained`` (bfloat16
on disk) and loaded back by the run exactly as ``diffalign-train model=<sd15|sdxl|sd35_medium|wan21_t2v|flux1_dev|
wan22_t2v_a14b> model.pretrained_model_name_or_path=<folder>`` would: the config is composed from the method's paper recipe (or the
model config), validated, and the training loop's own set-up runs (`diffalign.train.preference` /
`diffalign.train.online`), followed by one optimizer step (preference methods) or one epoch of rollouts + one update
(online methods), each (model, method, dtype) in its own subprocess. Two stand-ins, so the machine's memory suffices:
SD3.5-Medium runs without its T5-XXL encoder (``load_t5=false``: the pipeline feeds zeros in its place, the joint
attention still sees 77 + 256 text tokens), and Wan runs with a one-layer stand-in of its umT5-XXL encoder that has
the real output width (prompt embeddings (B, 512, 4096), random values); FLUX.1-dev's T5-XXL likewise. Their sizes
are counted from their published configs on the meta device and reported.

Two models do not fit this machine's memory even so (FLUX.1-dev's transformer: 11.9 B parameters, 24 GB in bfloat16;
Wan2.2-T2V-A14B: two experts of 14.3 B, 57 GB), so their rows run a **reduced-depth stand-in** (``MODELS[...]
["depth"]``): the published denoiser config with fewer blocks — FLUX.1-dev with 1 double-stream and 1 single-stream
block of its 19 + 38, each Wan 2.2 expert with 1 layer of its 40 — at the real width, heads, embeddings, VAE and
text width, so the step runs the real code path per block (the experts' switch at the boundary, the guidance
embedding, the packed latents) but not the real depth: its time and memory are those of the slice, and the GPU
estimate (``--estimate``) leaves these models out. The published sizes (meta device, full depth) are reported beside.

The smallest valid resolution: 8x8 latents for the UNets (64 px; SD1.5's UNet halves three times), 2x2 for SD3.5
(16 px, one 2x2 patch), 5 frames of 16x16 px for Wan (latents 16x2x2x2, two patches), 16 px for FLUX (latents
16x2x2, one packed token; set with ``model.height/width``: FLUX's transformer has no default size). The folder's
denoiser ``config.json`` carries that size as ``sample_size`` (the default resolution the loops read; it sizes no
weight). Rollouts take 2 sampler steps (Wan 2.2: 6, so that the trained transitions reach the low-noise expert),
groups 2 samples, batches 1 pair / 1 winner; rewards are the toy ``brightness``
(images) and ``per_frame`` brightness + ``temporal_consistency`` (video), since the step's cost is the method's.

Printed: a markdown table with parameters (denoiser / all loaded), LoRA parameters, times (set-up; the online
rollout; the step, wall and CPU), and memory: the resident set after set-up (weights), the step's own peak, and the
child's peak (``VmHWM``, the counter ``ru_maxrss`` reads). After its step each child also runs an activation probe
(one forward + backward of the denoiser alone at the smallest and at a larger size), from which ``--estimate``
derives the GPU memory of every paper recipe (docs/guides/real_size.md). ``--sizes scale`` runs whole steps at the
larger size instead.

    python scripts/bench_real_size.py --json rows.json                 # everything (hours on a loaded 2-core CPU)
    python scripts/bench_real_size.py --models sd15 --dtypes float32   # one model, one dtype
    python scripts/bench_real_size.py --estimate rows.json             # the table and the GPU estimates
    python scripts/bench_real_size.py --in-memory --models sdxl        # no disk for the folders (~20 GB in all)

A big child (SDXL, SD3.5 in float32) starts only when ``MemAvailable`` exceeds its need (``--min-free-gib``,
default 16 for those; the others: their weights + 4 GiB), waiting up to ``--wait-for-memory`` seconds; otherwise its
row says so. A child killed for memory is not retried. Dev tool only; never imported by the package.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ARCH_DIR = ROOT / "configs" / "arch"
GIB = 1024**3

# model key -> arch file, the model config it loads with, its minimum latent size (side) and a larger one for --scale
MODELS = {
    "sd15": {"arch": "sd15", "min": 8, "scale": 32, "big": False},
    "sdxl": {"arch": "sdxl", "min": 8, "scale": 16, "big": True},
    "sd35_medium": {"arch": "sd35_medium", "min": 2, "scale": 32, "big": True},
    "wan21_t2v": {"arch": "wan21_t2v_1_3b", "min": (5, 16, 16), "scale": (9, 128, 128), "big": False, "video": True},
    # reduced-depth stand-ins (the module docstring): "depth" replaces these fields of every denoiser's config
    "flux1_dev": {"arch": "flux1_dev", "min": 2, "scale": 32, "big": False, "sized_by_model": True,
                  "depth": {"num_layers": 1, "num_single_layers": 1}},
    "wan22_t2v_a14b": {"arch": "wan22_t2v_a14b", "min": (5, 16, 16), "scale": (9, 128, 128), "big": False,
                       "video": True, "depth": {"num_layers": 1}},
}
# SDXL's smallest valid latent is 4x4 (two downsamplings); 8x8 (64 px) is used so that the VAE, whose encoder has
# three, sees the same 64 px images as SD1.5's.

# The applicable methods (docs/methods/index.md) with the paper recipe whose settings they run with; "~recipe"
# means no recipe matches that pair, so the method's and model's own configs apply.
METHODS = {
    "sd15": {
        "diffusion_dpo": "~recipe",
        "seppo": "seppo_sd15_pickapic",
        "ddspo": "ddspo_sd14",
        "sft": "~recipe",
        "ddpo": "ddpo_sd15_aesthetic",
    },
    "sdxl": {
        "diffusion_dpo": "diffusion_dpo_sdxl_pickapic",
        "seppo": "~recipe",
        "ddspo": "ddspo_sdxl",
        "sft": "~recipe",
    },
    "sd35_medium": {
        "flow_grpo": "flow_grpo_sd35_geneval",
        "dgpo": "dgpo_sd35_geneval",
        "diffusion_nft": "diffusion_nft_sd35_geneval",
    },
    "wan21_t2v": {"vipo": "vipo_wan"},
    "flux1_dev": {"flow_grpo": "flow_grpo_flux_pickscore"},
    "wan22_t2v_a14b": {"flow_grpo": "~recipe"},  # no Wan 2.2 recipe ships: flow_grpo's defaults, sampler=flow_sde
}
ONLINE = {"ddpo", "flow_grpo", "dgpo", "diffusion_nft", "vipo"}


# ----------------------------------------------------------------------------------------------- building the folders


def load_arch(name: str) -> dict:
    """The published configs of one architecture (``configs/arch/<name>.json``)."""
    return json.loads((ARCH_DIR / f"{name}.json").read_text())


def run_arch(model: str) -> dict:
    """The architecture `model`'s row builds and runs: its published configs (`load_arch`), with a reduced-depth
    stand-in's ``MODELS[model]["depth"]`` fields replacing those of every denoiser (the components of the denoiser's
    class: both experts of Wan 2.2)."""
    arch = load_arch(MODELS[model]["arch"])
    depth = MODELS[model].get("depth")
    if not depth:
        return arch
    denoiser_class = arch["components"][arch["denoiser"]]["class"]
    components = {name: {**spec, "config": {**spec["config"], **depth}} if spec.get("class") == denoiser_class
                  else spec for name, spec in arch["components"].items()}
    return {**arch, "components": components}


def folder_size(model: str, size):
    """The denoiser's default size written into the folder (`model_folder`); None where the run sets the size
    itself (Wan: frames and pixels, FLUX: ``model.height/width``)."""
    spec = MODELS[model]
    return None if spec.get("video") or spec.get("sized_by_model") else size


def component_class(spec: dict):
    """The diffusers / transformers class of one component spec."""
    import diffusers
    import transformers

    return getattr(diffusers if spec["library"] == "diffusers" else transformers, spec["class"])


def build_component(spec: dict, *, device: str = "cpu"):
    """A randomly initialised model from one component spec (`device` "meta" builds it without memory); for
    transformers classes, ``config_class(**config)``."""
    import torch

    cls = component_class(spec)
    with torch.device(device):
        if spec["library"] == "diffusers":
            return cls.from_config(spec["config"])
        return cls(cls.config_class(**spec["config"]))


def count_parameters(module) -> int:
    return sum(p.numel() for p in module.parameters())


def published_sizes(arch: dict) -> dict[str, int]:
    """Parameters of every model component of `arch` as published (counted on the meta device), stand-ins included
    at their real size."""
    sizes = {}
    for name, spec in arch["components"].items():
        if spec["library"] == "stand-in" or "Scheduler" in spec["class"]:
            continue
        sizes[name] = count_parameters(build_component(spec, device="meta"))
    return sizes


def stand_in_tokenizer(model_max_length: int):
    """The tiny world's word-level tokenizer (no hub files) padding to the real context length (77 for CLIP, 512
    for umT5): prompt embeddings keep their real shape; only the vocabulary is the world's."""
    from diffalign.world.tokenizer import build_tokenizer

    tokenizer = build_tokenizer(video=True)
    tokenizer.model_max_length = model_max_length
    return tokenizer


def narrow_umt5(spec: dict, tokenizer):
    """The (um)T5 encoder stand-in (the spec's class: Wan's umT5, FLUX's T5): one layer, one head of 8, d_ff 16, the
    real width d_model (4096)."""
    cls = component_class(spec)
    width = spec["config"]["d_model"]
    return cls(cls.config_class(vocab_size=len(tokenizer), d_model=width, d_kv=8, d_ff=16, num_layers=1, num_heads=1,
                                pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                                decoder_start_token_id=0))


def build_components(arch: dict, sample_size=None) -> dict:
    """Every component of `arch` built in memory (random weights, bfloat16; tokenizers, schedulers), by name; skipped
    stand-ins are `None`. `sample_size` replaces the denoiser's default size."""
    import torch

    components, tokenizer = {}, None
    for name, spec in arch["components"].items():
        if spec.get("stand_in") == "skip":
            components[name] = None
        elif spec["library"] == "stand-in":
            components[name] = tokenizer = stand_in_tokenizer(spec["model_max_length"])
        elif "Scheduler" in spec["class"]:
            components[name] = component_class(spec).from_config(spec["config"])
        else:
            if sample_size is not None and name == arch.get("denoiser"):
                spec = {**spec, "config": {**spec["config"], "sample_size": sample_size}}
            torch.manual_seed(0)
            previous = torch.get_default_dtype()
            torch.set_default_dtype(torch.bfloat16)  # built in bf16: half the memory of a float32 build
            try:
                if spec.get("stand_in") == "narrow":
                    components[name] = narrow_umt5(spec, tokenizer or stand_in_tokenizer(512))
                else:
                    components[name] = build_component(spec)
            finally:
                torch.set_default_dtype(previous)
    return components


def model_index(arch: dict) -> dict:
    """The pipeline folder's ``model_index.json``; skipped stand-ins are ``[null, null]``."""
    import diffusers

    index = {"_class_name": arch["pipeline"], "_diffusers_version": diffusers.__version__}
    for name, spec in arch["components"].items():
        if spec.get("stand_in") == "skip":
            index[name] = [None, None]
        elif spec["library"] == "stand-in":
            index[name] = ["transformers", "PreTrainedTokenizerFast"]
        else:
            index[name] = [spec["library"], spec["class"]]
    for key, value in arch.get("pipeline_kwargs", {}).items():
        index[key] = [None, None] if value is None else value
    return index


def write_weights(arch: dict, out: Path) -> None:
    """Writes every component of `arch` (random weights, bfloat16) into `out` as a diffusers pipeline folder with
    ``save_pretrained``, and ``model_index.json``."""
    out.mkdir(parents=True, exist_ok=True)
    for name, component in build_components(arch).items():
        if component is not None:
            kwargs = {} if isinstance(component, dict) or not hasattr(component, "parameters") else \
                {"safe_serialization": True}
            component.save_pretrained(out / name, **kwargs)
    (out / "model_index.json").write_text(json.dumps(model_index(arch), indent=1))


def write_configs(arch: dict, out: Path, sample_size=None) -> None:
    """A weightless view of the folder `write_weights` would write (``model_index.json`` and every component's
    config), for runs that build the weights in memory (`in_memory_loading`)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "model_index.json").write_text(json.dumps(model_index(arch), indent=1))
    for name, spec in arch["components"].items():
        if spec["library"] != "stand-in" and spec.get("stand_in") != "skip":
            config = dict(spec["config"])
            if sample_size is not None and name == arch.get("denoiser"):
                config["sample_size"] = sample_size
            (out / name).mkdir(exist_ok=True)
            (out / name / "config.json").write_text(json.dumps({"_class_name": spec["class"], **config}, indent=1))


def in_memory_loading(arch: dict, sample_size) -> None:
    """Makes the policy's ``from_pretrained`` get the pipeline built in memory (`build_components`) instead of
    reading weights from its folder, when the disk has no room for them: `load_pipeline` of every model family
    module is replaced by one that casts that pipeline to the requested dtype and returns it; the policy's own
    construction (LoRA, schedulers, checks) runs unchanged."""
    import diffusers

    import diffalign.models.flux
    import diffalign.models.sd3
    import diffalign.models.sdxl
    import diffalign.models.stable_diffusion
    import diffalign.models.wan
    from diffalign.models.pipeline_policy import resolve_dtype

    def load_pipeline(pipeline_class, path, *, torch_dtype="float32", **kwargs):
        components = build_components(arch, sample_size)
        pipe = getattr(diffusers, arch["pipeline"])(**components, **arch.get("pipeline_kwargs", {}))
        return pipe.to(resolve_dtype(torch_dtype))

    for module in (diffalign.models.flux, diffalign.models.sd3, diffalign.models.sdxl,
                   diffalign.models.stable_diffusion, diffalign.models.wan):
        module.load_pipeline = load_pipeline


def model_folder(model: str, size, work: Path, log=print, in_memory: bool = False) -> Path:
    """The diffusers folder of `model` whose denoiser defaults to latent side `size` (a view of the shared weights:
    every file a symlink but the denoiser's ``config.json``). Wan and FLUX have no default size (the run sets it,
    `folder_size`). With `in_memory`, a weightless folder (`write_configs`; the child builds the weights,
    `in_memory_loading`). A reduced-depth stand-in is built as `run_arch` says."""
    spec = MODELS[model]
    arch = run_arch(model)
    if in_memory:
        out = work / spec["arch"] / f"configs_{size}"
        write_configs(arch, out, size)
        return out
    weights = work / spec["arch"] / "weights"
    if not (weights / "model_index.json").is_file():
        log(f"[real-size] writing random {spec['arch']} weights to {weights} ...")
        t = time.time()
        if weights.exists():
            shutil.rmtree(weights)
        write_weights(arch, weights)
        log(f"[real-size] written in {time.time() - t:.0f}s")
    if folder_size(model, size) is None:
        return weights
    view = work / spec["arch"] / f"sample_size_{size}"
    if (view / "model_index.json").is_file():
        return view
    tmp = Path(tempfile.mkdtemp(dir=work / spec["arch"]))
    for item in weights.iterdir():
        if item.is_dir():
            (tmp / item.name).mkdir()
            for f in item.iterdir():
                (tmp / item.name / f.name).symlink_to(f.resolve())
        else:
            (tmp / item.name).symlink_to(item.resolve())
    denoiser_config = tmp / arch["denoiser"] / "config.json"
    config = json.loads(denoiser_config.read_text())
    denoiser_config.unlink()
    config["sample_size"] = size
    denoiser_config.write_text(json.dumps(config, indent=1))
    tmp.rename(view)
    return view


def backbone_folder(work: Path) -> Path:
    """A random DINOv2-large folder (ViPO's backbone in recipe vipo_wan)."""
    out = work / "dinov2_large"
    if not (out / "config.json").is_file():
        import torch

        torch.manual_seed(0)
        build_component(load_arch("dinov2_large")["components"]["backbone"]).save_pretrained(out)
    return out


# ----------------------------------------------------------------------------------------------- one child


def write_pairs(folder: Path, pixels: int, count: int = 4) -> Path:
    """A Pick-a-Pic-format jsonl (``caption``, ``jpg_0``, ``jpg_1``, ``label_0``) of `count` shapes-world pairs
    (`diffalign.data.shapes_pairs`: a render of the prompt wins over a render of a corrupted prompt) drawn at `pixels`
    px, the preference methods' data (``data=pickapic``, as their recipes)."""
    import numpy as np
    from PIL import Image

    from diffalign.world.prompts import sample_train_specs
    from diffalign.world.render import corrupt_spec, render_spec

    folder.mkdir(parents=True, exist_ok=True)
    lines = []
    for i, spec in enumerate(sample_train_specs(count, seed=0)):
        seed = int(np.random.default_rng([0, i]).integers(2**31))
        bad, _ = corrupt_spec(spec, seed)
        for side, s, k in (("w", spec, seed), ("l", bad, seed + 1)):
            Image.fromarray(np.asarray(render_spec(s, k, size=pixels), dtype=np.uint8)).save(folder / f"{i}_{side}.png")
        lines.append(json.dumps({"caption": spec["prompt"], "jpg_0": f"{i}_w.png", "jpg_1": f"{i}_l.png",
                                 "label_0": 1, "label_1": 0}))
    path = folder / "pairs.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def overrides_for(model: str, method: str, dtype: str, folder: Path, size, work: Path, run_dir: Path) -> list[str]:
    """The ``diffalign-train`` overrides of one child: the method's recipe (or none), the local folder and dtype, the
    minimal budget (1 step / 1 epoch, tiny batches, 2 sampler steps), and data or rewards that need no download."""
    recipe = METHODS[model][method]
    out = [recipe if recipe == "~recipe" else f"recipe={recipe}", f"model={MODELS_CONFIG[model]}",
           f"method={method}", f"model.pretrained_model_name_or_path={folder}", f"model.torch_dtype={dtype}",
           f"output_dir={run_dir}", "trainer.cpu=true", "trainer.log_with=none",
           f"trainer.mixed_precision={'bf16' if dtype == 'bfloat16' else 'no'}", "eval.enabled=false",
           "monitor.every=0"]
    if model == "sd35_medium":
        out.append("model.load_t5=false")
    if model == "sdxl":  # the Diffusion-DPO recipe's fp16-fixed VAE is a hub download; same architecture as SDXL's
        out.append("model.pretrained_vae_model_name_or_path=null")
    if MODELS[model].get("sized_by_model"):  # FLUX: the size is the policy's height/width
        out += [f"model.height={size * 8}", f"model.width={size * 8}"]
    if method in ONLINE:
        out += ["online.num_epochs=1", "online.groups_per_epoch=1", "online.group_size=2",
                "online.updates_per_epoch=1", "online.num_inner_epochs=1", "online.rollout_batch_size=2",
                "online.checkpointing_epochs=null", "trainer.batch_size=2", "sampler.num_inference_steps=2",
                # the one update must move the adapter: a warmup's first update has learning rate 0 (the trainer's
                # default warmup is 10; a recipe's own may be 0), as for the preference methods below
                "trainer.lr_warmup_steps=0"]
        if method == "vipo":
            frames, height, width = size
            out += [f"model.num_frames={frames}", f"model.height={height}", f"model.width={width}",
                    "online.prompts=video_train", "online.best_of_n=null", "reward=[per_frame,temporal_consistency]",
                    "reward.per_frame.image_reward=brightness", f"method.backbone=dinov2:{backbone_folder(work)}"]
        elif MODELS[model].get("video"):
            frames, height, width = size
            out += [f"model.num_frames={frames}", f"model.height={height}", f"model.width={width}",
                    "online.prompts=video_train", "reward=[per_frame]", "reward.per_frame.image_reward=brightness"]
        else:
            out += ["online.prompts=train", "reward=[brightness]"]
        if method == "ddpo":
            out += ["online.tracker_min_count=1"]
        if method == "dgpo":
            out += ["method.timesteps_per_epoch=1", "method.timestep_max_index=1", "method.old_policy_switch_step=0"]
        if recipe == "~recipe" and method == "flow_grpo":
            out.append("sampler=flow_sde")
        if model == "wan22_t2v_a14b":
            # shift 12, boundary 0.875: with 6 steps the 5th (σ = 1/3, t = 857) is the first on the low-noise expert,
            # and flow_grpo trains the first 5 transitions, so the update reaches both experts
            out.append("sampler.num_inference_steps=6")
        return out
    pixels = size * 8
    pairs = write_pairs(work / "data" / f"pairs_{pixels}", pixels)
    out += ["trainer.max_steps=1", "trainer.gradient_accumulation_steps=1", "trainer.checkpointing_steps=null",
            "trainer.batch_size=1", "trainer.lr_warmup_steps=0"]
    if method == "ddspo":
        prompts = work / "data" / "ddspo_prompts.txt"
        prompts.parent.mkdir(parents=True, exist_ok=True)
        prompts.write_text("a red circle left of a blue square\n")
        out += [f"data.pairs_dir={run_dir}/ddspo_pairs", "data.generate=true", f"data.prompts={prompts}",
                "data.num_variants=1", "data.num_inference_steps=2", "data.batch_size=1", "data.shard_size=1"]
        if METHODS[model][method] == "~recipe":
            out.insert(0, "data=ddspo_pairs")
    else:
        out += ["data=pickapic", f"data.path={pairs}", "data.resolution=null"]
        if method in ("seppo", "sft"):
            out += ["data.winners_only=true"]
        if method == "seppo":
            out += ["sampler.num_inference_steps=2", "reference=pool", "reference.storage_device=cpu"]
    return out


MODELS_CONFIG = {"sd15": "sd15", "sdxl": "sdxl", "sd35_medium": "sd35_medium", "wan21_t2v": "wan21_t2v",
                 "flux1_dev": "flux1_dev", "wan22_t2v_a14b": "wan22_t2v_a14b"}


def _status(key: str) -> int:
    """A ``/proc/self/status`` field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class Peaks:
    """Peak resident memory per phase: ``VmHWM`` (what ``ru_maxrss`` reads) is read at the end of a phase, then reset
    (``/proc/self/clear_refs`` 5) so the next phase's peak is its own; `overall` is the maximum of all phases, the
    child's ``ru_maxrss`` without the resets."""

    def __init__(self):
        self.overall = 0
        self.phases: dict[str, int] = {}

    def reset(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")

    def end(self, name: str) -> int:
        peak = _status("VmHWM")
        self.phases[name] = max(self.phases.get(name, 0), peak)
        self.overall = max(self.overall, peak)
        self.reset()
        return peak


def touch(module) -> None:
    """Reads every parameter once, so that weights still mapped from their safetensors file (a bfloat16 folder loaded
    in bfloat16 is not copied) are resident before the step is measured."""
    import torch

    with torch.no_grad():
        for p in module.parameters():
            p.sum()


def probe_sizes(model: str) -> list:
    """The two sizes of the activation probe (`activation_probe`): the smallest and the larger one."""
    return [MODELS[model]["min"], MODELS[model]["scale"]]


def probe_latents(policy, model: str, size, rows: int):
    """Random latents of `rows` samples at `size` in the policy's layout."""
    import torch

    if MODELS.get(model, {}).get("video"):  # (gpu_check passes its own family names)
        frames, height, width = size
        c = policy.latent_shape[0]
        shape = (c, (frames - 1) // 4 + 1, height // 8, width // 8)
    else:
        shape = (policy.latent_shape[0], size, size)
    return torch.randn(rows, *shape, generator=torch.Generator().manual_seed(0))


def activation_probe(run, model: str, peaks: Peaks, rows: int = 2) -> dict:
    """The memory of one training forward + backward of the denoiser alone (unguided, `rows` rows, the run's autocast
    and gradient checkpointing, LoRA gradients only) at the smallest and at the larger size: ``{positions: bytes
    above the resident set before it}``, the LoRA's gradient bytes (4 per parameter) taken off. Run after the step,
    so the optimizer's state already exists."""
    import torch

    policy = run.policy
    params = run.updates.params
    embeds = policy.encode_prompts(["a red circle left of a blue square"] * rows, do_classifier_free_guidance=False)
    out = {}
    for size in probe_sizes(model):
        latents = probe_latents(policy, model, size, rows)
        t = torch.full((rows,), 500.0 if policy.flow_matching else 500)
        for p in params:
            p.grad = None
        touch(policy)
        peaks.end("before_probe")
        before = _status("VmRSS")
        with run.accelerator.autocast():
            loss = policy.predict(latents, t, embeds, 1.0).float().pow(2).mean()
        loss.backward()
        out[str(tokens(model, size))] = max(0, peaks.end("probe") - before - 4 * sum(p.numel() for p in params))
        del loss
        for p in params:
            p.grad = None
    return out


def child(model: str, method: str, dtype: str, size, work: Path, in_memory: bool = False,
          probe: bool = True) -> dict:
    """Runs one (model, method, dtype) in this process; returns its row."""
    import torch
    from hydra import compose, initialize_config_dir

    from diffalign.config.compose import CONFIG_DIR, setup_hydra
    from diffalign.runtime.console import WarningCounts
    from diffalign.runtime.faults import StopSignals
    from diffalign.train.prepare import build_run, check_run

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    peaks = Peaks()
    folder = model_folder(model, folder_size(model, size), work, in_memory=in_memory)
    if in_memory:
        in_memory_loading(run_arch(model), folder_size(model, size))
    run_dir = Path(tempfile.mkdtemp(prefix=f"{model}-{method}-", dir=work / "runs"))
    overrides = overrides_for(model, method, dtype, folder, size, work, run_dir)
    setup_hydra()
    with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    check_run(cfg, overrides)  # the checks `diffalign-train` runs; the loop's set-up below builds the run
    row = {"model": model, "method": method, "dtype": dtype, "size": size, "recipe": METHODS[model][method],
           "loading": "in memory" if in_memory else "from_pretrained",
           "lora_rank": cfg.model.lora_rank, "batch": cfg.trainer.batch_size, "load_start": os.getloadavg()[0]}
    peaks.reset()
    t0 = time.perf_counter()
    if method in ONLINE:
        from diffalign.train import online as loop

        times = {}
        rollout, updates = loop.group_rollout, loop._updates

        def timed_rollout(*args, **kwargs):
            peaks.end("setup_to_rollout")
            start, cpu = time.perf_counter(), time.process_time()
            out = rollout(*args, **kwargs)
            times["rollout_s"], times["rollout_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
            peaks.end("rollout")
            return out

        def timed_updates(run, data):
            touch(run.policy)
            peaks.end("reward_prepare")
            times["rss_before_step"] = _status("VmRSS")
            start, cpu = time.perf_counter(), time.process_time()
            out = updates(run, data)
            times["step_s"], times["step_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
            peaks.end("step")
            return out

        loop.group_rollout, loop._updates = timed_rollout, timed_updates
        run = loop._setup(build_run(cfg))
        run.warnings = WarningCounts()  # what the loop's `train` hands every run (diffalign.runtime.console)
        row["setup_s"] = time.perf_counter() - t0
        touch(run.policy)
        row["rss_weights"] = _status("VmRSS")
        logs = loop._epoch(run)
        row.update(times)
        row["loss"] = float(logs.get("loss", float("nan")))
    else:
        from diffalign.train import preference as loop

        with StopSignals() as stop:
            run = loop._setup(build_run(cfg))
            run.warnings = WarningCounts()  # what the loop's `train` hands every run (diffalign.runtime.console)
            touch(run.policy)
            row["rss_weights"] = _status("VmRSS")
            start = time.perf_counter()
            loop._prepare_data(run, stop)
            row["data_s"] = time.perf_counter() - start
            row["setup_s"] = time.perf_counter() - t0
            touch(run.policy)
            peaks.end("setup")
            row["rss_before_step"] = _status("VmRSS")
            start, cpu = time.perf_counter(), time.process_time()
            history = loop._train_steps(run, stop)
            row["step_s"], row["step_cpu_s"] = time.perf_counter() - start, time.process_time() - cpu
            peaks.end("step")
        row["loss"] = float(history[-1].get("loss", float("nan")))
    params = run.updates.params
    policy = run.policy
    # the frozen weights: every parameter but the adapters' (a pool reference adds a frozen adapter of its own)
    row["denoiser_params"] = sum(p.numel() for n, p in policy.denoiser.named_parameters() if "lora_" not in n)
    row["loaded_params"] = sum(p.numel() for n, p in policy.named_parameters() if "lora_" not in n)
    row["lora_params"] = sum(p.numel() for p in params)
    row["frozen_adapter_params"] = sum(p.numel() for n, p in policy.denoiser.named_parameters()
                                       if "lora_" in n and not p.requires_grad)  # a pool reference's, θ⁻'s
    row["gradient_checkpointing"] = bool(cfg.model.get("gradient_checkpointing", False))
    row["step_peak"] = peaks.phases["step"]
    if probe:
        policy.denoiser.train()
        row["probe_rows"] = 2
        try:
            row["probe"] = activation_probe(run, model, peaks, rows=2)
        except Exception as err:  # noqa: BLE001 (the step's row stands without it)
            row["probe_error"] = f"{type(err).__name__}: {err}"[:300]
    row["peak_rss"] = max(peaks.overall, _status("VmHWM"))
    row["latent_shape"] = list(policy.latent_shape)
    row["load_end"] = os.getloadavg()[0]
    row["grads_finite"] = all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)
    row["lora_changed"] = any(bool(p.detach().abs().sum() > 0) for n, p in policy.denoiser.named_parameters()
                              if "lora_B" in n and p.requires_grad)
    if MODELS[model].get("depth"):
        row["stand_in_depth"] = MODELS[model]["depth"]
    experts = [name for name in ("transformer", "transformer_2") if isinstance(getattr(policy.denoiser, name, None),
                                                                              torch.nn.Module)]
    if len(experts) == 2:  # Wan 2.2: did the update reach each expert's LoRA?
        row["experts_changed"] = {name: any(bool(p.detach().abs().sum() > 0) for n, p in
                                            getattr(policy.denoiser, name).named_parameters()
                                            if "lora_B" in n and p.requires_grad) for name in experts}
    shutil.rmtree(run_dir, ignore_errors=True)
    return row


# ----------------------------------------------------------------------------------------------- the parent


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def need_gib(model: str, dtype: str, min_free_gib: float | None) -> float:
    """Free memory a child needs before it starts: `min_free_gib` for the big float32 children (SDXL, SD3.5),
    else the loaded parameters' bytes + 4 GiB."""
    spec = MODELS[model]
    if spec["big"] and dtype == "float32":
        return min_free_gib if min_free_gib is not None else 16.0
    arch = run_arch(model)  # a reduced-depth stand-in needs its own size, not the published one
    params = sum(n for name, n in published_sizes(arch).items()
                 if arch["components"][name].get("stand_in") is None)
    return params * (4 if dtype == "float32" else 2) / GIB + 4


def run_child(model: str, method: str, dtype: str, size, work: Path, timeout: float, min_free_gib,
              in_memory: bool = False, wait_for_memory: float = 0.0) -> dict:
    base = {"model": model, "method": method, "dtype": dtype, "size": size}
    need = need_gib(model, dtype, min_free_gib)
    deadline = time.time() + wait_for_memory
    while mem_available() / GIB < need and time.time() < deadline:  # other jobs may free memory
        time.sleep(15)
    free = mem_available() / GIB
    if free < need:
        return {**base, "skipped": f"{free:.1f} GiB available, {need:.0f} GiB needed"}
    cmd = [sys.executable, __file__, "--child", model, method, dtype, json.dumps(size), "--work", str(work)]
    cmd += ["--in-memory"] if in_memory else []
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"), "TQDM_DISABLE": "1",
           "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, check=False)
    except subprocess.TimeoutExpired:
        return {**base, "skipped": f"timed out after {timeout:.0f}s"}
    for line in proc.stdout.splitlines():
        if line.startswith("ROW "):
            row = json.loads(line[4:])
            row["child_s"] = time.time() - start
            return row
    reason = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit {proc.returncode}"
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {**base, "skipped": f"{reason}: {' | '.join(tail)}"}


def fmt_params(n) -> str:
    if n is None:
        return "–"
    return f"{n / 1e9:.3f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def fmt_gib(n) -> str:
    return "–" if n is None else f"{n / GIB:.1f}"


def size_label(model: str, size) -> str:
    if MODELS[model].get("video"):
        f, h, w = size
        return f"{f}×{h}×{w}"
    return f"{size * 8} px"


def table(rows: list[dict]) -> str:
    head = ("| model | method (recipe) | dtype | size | denoiser params | loaded params | LoRA params (rank) | set-up s | "
            "rollout s | step s (CPU s) | RSS after set-up GiB | step peak GiB | child peak GiB |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        recipe = r.get("recipe", METHODS[r["model"]][r["method"]])
        method = f"{r['method']} ({'–' if recipe == '~recipe' else recipe})"
        depth = MODELS[r["model"]].get("depth")
        if depth:  # a reduced-depth stand-in: the blocks that ran
            method += " [stand-in: " + ", ".join(f"{k} {v}" for k, v in depth.items()) + "]"
        if "skipped" in r:
            reason = r["skipped"].split(" | ")[-1][:160].replace("|", "/")
            lines.append(f"| {r['model']} | {method} | {r['dtype']} | {size_label(r['model'], r['size'])} | "
                         f"not measured: {reason} |" + " |" * 8)
            continue
        rollout = f"{r['rollout_s']:.1f}" if "rollout_s" in r else "–"
        step = f"{r['step_s']:.1f} ({r['step_cpu_s']:.1f})" if "step_cpu_s" in r else f"{r['step_s']:.1f}"
        lines.append(
            f"| {r['model']} | {method} | {r['dtype']} | {size_label(r['model'], r['size'])} | "
            f"{fmt_params(r['denoiser_params'])} | {fmt_params(r['loaded_params'])} | "
            f"{fmt_params(r['lora_params'])} (r {r['lora_rank']}) | {r['setup_s']:.0f} | {rollout} | "
            f"{step} | {fmt_gib(r['rss_weights'])} | {fmt_gib(r['step_peak'])} | {fmt_gib(r['peak_rss'])} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- GPU estimates

# The paper recipes and what they train; rows of the denoiser's batch that keep activations for the backward pass,
# per item of trainer.batch_size: a pair's winner and loser (Diffusion-DPO, DDSPO), the winner and the reference
# sample (SePPO), the guided [uncond; cond] batch of the policy-gradient methods (DDPO, Flow-GRPO, ViPO: the
# unconditional rows are detached after a joint forward, so their activations are kept), one row for DGPO and
# DiffusionNFT (unguided training forwards). Reference and θ⁻ forwards run under no_grad.
RECIPES = {
    "ddpo_sd15_aesthetic": ("sd15", "ddpo"),
    "seppo_sd15_pickapic": ("sd15", "seppo"),
    "ddspo_sd14": ("sd15", "ddspo"),
    "diffusion_dpo_sdxl_pickapic": ("sdxl", "diffusion_dpo"),
    "ddspo_sdxl": ("sdxl", "ddspo"),
    "flow_grpo_sd35_geneval": ("sd35_medium", "flow_grpo"),
    "dgpo_sd35_geneval": ("sd35_medium", "dgpo"),
    "diffusion_nft_sd35_geneval": ("sd35_medium", "diffusion_nft"),
    "vipo_wan": ("wan21_t2v", "vipo"),
}
GRAD_ROWS = {"diffusion_dpo": 2, "ddspo": 2, "seppo": 2, "sft": 1, "ddpo": 2, "flow_grpo": 2, "vipo": 2, "dgpo": 1,
             "diffusion_nft": 1}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
CUDA_OVERHEAD_GIB = 2.0  # CUDA context, cuBLAS/cuDNN workspaces and allocator slack (assumed, not measured)
GPUS = ((24, "24 GB (RTX 4090, A10G, L4)"), (48, "48 GB (L40S, RTX 6000 Ada, A40)"), (80, "80 GB (A100, H100)"),
        (141, "141 GB (H200)"))


# the joint attention also runs the text tokens: SD3.5's CLIP + T5 positions, FLUX's T5 positions (CLIP gives only a
# pooled vector)
TEXT_TOKENS = {"sd35_medium": 77 + 256, "flux1_dev": 512}


def tokens(model: str, size) -> int:
    """Positions the denoiser's activations scale with: h·w latent cells (UNets), (h/2)·(w/2) patches plus the 333
    text positions of the joint attention (SD3.5; FLUX: packed 2×2 latents and its 512 T5 positions),
    F_lat·(h/2)·(w/2) patches (Wan; `size` = (frames, height px, width px)). The UNets' and Wan's text enters only
    through cross-attention keys and values, left out."""
    if MODELS[model].get("video"):
        frames, height, width = size
        return ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)
    if model in TEXT_TOKENS:
        return (size // 2) ** 2 + TEXT_TOKENS[model]
    return size * size


def _size(r: dict):
    return tuple(r["size"]) if isinstance(r["size"], list) else r["size"]


def step_increase(r: dict) -> float:
    """A row's step: its peak above the resident set before it, less the LoRA's gradients and Adam moments (12 bytes
    per parameter, counted apart)."""
    return max(0.0, r["step_peak"] - r["rss_before_step"] - 12 * r["lora_params"])


def activation_fit(rows: list[dict], model: str) -> tuple[float, dict] | None:
    """b: the bytes one training forward + backward keeps per grad row and position, for `model`, from the
    activation probe (`activation_probe`: the denoiser alone at the smallest and at the larger size; a bfloat16 row
    preferred), or else from one method's steps measured at both sizes. Returns (b, the row it came from)."""
    with_probe = [r for r in rows if r["model"] == model and r.get("probe")]
    with_probe.sort(key=lambda r: r["dtype"] != "bfloat16")
    for r in with_probe:
        (t0, m0), (t1, m1) = sorted((int(k), v) for k, v in r["probe"].items())
        if m1 > m0:  # else the larger size's activations are below the resident set's noise (e.g. with checkpointing)
            return (m1 - m0) / (r["probe_rows"] * (t1 - t0)), r
    measured = [r for r in rows if r["model"] == model and r["dtype"] == "bfloat16" and "skipped" not in r]
    by_method = {}
    for r in measured:
        by_method.setdefault(r["method"], {})[tokens(model, _size(r))] = r
    for method, by_size in by_method.items():
        if len(by_size) >= 2:
            (t0, r0), (t1, r1) = min(by_size.items()), max(by_size.items())
            grad_rows = GRAD_ROWS[method] * r0["batch"]
            return max(0.0, (step_increase(r1) - step_increase(r0)) / (grad_rows * (t1 - t0))), r0
    return None


def estimate(rows: list[dict], work: Path) -> str:
    """The GPU memory each paper recipe needs, from the measured rows (see docs/guides/real_size.md for the method)."""
    from hydra import compose, initialize_config_dir

    from diffalign.config.compose import CONFIG_DIR, setup_hydra

    setup_hydra()
    head = ("| recipe | trains | resolution, micro-batch (grad rows × positions) | frozen weights GiB | LoRA, grads, "
            "Adam GiB | step memory GiB | total GiB | GPU |")
    lines = [head, "|" + "---|" * 8]
    for recipe, (model, method) in RECIPES.items():
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            cfg = compose(config_name="train", overrides=[f"recipe={recipe}"])
        arch = load_arch(MODELS[model]["arch"])
        sizes = published_sizes(arch)
        dtype = cfg.model.torch_dtype
        measured = [r for r in rows if r["model"] == model and r["method"] == method and "skipped" not in r]
        fit = activation_fit(rows, model)
        if not measured:
            lines.append(f"| {recipe} | {model} {method} | not measured here |" + " |" * 5)
            continue
        measured.sort(key=lambda r: (r["dtype"] != "bfloat16", tokens(model, _size(r))))
        r = measured[0]  # the method's own step at the smallest size: its fixed cost c
        frozen = sum(n for name, n in sizes.items() if arch["components"][name].get("stand_in") != "skip"
                     or cfg.model.get("load_t5", True)) * DTYPE_BYTES[dtype]
        vae = sizes["vae"]
        if model == "sdxl" and dtype == "float16" and not cfg.model.get("pretrained_vae_model_name_or_path"):
            frozen += vae * 2  # SDXL-base's VAE is kept float32 (force_upcast) unless a VAE fixed for fp16 is given
        if method == "vipo":
            frozen += published_sizes(load_arch("dinov2_large"))["backbone"] * 4  # the PSM backbone, float32
        lora = r["lora_params"] * cfg.model.lora_rank / r["lora_rank"]
        adapters = 16 * lora + 4 * r["frozen_adapter_params"] * cfg.model.lora_rank / r["lora_rank"]
        if MODELS[model].get("video"):
            sizes_px = [((cfg.model.num_frames, cfg.model.height, cfg.model.width), "")]
        else:
            native = arch["components"][arch["denoiser"]]["config"]["sample_size"]
            # the SD3.5 recipes sample at the checkpoint's 1024 px (no SD3 resolution option); the papers at 512 px
            sizes_px = [(native, "")] + ([(64, " at the papers' 512 px")] if model == "sd35_medium" else [])
        for size, label in sizes_px:
            where = f"{size[0]}×{size[1]}×{size[2]}" if MODELS[model].get("video") else f"{size * 8} px"
            n_tok = tokens(model, size)
            grad_rows = GRAD_ROWS[method] * cfg.trainer.batch_size
            c = step_increase(r)
            ckpt = bool(cfg.model.get("gradient_checkpointing", False))
            if fit is None:  # no activation probe for this model: the fixed cost only, a lower bound
                act, note, at_least = c, " (activations not measured: lower bound)", "≥ "
            else:
                b, r0 = fit
                note = "" if ckpt == r0["gradient_checkpointing"] else " (b measured with other checkpointing)"
                note += "" if r0["dtype"] == "bfloat16" else f" (b measured in {r0['dtype']})"
                act, at_least = c + b * grad_rows * n_tok, ""
            total = (frozen + adapters + act) / GIB + CUDA_OVERHEAD_GIB
            gpu = next((name for gib, name in GPUS if total <= 0.9 * gib), "more than one H200: lower the micro-batch")
            gpu = at_least + gpu
            lines.append(f"| {recipe}{label} | {model} {method}{', grad. checkpointing' if ckpt else ''}{note} | "
                         f"{where}, {cfg.trainer.batch_size} ({grad_rows} × {n_tok}) | {frozen / GIB:.1f} ({dtype}) | "
                         f"{adapters / GIB:.2f} | {at_least}{act / GIB:.1f} | {at_least}{total:.0f} | {gpu} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--methods", nargs="+", default=None, help="only these methods (default: every applicable)")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--sizes", nargs="+", default=["min"], choices=["min", "scale"],
                        help="min: the smallest valid size; scale: the model's larger size (activation per token)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "diffalign-real-size",
                        help="where the random weights (bf16, ~20 GB for all four) and runs go; reused")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per child")
    parser.add_argument("--min-free-gib", type=float, default=None,
                        help="MemAvailable needed before a big float32 child (SDXL, SD3.5); default 16")
    parser.add_argument("--wait-for-memory", type=float, default=0.0,
                        help="seconds a child may wait for enough MemAvailable before its row says it did not fit")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--estimate", nargs="+", type=Path, default=None, metavar="ROWS_JSON",
                        help="print the GPU estimate of every paper recipe from rows written with --json, then exit")
    parser.add_argument("--in-memory", action="store_true",
                        help="build the weights inside each child instead of writing them to --work (no disk needed; "
                             "the policy's from_pretrained gets the in-memory pipeline: in_memory_loading)")
    parser.add_argument("--child", nargs=4, metavar=("MODEL", "METHOD", "DTYPE", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    (args.work / "runs").mkdir(parents=True, exist_ok=True)
    if args.estimate:
        rows = [row for path in args.estimate for row in json.loads(path.read_text())]
        print(table(rows))
        print()
        print(estimate(rows, args.work))
        return
    if args.child:
        model, method, dtype, size = args.child
        size = json.loads(size)
        size = tuple(size) if isinstance(size, list) else size
        row = child(model, method, dtype, size, args.work, in_memory=args.in_memory)
        print("ROW " + json.dumps(row), flush=True)
        return
    rows = []
    for model in args.models:
        for size in [MODELS[model][name] for name in args.sizes]:
            # writes the weights once
            model_folder(model, folder_size(model, size), args.work, in_memory=args.in_memory)
            for method in METHODS[model]:
                if args.methods and method not in args.methods:
                    continue
                for dtype in args.dtypes:
                    print(f"[real-size] {model} {method} {dtype} {size_label(model, size)} ...", file=sys.stderr,
                          flush=True)
                    row = run_child(model, method, dtype, size, args.work, args.timeout, args.min_free_gib,
                                    args.in_memory, args.wait_for_memory)
                    print(f"[real-size]   {json.dumps(row)}", file=sys.stderr, flush=True)
                    rows.append(row)
                    if args.json:
                        args.json.write_text(json.dumps(rows, indent=1))
    sizes = {}
    for model in args.models:
        arch = load_arch(MODELS[model]["arch"])
        sizes[model] = published_sizes(arch)
    print(table(rows))
    print()
    print("Parameters of every component from the published configs (meta device; stand-ins at their real size):")
    for model, comps in sizes.items():
        print(f"- {model}: " + ", ".join(f"{k} {fmt_params(v)}" for k, v in comps.items()))


if __name__ == "__main__":
    main()
