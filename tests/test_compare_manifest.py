"""A compare folder started by an older pflkit continues under a newer one: a setting added
since (absent from the folder's compare.yaml) counts as unchanged while it is at its default;
any changed or removed setting still refuses the folder."""

from __future__ import annotations

import pytest
import yaml

from pflkit.engine.compare import MANIFEST, _claim
from pflkit.errors import PflkitError


def _older_manifest(cfg, drop: list[tuple[str, str]]) -> str:
    """The compare.yaml an older pflkit wrote: today's, without the settings in ``drop``."""
    free = ("engine", "output", "threads", "compare", "sweep")
    identity = {k: v for k, v in cfg.model_dump(mode="json").items() if k not in free}
    for section, key in drop:
        del identity[section][key]
    return yaml.safe_dump(identity, sort_keys=True)


def test_a_setting_added_at_its_default_does_not_refuse_the_folder(tiny, tmp_path):
    cfg = tiny()
    (tmp_path / MANIFEST).write_text(
        _older_manifest(cfg, [("train", "drop_last"), ("eval", "finetune_epochs")])
    )
    _claim(tmp_path, cfg)  # accepted


@pytest.mark.parametrize(
    "override", [{"train": {"drop_last": True}}, {"eval": {"finetune_epochs": 2}}]
)
def test_a_new_setting_away_from_its_default_refuses_it(tiny, tmp_path, override):
    old = _older_manifest(tiny(), [("train", "drop_last"), ("eval", "finetune_epochs")])
    (tmp_path / MANIFEST).write_text(old)
    with pytest.raises(PflkitError, match="holds a compare of another config"):
        _claim(tmp_path, tiny(**override))


def test_a_changed_or_removed_setting_refuses_it(tiny, tmp_path):
    cfg = tiny()
    changed = yaml.safe_load(_older_manifest(cfg, []))
    changed["train"]["lr"] = 0.123
    (tmp_path / MANIFEST).write_text(yaml.safe_dump(changed))
    with pytest.raises(PflkitError, match="another config"):
        _claim(tmp_path, cfg)
    removed = yaml.safe_load(_older_manifest(cfg, []))
    removed["train"]["no_such_setting"] = 1
    (tmp_path / MANIFEST).write_text(yaml.safe_dump(removed))
    with pytest.raises(PflkitError, match="another config"):
        _claim(tmp_path, cfg)
