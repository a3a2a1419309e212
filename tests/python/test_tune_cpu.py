"""sparge tune on the CPU backend: the settings it writes meet the target when used, the file
round-trips, malformed files are refused with the line, and the capture helper."""

import os
import subprocess
import sys

import numpy as np
import pytest

import sparge
from sparge import tune as T
from sparge import yardstick as Y

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SLICE = os.path.join(ROOT, "tests", "data", "captures", "smollm2_L1024_layer15.npz")


def _small_capture(rng, causal):
    base = rng.standard_normal((2, 10, 32)) * 1.5
    k = np.repeat(base, 64, axis=1) + rng.standard_normal((2, 640, 32))
    q = np.repeat(np.repeat(base, 64, axis=1), 2, axis=0) + rng.standard_normal((4, 640, 32))
    v = rng.standard_normal((2, 640, 32))
    return Y.Capture(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32), causal, "t", None)


@pytest.mark.parametrize("metric,target", [("rel_l1", 0.08), ("cosine", 0.995)])
@pytest.mark.parametrize("causal", [False, True])
def test_tuned_settings_meet_the_target(rng, tmp_path, metric, target, causal):
    caps = [_small_capture(rng, causal), _small_capture(rng, causal)]
    layer = T.tune_layer("blk0", caps, metric, target)
    assert layer.heads == 4 and len(layer.values) == 4 and len(layer.sim_threshold) == 4
    assert T._meets(metric, layer.measured, target)
    assert layer.density < 1.0
    # the written file, loaded and used through the public API, gives the measured numbers
    path = str(tmp_path / "tuned.txt")
    T.write_tuned(path, [layer])
    got = sparge.load_tuned(path)["blk0"]
    assert got.mode == layer.mode and got.sink == layer.sink and got.window == layer.window
    assert got.estimator == layer.estimator in ("mean", "keys_lse", "keys_lse_adaptive", "keys_lse_split2")
    np.testing.assert_allclose(got.values, layer.values, rtol=1e-5)
    for cap in caps:
        mask = sparge.predict_mask(cap.q[None], cap.k[None], is_causal=causal, precision="exact",
                                   **got.kwargs())[0]
        vis = Y.visible(640, 640, causal)
        tot = Y.Score()
        for h in range(4):
            tot.add(Y.score_mask(Y.head_pass(cap, h), mask[h], vis))
        value = tot.rel_l1 if metric == "rel_l1" else tot.cosine
        assert T._meets(metric, value, target)
        assert tot.zero_rows == 0


def test_a_tighter_target_costs_density(rng):
    cap = _small_capture(rng, True)
    loose = T.tune_layer("a", [cap], "rel_l1", 0.2)
    tight = T.tune_layer("a", [cap], "rel_l1", 0.02)
    assert tight.density >= loose.density
    assert tight.measured <= 0.02 and loose.measured <= 0.2


@pytest.mark.parametrize("text,needle", [
    ("sparge-tune 2\n", "header"),
    ("sparge-tune 1\nlayer a heads 2 causal 1 mode topk sink 1 window 1 estimator mean\ntopk 0.5\n", "expected 2"),
    ("sparge-tune 1\nlayer a heads 2 causal 1 mode topk sink 1 window 1 estimator mean\ntopk 0.5 2\n", "(0, 1]"),
    ("sparge-tune 1\nlayer a heads 1 causal 1 mode topk sink 1 window 1 estimator mean\ntopk 0.5\nsim_threshold 0\n", "no 'end'"),
    ("sparge-tune 1\nlayer a heads 1 causal 1 mode cdf sink 1 window 1 estimator mean\ntopk 0.5\n", "mode cdf"),
    ("sparge-tune 1\ntopk 0.5\n", "outside a layer"),
    ("sparge-tune 1\nlayer a heads 1 causal 1 mode topk sink 1 window 1 estimator max\n", "estimator must be"),
    ("sparge-tune 1\nlayer a heads 1 causal 1 mode topk sink 1 window 1 estimator\n", "expected 'layer"),
    ("sparge-tune 1\nlayer a heads 1 causal 1 mode topk sink 1 estimator mean\n", "expected 'layer"),
    ("sparge-tune 1\nlayer a heads 1 causal 3 mode topk sink 1 window 1 estimator mean\n", "causal and sink"),
])
def test_malformed_files(tmp_path, text, needle):
    p = tmp_path / "bad.txt"
    p.write_text(text)
    with pytest.raises(T.TunedFileError, match="bad.txt:[0-9]+: .*" + needle.replace("(", r"\(").replace(")", r"\)")):
        sparge.load_tuned(str(p))


