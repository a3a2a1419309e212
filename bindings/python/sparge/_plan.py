"""``sparge.Plan``: a plan and workspace held by the caller (serving loops)."""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from . import _capi as C
from . import _core as core
from ._api import PerHead, _attention, _is_torch, _predict, _resolve

_DTYPES = {"float16": C.DTYPE_FLOAT16, "half": C.DTYPE_FLOAT16, "fp16": C.DTYPE_FLOAT16,
           "bfloat16": C.DTYPE_BFLOAT16, "bf16": C.DTYPE_BFLOAT16,
           "float32": C.DTYPE_FLOAT32, "float": C.DTYPE_FLOAT32, "fp32": C.DTYPE_FLOAT32}


def _dtype_code(dtype: Any) -> int:
    name = getattr(dtype, "name", None) if not isinstance(dtype, str) else dtype
    if name is None:
        name = str(dtype)
    name = str(name).replace("torch.", "")
    if name not in _DTYPES:
        raise C.InvalidArgumentError("dtype must be float16, bfloat16 or float32 (a name, numpy or torch dtype), "
                                     "got %r" % (dtype,))
    return _DTYPES[name]


def _device(device: Any) -> Tuple[int, int]:
    if isinstance(device, int):
        return C.DEVICE_CUDA, device
    kind = getattr(device, "type", None)
    if kind is not None:  # torch.device
        index = getattr(device, "index", None)
        return (C.DEVICE_CPU, 0) if kind == "cpu" else (C.DEVICE_CUDA, int(index or 0))
    s = str(device)
    if s == "cpu":
        return C.DEVICE_CPU, 0
    if s == "cuda":
        return C.DEVICE_CUDA, 0
    if s.startswith("cuda:") and s[5:].isdigit():
        return C.DEVICE_CUDA, int(s[5:])
    raise C.InvalidArgumentError("device must be 'cpu', 'cuda', 'cuda:N', an int or a torch.device, got %r"
                                 % (device,))


