"""The hub path of the example: from_pretrained on a model saved locally with save_pretrained."""

from __future__ import annotations

import torch

from train_fn.digits import DEFAULTS, build_model


def test_from_pretrained_loads_the_saved_weights(tmp_path):
    torch.manual_seed(0)
    saved = build_model(dict(DEFAULTS))
    saved.save_pretrained(tmp_path / "model")
    loaded = build_model({**DEFAULTS, "name_or_path": str(tmp_path / "model")})
    a, b = saved.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
