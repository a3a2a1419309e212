"""libsparge for Python: training-free block-sparse attention (the SpargeAttn method).

Quick start::

    import sparge
    out = sparge.attention(q, k, v, topk=0.5, is_causal=True)          # torch CUDA tensors
    out = sparge.attention(q_np, k_np, v_np, precision="exact")        # numpy: CPU backend
    out = sparge.sdpa(q, k, v, is_causal=True, topk=0.5)                # SDPA's signature

The original SpargeAttn names are in :mod:`sparge.compat` (also importable as
``spas_sage_attn``). See docs/PYTHON.md.
"""

from __future__ import annotations

import sys
from typing import Tuple

from ._capi import (
    PACKAGE_VERSION,
    CudaError,
    InternalError,
    InvalidArgumentError,
    LibraryNotFoundError,
    NoDeviceError,
    OutOfMemoryError,
    SpargeError,
    UnsupportedError,
    VersionMismatchError,
    WorkspaceTooSmallError,
    library_path,
)
from ._api import attention, block_sparse_attention, predict_mask, visible_key_blocks
from ._sdpa import sdpa
from ._plan import Plan
from .merge import merge_states
from . import compat
from .compat import (
    block_sparse_sage2_attn_cuda,
    spas_sage2_attn_meansim_cuda,
    spas_sage2_attn_meansim_topk_cuda,
    spas_sage_attn_meansim_cuda,
    spas_sage_attn_meansim_topk_cuda,
)

__version__ = "%d.%d.%d" % PACKAGE_VERSION  # generated from CMake's project(VERSION)


def load_tuned(path: str):
    """Reads a ``sparge tune`` file: {layer name: sparge.tune.TunedLayer}; ``layer.kwargs()`` are the
    keyword arguments of ``attention`` / ``predict_mask`` for that layer (docs/ACCURACY.md)."""
    from .tune import load_tuned as _load
    return _load(path)

__all__ = [
    "attention",
    "sdpa",
    "Plan",
    "predict_mask",
    "block_sparse_attention",
    "visible_key_blocks",
    "merge_states",
    "library_version",
    "library_path",
    "has_cuda",
    "clear_caches",
    "compat",
    "load_tuned",
    "spas_sage2_attn_meansim_topk_cuda",
    "spas_sage2_attn_meansim_cuda",
    "spas_sage_attn_meansim_topk_cuda",
    "spas_sage_attn_meansim_cuda",
    "block_sparse_sage2_attn_cuda",
    "SpargeError",
    "InvalidArgumentError",
    "UnsupportedError",
    "WorkspaceTooSmallError",
    "NoDeviceError",
    "CudaError",
    "OutOfMemoryError",
    "InternalError",
    "LibraryNotFoundError",
    "VersionMismatchError",
]


def library_version() -> Tuple[int, int, int]:
    """(major, minor, patch) of the loaded libsparge (loads it on first use)."""
    from ._capi import lib

    return lib.version


def has_cuda() -> bool:
    """True when the loaded libsparge was built with its CUDA backend."""
    from ._capi import lib

    return bool(lib.sparge_has_cuda())


def clear_caches() -> None:
    """Drops cached plans, every thread's workspace buffers, the per-head parameter arrays and the
    prepared arguments of repeated torch calls."""
    from . import _arrays, _core

    ops = sys.modules.get(__name__ + "._torch_ops")
    if ops is not None:
        ops.clear_calls()
    _core.PLANS.clear()
    _arrays.NUMPY.clear()
    if _arrays._TORCH is not None:
        _arrays._TORCH.clear()
    if _arrays._CUPY is not None:
        _arrays._CUPY.clear()


# Register the torch custom ops now if the program already uses torch (so that
# torch.compile sees them); otherwise on the first call with torch tensors.
if "torch" in sys.modules:
    try:
        from . import _torch_ops  # noqa: F401
    except Exception:  # pragma: no cover - a broken torch install must not break numpy users
        pass
