"""Composing a run config: the shipped config folder (``CONFIG_DIR``), the shipped assets (``${diffalign_asset:...}``)
and the set-up Hydra needs before it composes (`setup_hydra`). The configs ship inside the package
(``diffalign/configs``), so the commands work from a clone and from an installed wheel.
"""

from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from diffalign.config.registry import register_configs

CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
ASSET_DIR = Path(__file__).resolve().parents[1] / "assets"


def asset_path(name: str) -> str:
    """Absolute path of a shipped asset (``${diffalign_asset:tiny_sd}`` in configs).

    Raises:
        FileNotFoundError: when the asset is missing (the message says how to rebuild it).
    """
    path = ASSET_DIR / name
    if not path.exists():
        raise FileNotFoundError(f"shipped asset {name!r} not found at {path}; reinstall diffalign or rebuild it with "
                                "`python scripts/pretrain_tiny_world.py all`")
    return str(path)


def config_groups_help() -> str:
    """The config groups and their options for ``--help`` (``${diffalign_config_groups:}`` in the help template of
    ``train.yaml`` / ``evaluate.yaml``): Hydra's own listing (``$APP_CONFIG_GROUPS``) less what is not an option to
    choose: the ``schema/*`` groups (the structured configs that `register_configs` stores for the checks) and
    ``accelerate/`` (launch configs for ``accelerate launch --config_file``, refused as ``+accelerate=...``)."""
    from hydra.core.global_hydra import GlobalHydra

    def shown(group: str) -> bool:
        return not any(group == top or group.startswith(f"{top}/") for top in ("hydra", "schema", "accelerate"))

    return GlobalHydra.instance().hydra.format_config_groups(shown)


def setup_hydra() -> None:
    """Registers the ``diffalign_asset`` and ``launch_time`` resolvers and every config (`register_configs`): what
    composing a config of ``CONFIG_DIR`` needs, done once before Hydra starts (idempotent)."""
    if not OmegaConf.has_resolver("diffalign_asset"):
        OmegaConf.register_new_resolver("diffalign_asset", asset_path)
    # default run folders: one per launch, not per process
    # (docs/guides/field_cases.md#one-run-folder-for-all-processes)
    if not OmegaConf.has_resolver("launch_time"):
        from diffalign.runtime.launch import launch_time

        OmegaConf.register_new_resolver("launch_time", launch_time, use_cache=True)
    if not OmegaConf.has_resolver("diffalign_config_groups"):
        OmegaConf.register_new_resolver("diffalign_config_groups", config_groups_help)
    register_configs()
