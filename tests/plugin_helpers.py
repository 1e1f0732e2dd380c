"""Helpers of the plugin tests (entry points of fake distributions, the ConfigStore's groups restored after each
test), shared by the test modules that install fake plugins."""

import copy
import importlib.metadata

import pytest
from hydra.core.config_store import ConfigStore

from diffalign.config import registry

REAL_ENTRY_POINTS = importlib.metadata.entry_points


@pytest.fixture(autouse=True)
def isolated_config_groups():
    """Restores the ConfigStore's reward/model/method groups after each test, so fake plugins do not leak.

    Only these groups are restored: Hydra registers its own nodes (``hydra/...``) lazily on first use.
    """
    store = ConfigStore.instance()
    groups = [*registry.GROUPS.values(), *registry.REWARD_GROUPS]
    saved = {group: copy.deepcopy(store.repo[group]) for group in groups if group in store.repo}
    yield
    for group in groups:
        store.repo.pop(group, None)
    store.repo.update(saved)


def fake_distribution(tmp_path, dist_name: str, entry_points_txt: str) -> importlib.metadata.Distribution:
    """A real `PathDistribution` (dist-info folder) so entry points carry their distribution name."""
    info = tmp_path / "dists" / f"{dist_name}-0.1.dist-info"  # not on sys.path: found only via the monkeypatch
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist_name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(entry_points_txt)
    return importlib.metadata.PathDistribution(info)


def add_entry_points(monkeypatch, *dists):
    """Makes `importlib.metadata.entry_points(group=...)` return the installed entry points plus those of `dists`."""

    def entry_points(*, group):
        extra = [ep for dist in dists for ep in dist.entry_points if ep.group == group]
        return list(REAL_ENTRY_POINTS(group=group)) + extra

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
