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


# ------------------------------------------------------------------ stale entries
# The cases below change one property of one argument between calls whose other arguments repeat
# (so the entry of the earlier call is there to be wrongly reused) and check the cached call against
# the general path: results, strides, errors, and the very arguments the library receives.


def _check_like_general(fn):
    """fn() through the cache equals fn() on the general path: the same result, or the same error."""
    try:
        want = _general(fn)
    except Exception as e:  # noqa: BLE001 - whatever the general path raises
        for _ in range(2):
            with pytest.raises(type(e)) as got:
                fn()
            assert str(got.value) == str(e)
        return
    def snap(t):  # a copy with t's strides (want may be a caller's out, written again below)
        return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype).copy_(t)

    want = tuple(snap(t) for t in want) if isinstance(want, tuple) else snap(want)
    for _ in range(2):
        _same(fn(), want)


def test_same_pointer_other_metadata_of_each_argument(rng):
    """Each case right after the call it varies (so that call's entry is the one its key finds)."""
    ops = _ops()
    sparge.clear_caches()
    q, k, v = _tensors(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=32)
    m = _mask(1, 2, 256, 256)
    o = torch.empty_like(q)

    def run(q=q, k=k, v=v, m=m, out=None, **kw):
        def fn():
            if out is not None:
                out.fill_(float("nan"))
            return sparge.attention(q, k, v, mask=m, out=out, precision="exact", **kw)
        return fn

    kt = torch.empty(1, 256, 2, 32).transpose(1, 2)  # k's values, other strides ...
    kt.copy_(k)
    ks = kt.as_strided(k.shape, k.stride())  # ... and k's strides, at kt's address
    ks.copy_(k)
    ot = o.as_strided(o.shape, (16384, 32, 64, 1))  # o's memory as [B, L, H, D] seen as HND
    cases = [
        (run(), [run(k=kt), run(k=ks), run(k=kt, v=kt)]),
        (run(k=kt), [run(k=ks), run(k=k.as_strided(k.shape, kt.stride()))]),  # kt's strides at k's address
        (run(), [run(k=k[:, :, :200], v=v[:, :, :200]),  # shorter views at the same addresses
                 run(v=v[:, :1]),  # fewer heads
                 run(k=k.view(torch.int32)), run(v=v.view(torch.int32)),  # other dtypes, same bytes
                 run(k=k.to(torch.float16).view(torch.bfloat16)),
                 run(k=k[:, :, :1].expand(1, 2, 256, 32)), run(v=v[:, :, :1].expand(1, 2, 256, 32)),  # zero strides
                 run(k=k.as_strided(k.shape, (0,) + k.stride()[1:])),  # a stride of a size-1 dim
                 run(m=m[:, :1]), run(m=m.view(torch.bool)), run(m=m.view(torch.int8)),
                 run(m=m.as_strided(m.shape, (8, 4, 0, 1))),  # the mask's first row twice
                 run(m=m[..., :2]), run(m=m.float()), run(k=k.to("meta")), run(m=m.to("meta"))]),
        (run(out=o), [run(out=ot), run(out=o[:, :1]), run(out=o.view(torch.int32)), run(out=o[:, :, :200]),
                      run(q=q[:, :, :200], out=o[:, :, :200])]),
        (run(out=ot), [run(out=o)]),
    ]
    for base, variants in cases:
        for fn in variants:
            _check_like_general(base)  # the entry the variant's key finds
            _check_like_general(fn)
    assert len(ops._CALLS) > 0


@pytest.mark.parametrize("change", ["transpose_", "as_strided_", "resize_", "set_", "data", "unsqueeze_",
                                    "t_data"])
def test_metadata_changed_in_place(rng, change):
    """The same tensor objects, their metadata changed in place (some of these changes bump no version
    counter): the key reads every property on every call."""
    _ops()
    sparge.clear_caches()
    q, k, v = _tensors(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=32)
    m = _mask(1, 2, 256, 256)
    fn = lambda: sparge.attention(q, k, v, mask=m, precision="exact", return_lse=True)  # noqa: E731
    _check_like_general(fn)
    other = _tensors(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=32)[1]
    if change == "transpose_":
        k.transpose_(1, 2)  # [1, 256, 2, 32] seen as HND: an error
    elif change == "as_strided_":
        k.as_strided_((1, 2, 128, 32), (16384, 8192, 64, 1))  # every other row
    elif change == "resize_":
        k.resize_(1, 2, 128, 32)
    elif change == "set_":
        k.set_(other.untyped_storage(), 0, other.shape, other.stride())
    elif change == "data":
        k.data = other[:, :, :192]
    elif change == "unsqueeze_":
        m.unsqueeze_(0)
    elif change == "t_data":
        m.data = m.data.transpose(2, 3).contiguous().transpose(2, 3)
    _check_like_general(fn)