def test_estimator_default_and_older_files(tmp_path):
    # a layer made without an estimator takes the library's default, "auto"; the file always names the
    # estimator it resolves to: keys_lse for a causal layer, keys_lse_adaptive otherwise
    layer = T.TunedLayer("a", 1, True, "topk", True, 1, [0.5], [-0.1])
    assert layer.estimator == "auto" and layer.kwargs()["estimator"] == "auto"
    path = str(tmp_path / "new.txt")
    T.write_tuned(path, [layer])
    assert " estimator keys_lse\n" in open(path).read()
    assert sparge.load_tuned(path)["a"].estimator == "keys_lse"
    T.write_tuned(path, [T.TunedLayer("b", 1, False, "topk", True, 1, [0.5], [-0.1])])
    assert " causal 0 mode topk sink 1 window 1 estimator keys_lse_adaptive\n" in open(path).read()
    assert sparge.load_tuned(path)["b"].estimator == "keys_lse_adaptive"
    # "auto" is not a file's estimator
    bad = tmp_path / "auto.txt"
    bad.write_text(open(path).read().replace("keys_lse_adaptive", "auto"))
    with pytest.raises(T.TunedFileError, match="estimator must be"):
        sparge.load_tuned(str(bad))
    # a layer line without the estimator pair, as written before sparge tune chose the estimator (when the
    # library's default was the mean rule), still means mean
    old = tmp_path / "old.txt"
    old.write_text("sparge-tune 1\nlayer a heads 1 causal 1 mode topk sink 1 window 1\ntopk 0.5\n"
                   "sim_threshold -0.1\nmeasured rel_l1 0.05 density 0.5 target 0.06\nend\n")
    got = sparge.load_tuned(str(old))["a"]
    assert got.estimator == "mean" and got.kwargs()["estimator"] == "mean"
    assert got.sink and got.window == 1 and got.values == [0.5]
    # the two-group estimator round-trips
    layer.estimator = "keys_lse_split2"
    T.write_tuned(path, [layer])
    assert " estimator keys_lse_split2\n" in open(path).read()
    assert sparge.load_tuned(path)["a"].kwargs()["estimator"] == "keys_lse_split2"
    layer.estimator = "keys_lse_adaptive"
    T.write_tuned(path, [layer])
    assert " estimator keys_lse_adaptive\n" in open(path).read()
    assert sparge.load_tuned(path)["a"].kwargs()["estimator"] == "keys_lse_adaptive"


def test_capture_helper_roundtrip(rng, tmp_path):
    q = rng.standard_normal((2, 300, 4, 16)).astype(np.float32)  # NHD, batch 2
    k = rng.standard_normal((2, 300, 2, 16)).astype(np.float32)
    v = rng.standard_normal((2, 300, 2, 16)).astype(np.float32)
    p = T.capture(q, k, v, str(tmp_path / "c.npz"), is_causal=True, layout="NHD", name="blk 3", batch=1)
    cap = Y.load(p)
    assert cap.causal and cap.name == "blk 3"
    np.testing.assert_allclose(cap.q, q[1].transpose(1, 0, 2), rtol=1e-3, atol=1e-3)  # stored as float16
    np.testing.assert_allclose(cap.k, k[1].transpose(1, 0, 2), rtol=1e-3, atol=1e-3)
    with pytest.raises(ValueError, match="inconsistent"):
        T.capture(q, k[:, :, :1], v, str(tmp_path / "d.npz"), layout="NHD")


def test_capture_from_torch(tmp_path):
    torch = pytest.importorskip("torch")
    q = torch.randn(1, 4, 200, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 200, 16, dtype=torch.bfloat16)
    cap = Y.load(T.capture(q, k, k, str(tmp_path / "t.npz")))
    np.testing.assert_allclose(cap.q, q[0].float().numpy(), rtol=1e-2, atol=1e-2)


def test_command_line(tmp_path):
    out = tmp_path / "tuned.txt"
    # The sparge package this test imported (the source tree, or an installed copy with its library).
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(sparge.__file__))))
    r = subprocess.run([sys.executable, "-m", "sparge", "tune", SLICE, "--rel-l1", "0.15", "--out", str(out)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "heads" in r.stderr  # progress on the terminal
    layers = sparge.load_tuned(str(out))
    (layer,) = layers.values()
    assert layer.heads == 9 and layer.causal and layer.measured <= 0.15


def test_ties_go_to_keys_lse_across_settings(rng, monkeypatch):
    """Equal density for a mean candidate visited early (no sink, no window) and a keys_lse one with
    another sink: the tuner keeps keys_lse (the cheapest estimator), whatever the order of the settings."""
    cap = _small_capture(rng, False)

    class Fake:
        def __init__(self, density):
            self.rel_l1, self.cosine, self.density = 0.0, 1.0, density

    def fake_mask(cap_, st, sim):
        return [(st.sink, st.window, st.estimator)] * cap_.Hq

    def fake_score(hp, m, vis):
        cheap = m in [(False, 0, "mean"), (True, 0, "keys_lse")]
        return Fake(0.3 if cheap else 0.9)

    monkeypatch.setattr(T, "_library_mask", fake_mask)
    monkeypatch.setattr(Y, "score_mask", fake_score)
    monkeypatch.setattr(T, "_evaluate_layer", lambda cap_, layer: Fake(0.3))
    layer = T.tune_layer("tie", [cap], "rel_l1", 0.1)
    assert layer.estimator == "keys_lse"
    assert (layer.sink, layer.window) == (True, 0)


@pytest.mark.parametrize("cheap,chosen", [
    (("keys_lse_adaptive",), "keys_lse_adaptive"),  # tried
    (("keys_lse_adaptive", "keys_lse_split2"), "keys_lse_adaptive"),  # a tie with split2: the cheaper
    (("keys_lse", "keys_lse_adaptive"), "keys_lse"),  # a tie with keys_lse (no block split): the cheapest
    (("keys_lse_split2",), "keys_lse_split2"),
])
def test_tune_tries_adaptive_before_split2(rng, monkeypatch, cheap, chosen):
    """sparge tune considers keys_lse_adaptive, after keys_lse and before keys_lse_split2: of equal
    densities keys_lse wins, then the estimator that splits fewer blocks."""
    cap = _small_capture(rng, False)

    class Fake:
        def __init__(self, density):
            self.rel_l1, self.cosine, self.density = 0.0, 1.0, density

    monkeypatch.setattr(T, "_library_mask", lambda cap_, st, sim: [st.estimator] * cap_.Hq)
    monkeypatch.setattr(Y, "score_mask", lambda hp, m, vis: Fake(0.3 if m in cheap else 0.9))
    monkeypatch.setattr(T, "_evaluate_layer", lambda cap_, layer: Fake(0.3))
    assert T.tune_layer("t", [cap], "rel_l1", 0.1).estimator == chosen
