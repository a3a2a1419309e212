"""sparge.integrations' settings (no torch needed): validation, files, per-layer matching, precedence."""

import json

import pytest

import sparge
import sparge.integrations as integ


class Mod:
    """Stands in for an attention module: transformers' carry layer_idx and config."""

    def __init__(self, idx=None):
        if idx is not None:
            self.layer_idx = idx
            self.config = object()


class FakeAttention(Mod):
    pass


class Model:
    def __init__(self, n):
        self.mods = [("model.layers.%d.self_attn" % i, FakeAttention(i)) for i in range(n)]
        self.mods.insert(1, ("model.norm", Mod()))

    def named_modules(self):
        return iter(self.mods)


@pytest.fixture(autouse=True)
def clean_defaults():
    integ.reset()
    yield
    integ.reset()


def test_apply_merges_defaults_file_and_layers(tmp_path):
    f = tmp_path / "tuned.json"
    f.write_text(json.dumps({"default": {"topk": 0.4, "precision": "fp16"},
                             "layers": {"1": {"topk": 0.2}, "model.layers.1?.self_attn": {"enabled": False}}}))
    m = Model(12)
    done = integ.apply(m, f, smooth_k=False, layers={"model.layers.*": {"sim_threshold": 0.5}, 3: {"topk": 1.0}})
    assert len(done) == 12 and "model.norm" not in done
    a = dict(m.mods[0][1].sparge_settings)
    assert a == {"smooth_k": False, "topk": 0.4, "precision": "fp16", "sim_threshold": 0.5}
    assert m.mods[2][1].sparge_settings["topk"] == 0.2          # layer_idx 1 from the file
    assert m.mods[4][1].sparge_settings["topk"] == 1.0          # layer 3 from the argument
    assert m.mods[11][1].sparge_settings["enabled"] is False    # model.layers.10: the glob
    assert "enabled" not in m.mods[10][1].sparge_settings       # model.layers.9
    integ.configure(topk=0.9, on_mask="sdpa")
    st = integ.settings_for(m.mods[2][1], {"precision": "exact"})
    assert st["topk"] == 0.2 and st["on_mask"] == "sdpa" and st["precision"] == "exact"
    assert integ.settings_for(Mod())["topk"] == 0.9


def test_bad_settings_name_the_key(tmp_path):
    with pytest.raises(sparge.InvalidArgumentError, match="unknown setting 'top_k'"):
        integ.configure(top_k=0.5)
    with pytest.raises(sparge.InvalidArgumentError, match="on_mask"):
        integ.configure(on_mask="ignore")
    f = tmp_path / "bad.json"
    f.write_text(json.dumps({"layers": {"0": {"cdf": 0.9}}}))
    with pytest.raises(sparge.InvalidArgumentError, match=r"layers\['0'\]: unknown setting 'cdf'"):
        integ.load_settings(f)
    f.write_text(json.dumps({"defaults": {}}))
    with pytest.raises(sparge.InvalidArgumentError, match="'default' and/or 'layers'"):
        integ.load_settings(f)
    with pytest.raises(sparge.InvalidArgumentError, match="no attention modules"):
        integ.apply(type("Empty", (), {"named_modules": lambda self: iter([("x", Mod())])})(), topk=0.5)


def test_mask_policy():
    with pytest.raises(sparge.UnsupportedError, match="on_mask='sdpa'"):
        integ.mask_policy({}, "here")
    assert integ.mask_policy({"on_mask": "sdpa"}, "here") == "sdpa"