def test_outputs_are_fresh_per_call(rng):
    _ops()
    sparge.clear_caches()
    for layout in ("HND", "NHD"):
        q, k, v = _tensors(rng, B=1, Hq=2, Hkv=1, Lq=256, Lkv=256, D=32, layout=layout)
        calls = [sparge.attention(q, k, v, precision="exact", return_lse=True, layout=layout) for _ in range(3)]
        kept = [(o.clone(), l.clone()) for o, l in calls]
        q.mul_(-1.5)  # same entry, other values
        new = sparge.attention(q, k, v, precision="exact", return_lse=True, layout=layout)
        ptrs = {t.data_ptr() for c in calls + [new] for t in c}
        assert len(ptrs) == 8  # no output shares memory with another one
        for (o, l), (o0, l0) in zip(calls, kept):  # earlier outputs are not written again
            assert torch.equal(o, o0) and torch.equal(l, l0)
        assert not torch.equal(new[0], calls[0][0])
        _same(new, _general(lambda: sparge.attention(q, k, v, precision="exact", return_lse=True, layout=layout)))


def test_output_strides_of_strided_inputs(rng):
    """Outputs are contiguous (the general path's new_empty) whatever q's strides: a q of other strides
    (no q template), a q with an unusual stride on a dimension of size 1, a zero-size batch."""
    _ops()
    sparge.clear_caches()
    q, k, v = _tensors(rng, B=1, Hq=2, Hkv=2, Lq=256, Lkv=256, D=32)
    qt = torch.empty(1, 256, 2, 32).transpose(1, 2)
    qt.copy_(q)
    q1 = q.as_strided(q.shape, (7,) + q.stride()[1:])  # size-1 batch of stride 7: is_contiguous() anyway
    assert q1.is_contiguous() and q1.stride() != q.stride()
    for qq in (qt, q1, q):
        for lse in (False, True):
            fn = lambda: sparge.attention(qq, k, v, precision="exact", return_lse=lse)  # noqa: E731
            _check_like_general(fn)
            res = fn()
            o = res[0] if lse else res
            assert o.stride() == (16384, 8192, 32, 1)
    z = [t[:0] for t in (q, k, v)]
    _check_like_general(lambda: sparge.attention(*z, precision="exact", return_lse=True))


def test_entry_replaced_when_metadata_differs(rng):
    """One entry per key (pointers, options, thread, stream): views of other shapes at the same
    addresses, alternating, replace it and give their own results."""
    ops = _ops()
    sparge.clear_caches()
    q, k, v = _tensors(rng, B=1, Hq=2, Hkv=1, Lq=256, Lkv=256, D=32)
    views = [q, q[:, :, :200], q[:, :, :128], q[:, :1]]
    wants = [_general(lambda: sparge.attention(x, k, v, precision="exact")) for x in views]
    sparge.attention(q, k, v, precision="exact")
    n = len(ops._CALLS)
    for _ in range(3):
        for x, want in zip(views, wants):
            _same(sparge.attention(x, k, v, precision="exact"), want)
    assert len(ops._CALLS) == n


