"""Hydra plumbing shared by the entry points: the repo root, the config folder, and `compose` for tests."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

ROOT = Path(__file__).resolve().parent.parent          # the repository (editable install)
CONFIG_DIR = ROOT / "configs"

if not OmegaConf.has_resolver("ushash_root"):
    # Paths never depend on the working directory: they hang off the repository root.
    OmegaConf.register_new_resolver("ushash_root", lambda: str(ROOT))


def to_dict(cfg: DictConfig | None) -> dict:
    """Plain, resolved containers before anything reaches a constructor or a checkpoint."""
    return {} if cfg is None else OmegaConf.to_container(cfg, resolve=True)


def compose(config_name: str = "config", overrides: list[str] | None = None) -> DictConfig:
    """The config an entry point would see for these overrides (used by tests and the demo)."""
    from hydra import compose as hydra_compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        return hydra_compose(config_name=config_name, overrides=list(overrides or []))
