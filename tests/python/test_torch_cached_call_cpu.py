"""The prepared-call cache of eager torch calls (_torch_ops.fast_attention), on CPU tensors: a repeated
call gives the general path's result, a changed argument (pointer, shape, strides, dtype, options) is
checked again, errors are the general path's, threads and clear_caches() are safe."""

import gc
import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import sparge  # noqa: E402
from helpers import make_qkv  # noqa: E402
from sparge import _api, _core  # noqa: E402


def _ops():
    return _api._ops()


def _general(fn):
    """fn() with the cache off (the general eager path)."""
    _ops()
    fast, _api._FAST = _api._FAST, None
    try:
        return fn()
    finally:
        _api._FAST = fast


def _tensors(rng, **kw):
    return tuple(torch.from_numpy(x) for x in make_qkv(rng, **kw))


def _mask(B, H, Lq, Lkv, seed=0, dtype=torch.uint8):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(B, H, -(-Lq // 128), -(-Lkv // 64), generator=g) < 0.6
    m[..., 0] = True
    return m if dtype is torch.bool else m.to(dtype)


def _same(a, b):
    if isinstance(a, tuple):
        assert isinstance(b, tuple) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
        return
    assert a.shape == b.shape and a.dtype == b.dtype and a.stride() == b.stride()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("kw", [
    dict(),
    dict(mask="uint8"),
    dict(mask="bool"),
    dict(mask="uint8", return_lse=True),
    dict(return_lse=True, is_causal=True),
    dict(layout="NHD", mask="uint8"),
    dict(layout="NHD", return_lse=True, topk=0.3),
])
def test_repeated_call_equals_general_path(rng, kw):
    kw = dict(kw)
    layout = kw.get("layout", "HND")
    q, k, v = _tensors(rng, B=1, Hq=4, Hkv=2, Lq=200, Lkv=260, D=32, layout=layout)
    if "mask" in kw:
        kw["mask"] = _mask(1, 4, 200, 260, dtype=torch.bool if kw["mask"] == "bool" else torch.uint8)
    ops = _ops()
    sparge.clear_caches()
    want = _general(lambda: sparge.attention(q, k, v, precision="exact", **kw))
    assert len(ops._CALLS) == 0
    first = sparge.attention(q, k, v, precision="exact", **kw)
    assert len(ops._CALLS) == 1
    again = sparge.attention(q, k, v, precision="exact", **kw)
    assert len(ops._CALLS) == 1
    _same(first, want)
    _same(again, want)
    out = again[0] if isinstance(again, tuple) else again
    assert out.is_contiguous() and out.shape == q.shape
    assert out is not (first[0] if isinstance(first, tuple) else first)  # a new output per call


def test_caller_output(rng):
    q, k, v = _tensors(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=32)
    m = _mask(1, 2, 256, 256)
    want = _general(lambda: sparge.attention(q, k, v, mask=m, precision="exact"))
    o = torch.full_like(q, float("nan"))
    for _ in range(3):
        o.fill_(float("nan"))
        res = sparge.attention(q, k, v, mask=m, precision="exact", out=o)
        assert res is o
        _same(o, want)
    # an output view with other strides (NHD storage seen as HND) is a different key
    base = torch.full((1, 256, 2, 32), float("nan"))
    ov = base.transpose(1, 2)
    res = sparge.attention(q, k, v, mask=m, precision="exact", out=ov)
    assert res is ov
    torch.testing.assert_close(ov, want, rtol=0, atol=0)


def test_changed_arguments_are_checked_again(rng):
    ops = _ops()
    sparge.clear_caches()
    q, k, v = _tensors(rng, B=1, Hq=2, Hkv=1, Lq=256, Lkv=256, D=32)
    m = _mask(1, 2, 256, 256)
    run = lambda *a, **kw: sparge.attention(*a, precision="exact", **kw)  # noqa: E731
    gen = lambda *a, **kw: _general(lambda: sparge.attention(*a, precision="exact", **kw))  # noqa: E731
    _same(run(q, k, v, mask=m), gen(q, k, v, mask=m))
    n = len(ops._CALLS)
    # same pointers, new contents: the same entry, the new result
    q.mul_(-0.5)
    m[0, 1].zero_()
    m[0, 1, :, 0] = 1
    _same(run(q, k, v, mask=m), gen(q, k, v, mask=m))
    assert len(ops._CALLS) == n
    # other pointers
    q2 = q.clone()
    _same(run(q2, k, v, mask=m), gen(q2, k, v, mask=m))
    assert len(ops._CALLS) == n + 1
    # same pointer, other shape (a shorter view), other strides, other dtype
    _same(run(q[:, :, :200], k, v, mask=m[:, :, :2]), gen(q[:, :, :200], k, v, mask=m[:, :, :2]))
    qs = torch.empty(1, 256, 2, 32).transpose(1, 2)
    qs.copy_(q)
    _same(run(qs, k, v, mask=m), gen(qs, k, v, mask=m))
    h = [t.to(torch.float16) for t in (q, k, v)]
    _same(run(*h, mask=m, topk=0.5), gen(*h, mask=m, topk=0.5))
    b = [t.view(torch.bfloat16) for t in h]  # the fp16 bytes seen as bf16
    _same(run(*b, mask=m), gen(*b, mask=m))
    # other options (another shared options object)
    _same(run(q, k, v, mask=m, is_causal=True), gen(q, k, v, mask=m, is_causal=True))
    _same(run(q, k, v, scale=0.1), gen(q, k, v, scale=0.1))
    # the same values of another type are other options
    _same(run(q, k, v, mask=m, is_causal=1), gen(q, k, v, mask=m, is_causal=True))


def test_errors_are_the_general_paths(rng):
    q, k, v = _tensors(rng, B=1, Hq=2, Hkv=1, Lq=256, Lkv=256, D=32)
    m = _mask(1, 2, 256, 256)
    sparge.attention(q, k, v, mask=m, precision="exact")
    sparge.attention(q, k, v, mask=m, precision="exact")
    bad = [
        dict(q=q, k=k, v=v, mask=m[:, :, :1]),
        dict(q=q, k=k, v=v, mask=m.to(torch.int32)[:, :, :1]),
        dict(q=q, k=k[..., :16], v=v, mask=m),
        dict(q=q, k=k, v=v[:, :, :100], mask=m),
        dict(q=q[..., ::2], k=k, v=v, mask=m),
        dict(q=q, k=k.to(torch.float16), v=v, mask=m),
        dict(q=q, k=k, v=v, mask=m, out=torch.empty(1, 2, 256, 16)),
        dict(q=q, k=k, v=v, mask=m, out=torch.empty(1, 2, 256, 32, dtype=torch.float16)),
        dict(q=q, k=k, v=v, mask=m.numpy()),
        dict(q=q, k=k.numpy(), v=v, mask=m),
        dict(q=q, k=k, v=v, mask=torch.empty(1, 2, 2, 4, dtype=torch.uint8, device="meta")),
        dict(q=q[0], k=k, v=v),
    ]
    for a in bad:
        with pytest.raises(Exception) as general:
            _general(lambda: sparge.attention(a["q"], a["k"], a["v"], mask=a.get("mask"), out=a.get("out"),
                                              precision="exact"))
        for _ in range(2):
            with pytest.raises(type(general.value)) as cached:
                sparge.attention(a["q"], a["k"], a["v"], mask=a.get("mask"), out=a.get("out"), precision="exact")
            assert str(cached.value) == str(general.value)
    # a mask of another integer dtype is converted (general path), as before
    _same(sparge.attention(q, k, v, mask=m.to(torch.int64), precision="exact"),
          _general(lambda: sparge.attention(q, k, v, mask=m, precision="exact")))


def test_sdpa_repeated(rng):
    ops = _ops()
    sparge.clear_caches()
    for L, S in ((256, 256), (128, 320), (320, 128)):
        q = _tensors(rng, B=1, Hq=2, Hkv=2, Lq=L, Lkv=L, D=32)[0]
        _, k, v = _tensors(rng, B=1, Hq=2, Hkv=2, Lq=S, Lkv=S, D=32)
        for causal in (False, True):
            want = _general(lambda: sparge.sdpa(q, k, v, is_causal=causal, precision="exact"))
            for _ in range(2):
                _same(sparge.sdpa(q, k, v, is_causal=causal, precision="exact"), want)
            _same(sparge.sdpa(q[0], k[0], v[0], is_causal=causal, precision="exact"), want[0])
    assert len(ops._CALLS) > 0


def test_threads_share_nothing(rng):
    """Concurrent repeated calls from several threads (per-thread entries and workspaces)."""
    import concurrent.futures as cf

    ops = _ops()
    sparge.clear_caches()
    inputs = [_tensors(rng, B=1, Hq=2, Hkv=1, Lq=256, Lkv=256, D=32) for _ in range(3)]
    wants = [_general(lambda: sparge.attention(*t, precision="exact", return_lse=True)) for t in inputs]
    barrier = threading.Barrier(4)

    def work(i):
        barrier.wait()
        bad = 0
        for j in range(30):
            t = (i + j) % 3
            out, lse = sparge.attention(*inputs[t], precision="exact", return_lse=True)
            bad += not (torch.equal(out, wants[t][0]) and torch.equal(lse, wants[t][1]))
        return bad

    with cf.ThreadPoolExecutor(4) as ex:
        assert sum(ex.map(work, range(4))) == 0
    assert len(ops._CALLS) >= 4


def test_entries_hold_no_plan_and_clear_caches_empties_them(rng):
    ops = _ops()
    sparge.clear_caches()
    q, k, v = _tensors(rng, B=1, Hq=1, Hkv=1, Lq=128, Lkv=128, D=16)
    want = sparge.attention(q, k, v, precision="exact")
    sparge.attention(q, k, v, precision="exact")
    assert len(ops._CALLS) == 1
    plan = next(iter(_core.PLANS._d.values()))
    fin = plan._finalizer
    del plan
    _core.PLANS.clear()  # the entry stays, but does not keep the plan alive
    gc.collect()
    assert not fin.alive
    _same(sparge.attention(q, k, v, precision="exact"), want)  # a new plan, checked again
    assert len(_core.PLANS) == 1
    # the allocator's workspace replaced: checked again, the new one used
    from sparge import _arrays

    _arrays.torch_allocator()._host.clear()
    _same(sparge.attention(q, k, v, precision="exact"), want)
    sparge.clear_caches()
    assert len(ops._CALLS) == 0


def test_capacity(rng, monkeypatch):
    ops = _ops()
    sparge.clear_caches()
    monkeypatch.setattr(ops, "_CALLS_CAPACITY", 4)
    q, k, v = _tensors(rng, B=1, Hq=1, Hkv=1, Lq=128, Lkv=128, D=16)
    for i in range(10):
        sparge.attention(q, k, v, precision="exact", topk=0.1 * (i + 1))
        assert len(ops._CALLS) <= 4
    sparge.clear_caches()


def test_dispatch_mode_and_flag_take_the_custom_op(rng, monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    ops = _ops()
    q, k, v = _tensors(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=16)
    want = sparge.attention(q, k, v, precision="exact")
    seen = []

    class Log(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Log():
        got = sparge.attention(q, k, v, precision="exact")
    assert any("sparge.attention" in s for s in seen), seen
    _same(got, want)
    monkeypatch.setattr(_api, "EAGER_DIRECT", False)
    calls = []
    real = ops.fast_attention
    monkeypatch.setattr(_api, "_FAST", lambda *a: calls.append(1) or real(*a))
    _same(sparge.attention(q, k, v, precision="exact"), want)
    assert not calls


def test_numpy_calls_unaffected(rng):
    _ops()
    q, k, v = make_qkv(rng, B=1, Hq=2, Hkv=1, Lq=128, Lkv=128, D=16)
    a = sparge.attention(q, k, v, precision="exact")
    b = sparge.attention(q, k, v, precision="exact")
    assert isinstance(a, np.ndarray)
    np.testing.assert_array_equal(a, b)