def test_library_receives_the_general_paths_arguments(rng, monkeypatch):
    """Every argument of sparge_attention_run, decoded: the descriptors (data, device, dtype, shape,
    strides), the predict parameters, the workspace and the stream of a cached call are those the
    general path passes for the same call, and the output descriptors point at the returned tensors."""
    from sparge import _capi as C

    ops = _ops()
    sparge.clear_caches()
    real_proto, real_noproto = _core._run_fn(), _core._run_fn_noproto()
    seen = []

    def value(a):
        if a is None or isinstance(a, int):
            return a or None
        return a.value or None

    def desc(addr):
        if addr is None:
            return None
        t = C.SpargeTensor.from_address(addr)
        return (t.data, t.device_type, t.device_id, t.dtype, t.ndim, tuple(t.shape[:t.ndim]),
                tuple(t.strides[:t.ndim]))

    def decode(args):
        a = [value(x) for x in args]
        p = C.SpargePredictParams.from_address(a[5])
        params = tuple(getattr(p, f) for f, _ in C.SpargePredictParams._fields_)
        return [a[0], desc(a[1]), desc(a[2]), desc(a[3]), desc(a[4]), params, desc(a[6]), desc(a[7]),
                a[8], a[9], a[10]]

    def rec(real, path):
        def fn(*args):
            seen.append([path] + decode(args))
            return real(*args)
        return fn

    monkeypatch.setattr(_core, "_RUN_FN", rec(real_proto, "general"))
    monkeypatch.setattr(_core, "_RUN_FN_NOPROTO", rec(real_noproto, "cached"))
    q, k, v = _tensors(rng, B=1, Hq=4, Hkv=2, Lq=256, Lkv=320, D=32)
    m = _mask(1, 4, 256, 320)
    o = torch.empty_like(q)
    variants = [dict(), dict(mask=m), dict(mask=m, return_lse=True), dict(out=o, return_lse=True),
                dict(is_causal=True, topk=0.25), dict(mask=m.view(torch.bool))]
    for kw in variants:
        for qq in (q, q[:, :, :192]):
            if "out" in kw:
                kw["out"] = o[:, :, :qq.shape[2]]
            seen.clear()
            gen = _general(lambda: sparge.attention(qq, k, v, precision="exact", **kw))
            assert len(seen) == 1 and seen[0][0] == "general"
            want = seen[0][1:]
            for _ in range(3):
                seen.clear()
                res = sparge.attention(qq, k, v, precision="exact", **kw)
                assert len(seen) == 1 and seen[0][0] == "cached"
                got = seen[0][1:]
                outs = res if isinstance(res, tuple) else (res,)
                assert got[6][0] == outs[0].data_ptr()
                if kw.get("return_lse"):
                    assert got[7][0] == outs[1].data_ptr()
                for i in (6, 7):  # the outputs differ in their addresses only
                    if want[i] is not None:
                        want[i] = (got[i][0],) + want[i][1:]
                assert got == want
                _same(res, gen)
    # the allocator's workspace replaced by a larger one (a larger problem on this thread) while
    # the old buffer is still alive: the entry takes the new one
    from sparge import _arrays

    host = _arrays.torch_allocator()._host
    sparge.attention(q, k, v, precision="exact")
    old = host._bufs.get(threading.get_ident())
    assert old is not None
    big = _tensors(rng, B=2, Hq=4, Hkv=2, Lq=1024, Lkv=1024, D=64)
    sparge.attention(*big, precision="exact")
    assert host._bufs.get(threading.get_ident()) is not old
    seen.clear()
    _general(lambda: sparge.attention(q, k, v, precision="exact"))
    want = seen[0][1:]
    for _ in range(2):
        seen.clear()
        res = sparge.attention(q, k, v, precision="exact")
        got = seen[0][1:]
        want[6] = (got[6][0],) + want[6][1:]
        assert seen[0][0] == "cached" and got == want
    del old
    assert len(ops._CALLS) > 0


def test_option_memo_keeps_types_apart(rng):
    """The options memo (by identity) never stands in for values that are equal but of another type,
    and more option sets than it holds, alternating, each get their own results."""
    from sparge import _api as api

    _ops()
    sparge.clear_caches()
    q, k, v = _tensors(rng, B=1, Hq=2, Hkv=1, Lq=256, Lkv=256, D=32)
    run = lambda **kw: lambda: sparge.attention(q, k, v, precision="exact", **kw)  # noqa: E731
    for _ in range(2):
        run(local_window=1)()
    with pytest.raises(sparge.InvalidArgumentError):
        sparge.attention(q, k, v, precision="exact", local_window=True)  # True == 1, but not a window
    with pytest.raises(sparge.InvalidArgumentError):
        sparge.attention(q, k, v, precision="exact", block_size=(128, True))
    sets = [dict(topk=t, is_causal=c) for t in (0.25, 0.5, 1.0) for c in (False, True)]
    sets += [dict(topk=1), dict(is_causal=1), dict(scale=float("0.1")), dict(scale=0.1 + 0.0 * len(sets))]
    assert len(sets) > api._MEMO_SIZE
    def fresh(fn):  # the reference resolves its options anew: the memo emptied first
        api._MEMO = ()
        return _general(fn)

    wants = [fresh(run(**kw)) for kw in sets]
    for _ in range(3):
        for kw, want in zip(sets, wants):
            _same(run(**kw)(), want)
    _same(run(is_causal=1)(), fresh(run(is_causal=True)))
    # sdpa resolves through the same memo
    for c in (False, True, False):
        _check_like_general(lambda: sparge.sdpa(q, k, v, is_causal=c, enable_gqa=True, precision="exact"))
