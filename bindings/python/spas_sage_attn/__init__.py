"""Compatibility shim: the original SpargeAttn package name, served by libsparge.

``from spas_sage_attn import spas_sage2_attn_meansim_topk_cuda`` works unchanged.
See :mod:`sparge.compat` for the (few) differences.
"""

from sparge.compat import (  # noqa: F401
    block_sparse_sage2_attn_cuda,
    spas_sage2_attn_meansim_cuda,
    spas_sage2_attn_meansim_topk_cuda,
    spas_sage_attn_meansim_cuda,
    spas_sage_attn_meansim_topk_cuda,
)

__all__ = [
    "spas_sage2_attn_meansim_topk_cuda",
    "spas_sage2_attn_meansim_cuda",
    "spas_sage_attn_meansim_topk_cuda",
    "spas_sage_attn_meansim_cuda",
    "block_sparse_sage2_attn_cuda",
]