class Plan:
    """A libsparge plan for one problem, owned by the caller.

    Create it once (it validates the problem and checks the device), allocate
    ``workspace_size`` bytes once, then call :meth:`run` / :meth:`predict` per step with that
    workspace: nothing is allocated or cached behind the caller's back apart from outputs
    not given through ``out=``. One workspace serves one call at a time (calls on one CUDA
    stream are ordered, so one workspace per stream). ``close()`` (or ``with Plan(...)``)
    destroys the plan; so does garbage collection.

    Shapes: ``batch, heads_q, len_q, head_dim`` and optional ``heads_kv`` (default heads_q)
    and ``len_kv`` (default len_q); or use :meth:`for_inputs` with example tensors.
    """

    def __init__(self, batch: int, heads_q: int, len_q: int, head_dim: int, *, heads_kv: Optional[int] = None,
                 len_kv: Optional[int] = None, dtype: Any = "bfloat16", device: Any = "cuda",
                 precision: str = "auto", is_causal: bool = False, scale: Optional[float] = None,
                 block_size: Tuple[int, int] = (128, 64)) -> None:
        self._precision_name = precision
        self._scale_arg = scale
        self._block_arg = tuple(block_size)
        self.is_causal = bool(is_causal)
        prec = core.parse_precision(precision)
        bq, bk = core.parse_block_size(block_size)
        dev_type, dev_id = _device(device)
        key = (int(batch), int(heads_q), int(heads_kv if heads_kv is not None else heads_q), int(len_q),
               int(len_kv if len_kv is not None else len_q), int(head_dim), _dtype_code(dtype), dev_type, dev_id,
               prec, self.is_causal, core.parse_scale(scale), bq, bk)
        self._plan: Optional[core.Plan] = core.Plan(key)
        self.device = "cpu" if dev_type == C.DEVICE_CPU else "cuda:%d" % dev_id

    @classmethod
    def for_inputs(cls, q: Any, k: Any, *, layout: str = "HND", precision: str = "auto",
                   is_causal: bool = False, scale: Optional[float] = None,
                   block_size: Tuple[int, int] = (128, 64)) -> "Plan":
        """The plan for tensors shaped like ``q`` and ``k`` (their dtype and device)."""
        from ._arrays import as_view

        qv, kv = as_view(q, "q"), as_view(k, "k")
        s = core.check_qkv(qv, kv, None, core.parse_layout(layout))
        dev: Any = "cpu" if qv.device_type == C.DEVICE_CPU else "cuda:%d" % qv.device_id
        return cls(s.B, s.Hq, s.Lq, s.D, heads_kv=s.Hkv, len_kv=s.Lkv, dtype=core.dtype_name(qv.dtype),
                   device=dev, precision=precision, is_causal=is_causal, scale=scale, block_size=block_size)

    # ------------------------------------------------------------ properties
    def _p(self) -> core.Plan:
        if self._plan is None:
            raise C.InvalidArgumentError("this Plan was closed")
        return self._plan

    @property
    def workspace_size(self) -> int:
        """Workspace bytes :meth:`run` and :meth:`predict` need (0: no workspace)."""
        return self._p().workspace_bytes

    @property
    def block_size(self) -> Tuple[int, int]:
        p = self._p()
        return p.block_q, p.block_k

    @property
    def precision(self) -> str:
        """The precision the plan runs: the one asked for, or the choice of ``"auto"``."""
        return core.precision_name(self._p().precision)

    @property
    def scale(self) -> float:
        """The resolved softmax scale."""
        return self._p().scale

    @property
    def mask_shape(self) -> Tuple[int, int, int, int]:
        p = self._p()
        return p.key[0], p.key[1], p.nqb, p.nkb

    @property
    def visible_blocks(self) -> int:
        """Causally visible (query block, key block) pairs of one head."""
        return self._p().visible_per_head

    def allocate_workspace(self) -> Any:
        """A new uint8 buffer of :attr:`workspace_size` bytes on the plan's device, suitably
        aligned: a torch tensor when the program imported torch (or, for CUDA, torch is
        installed), else numpy on the CPU and cupy on CUDA."""
        import sys

        n = max(self.workspace_size, 1)
        if self.device == "cpu" and "torch" in sys.modules:
            torch = sys.modules["torch"]
            buf = torch.empty(n + 256, dtype=torch.uint8)
            off = (-buf.data_ptr()) % 256
            return buf[off:off + n]
        if self.device == "cpu":
            buf = np.empty(n + 256, dtype=np.uint8)
            off = (-buf.__array_interface__["data"][0]) % 256
            return buf[off:off + n]
        import importlib.util

        if "torch" in sys.modules or importlib.util.find_spec("torch") is not None:
            import torch

            return torch.empty(n, dtype=torch.uint8, device=self.device)
        import cupy

        with cupy.cuda.Device(int(self.device.split(":")[1])):
            return cupy.empty(n, dtype=cupy.uint8)

    def close(self) -> None:
        """Destroys the plan now (idempotent)."""
        if self._plan is not None:
            self._plan.destroy()
            self._plan = None

    def __enter__(self) -> "Plan":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._plan is None:
            return "sparge.Plan(closed)"
        B, Hq, Hkv, Lq, Lkv, D = self._plan.key[:6]
        return ("sparge.Plan(B=%d, Hq=%d, Hkv=%d, Lq=%d, Lkv=%d, D=%d, %s, %s, %s, causal=%s, workspace_size=%d)"
                % (B, Hq, Hkv, Lq, Lkv, D, core.dtype_name(self._plan.key[6]), self.device, self.precision,
                   self.is_causal, self.workspace_size))

    # ------------------------------------------------------------ calls
    def _resolve(self, topk: PerHead, layout: str, mode: str, cdf_threshold: Any, sim_threshold: Any,
                 smooth_k: bool, attention_sink: Optional[bool], local_window: Optional[int],
                 estimator: str, pv_threshold: Any = 0.0) -> Any:
        return _resolve(topk=topk, is_causal=self.is_causal, scale=self._scale_arg, layout=layout, mode=mode,
                        cdf_threshold=cdf_threshold, sim_threshold=sim_threshold, smooth_k=smooth_k,
                        attention_sink=attention_sink, local_window=local_window, estimator=estimator,
                        precision=self._precision_name, block_size=self._block_arg, pv_threshold=pv_threshold)

    def run(self, q: Any, k: Any, v: Any, *, mask: Optional[Any] = None, topk: PerHead = 0.5,
            mode: str = "topk", cdf_threshold: Optional[PerHead] = None, sim_threshold: PerHead = -0.1,
            smooth_k: bool = True, attention_sink: Optional[bool] = None, local_window: Optional[int] = None,
            estimator: str = "auto", pv_threshold: float = 0.0, layout: str = "HND", out: Optional[Any] = None,
            workspace: Optional[Any] = None, return_lse: bool = False, stream: Optional[int] = None) -> Any:
        """:func:`sparge.attention` on this plan. ``workspace``: a 1-D buffer of at least
        :attr:`workspace_size` bytes on the plan's device (default: the package's cached one).
        Eager only with torch (under ``torch.compile`` use :func:`sparge.attention`)."""
        r = self._resolve(topk, layout, mode, cdf_threshold, sim_threshold, smooth_k, attention_sink, local_window,
                          estimator, pv_threshold)
        return _attention(q, k, v, r, mask, out, False, return_lse, stream, plan=self._p(), workspace=workspace)

    def predict(self, q: Any, k: Any, *, topk: PerHead = 0.5, mode: str = "topk",
                cdf_threshold: Optional[PerHead] = None, sim_threshold: PerHead = -0.1, smooth_k: bool = True,
                attention_sink: Optional[bool] = None, local_window: Optional[int] = None, estimator: str = "auto",
                pv_threshold: float = 0.0, layout: str = "HND", out: Optional[Any] = None,
                workspace: Optional[Any] = None, return_kept: bool = False, stream: Optional[int] = None) -> Any:
        """:func:`sparge.predict_mask` on this plan (``out``: a uint8 :attr:`mask_shape` array)."""
        r = self._resolve(topk, layout, mode, cdf_threshold, sim_threshold, smooth_k, attention_sink, local_window,
                          estimator, pv_threshold)
        return _predict(q, k, r, return_kept, stream, out, plan=self._p(), workspace=workspace)


__all__ = ["Plan"]
