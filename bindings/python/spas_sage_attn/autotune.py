"""``spas_sage_attn.autotune`` of the original package, mapped onto libsparge.

``SparseAttentionMeansim`` keeps the original's per-head parameters (``is_sparse``, ``cdfthreshd``,
``simthreshd1``, ``simthreshd2``, ``pvthreshd``) as non-trainable parameters, so state dicts saved
by the original (``extract_sparse_attention_state_dict``) load here unchanged
(``load_sparse_attention_state_dict``), and its forward runs ``spas_sage2_attn_meansim_cuda`` with
them (CDF selection, self-similarity threshold, attention sink, as the original's inference
path). Heads marked not sparse run with every block kept. Differences:

- no tuning here: ``tune_mode=True`` or ``TUNE_MODE`` set raises ``sparge.UnsupportedError``;
  the tuned parameters must come from elsewhere (a state dict);
- ``pvthreshd`` runs the PV skip as the original's forward does, mapped by
  :func:`sparge.compat.pv_threshold_of` (base 2 to nats, ``* ln 2``); libsparge takes one threshold
  per call, so per-head values that differ run with the largest (a one-time ``UserWarning``);
- ``simthreshd2`` is loaded but not used (the original did not use it either);
- ``sim_rule``, ``l1``, ``pv_l1``, ``cos_sim``, ``rmse``, ``rearrange_kwargs`` and ``tune_pv`` are
  stored for compatibility only (they are tuning targets).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Optional

import torch
from torch import nn

from sparge import _capi as C
from sparge.compat import spas_sage2_attn_meansim_cuda

_PARAMS = ("is_sparse", "cdfthreshd", "simthreshd1", "simthreshd2", "pvthreshd")


class SparseAttentionMeansim(nn.Module):
    """Sparse attention with tuned per-head parameters (see the module docstring)."""

    def __init__(self, sim_rule: str = "l1", l1: float = 0.07, pv_l1: float = 0.08, cos_sim: float = 0.98,
                 rmse: float = 0.07, rearrange_kwargs: Optional[Dict[str, Any]] = None, tune_pv: bool = True) -> None:
        super().__init__()
        if sim_rule not in ("l1", "cosine", "rmse"):
            raise C.InvalidArgumentError("sim_rule must be 'l1', 'cosine' or 'rmse', got %r" % (sim_rule,))
        self.sim_rule, self.l1, self.pv_l1, self.cos_sim, self.rmse = sim_rule, l1, pv_l1, cos_sim, rmse
        self.rearrange_kwargs = dict(rearrange_kwargs or {})
        self.tune_pv = tune_pv
        self.head_num: Optional[int] = None
        for name in _PARAMS:
            setattr(self, name, None)

    def init_hyperparams(self, head_num: int, device: Any) -> None:
        """Per-head parameters with the original's initial values (all heads sparse)."""
        self.head_num = int(head_num)
        init = {"is_sparse": torch.ones(head_num, dtype=torch.bool, device=device),
                "cdfthreshd": torch.full((head_num,), 0.1, device=device),
                "simthreshd1": torch.full((head_num,), -1.0, device=device),
                "simthreshd2": torch.zeros(head_num, device=device),
                "pvthreshd": torch.full((head_num,), 20.0, device=device)}
        for name, t in init.items():
            setattr(self, name, nn.Parameter(t, requires_grad=False))

    @torch.no_grad()
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                is_causal: bool = False, tune_mode: bool = False, smooth_k: bool = True,
                return_sparsity: bool = False) -> Any:
        if tune_mode or os.environ.get("TUNE_MODE", "") != "":
            raise C.UnsupportedError("SparseAttentionMeansim: tuning is not part of this package; load tuned "
                                     "parameters with load_sparse_attention_state_dict (TUNE_MODE is set or "
                                     "tune_mode=True)")
        if q.dim() != 4:
            raise C.InvalidArgumentError("q must be a 4-D tensor [B, H, L, D], got shape %s" % (tuple(q.shape),))
        if self.cdfthreshd is None or self.simthreshd1 is None:
            raise C.InvalidArgumentError("SparseAttentionMeansim has no tuned parameters: load them with "
                                         "load_sparse_attention_state_dict (or call init_hyperparams)")
        sparse = self.is_sparse.to(device=q.device).bool() if self.is_sparse is not None else None
        cdf = self.cdfthreshd.to(device=q.device, dtype=torch.float32)
        sim = self.simthreshd1.to(device=q.device, dtype=torch.float32)
        if sparse is not None:
            one = torch.ones_like(cdf)
            cdf, sim = torch.where(sparse, cdf, one), torch.where(sparse, sim, one)
        o, sparsity = spas_sage2_attn_meansim_cuda(q, k, v, mask, is_causal=is_causal, smooth_k=smooth_k,
                                                   cdfthreshd=cdf, simthreshd1=sim, pvthreshd=self.pvthreshd,
                                                   return_sparsity=True, attention_sink=True)
        return (o, sparsity) if return_sparsity else o


def _modules(model: nn.Module) -> Dict[str, SparseAttentionMeansim]:
    return {n: m for n, m in model.named_modules() if isinstance(m, SparseAttentionMeansim)}


def extract_sparse_attention_state_dict(model: nn.Module, verbose: bool = False) -> Dict[str, torch.Tensor]:
    """The state-dict entries of every SparseAttentionMeansim in ``model`` (their tuned parameters)."""
    mods = _modules(model)
    out: Dict[str, torch.Tensor] = {}
    for key, val in model.state_dict().items():
        for name in mods:
            if key.startswith(name + ".") if name else key in _PARAMS:
                if verbose:
                    print("%s: saved from %s" % (key, name or "<root>"))
                out[key] = val
    return out


def load_sparse_attention_state_dict(model: nn.Module, saved_state_dict: Dict[str, torch.Tensor],
                                     multigpu: bool = False, verbose: bool = False) -> nn.Module:
    """Sets the tuned parameters of every SparseAttentionMeansim in ``model`` from ``saved_state_dict``
    (on the model's device, or with ``multigpu`` on each module's own device; dtypes as saved)."""
    params = list(model.parameters())
    model_device = params[0].device if params else torch.device("cpu")
    for name, mod in _modules(model).items():
        prefix = name + "." if name else ""
        for key, val in saved_state_dict.items():
            if not key.startswith(prefix) or key[len(prefix):] not in _PARAMS:
                continue
            sub = key[len(prefix):]
            old = getattr(mod, sub, None)
            device = old.device if (multigpu and isinstance(old, torch.Tensor)) else model_device
            setattr(mod, sub, nn.Parameter(val.detach().to(device=device), requires_grad=False))
            if sub == "cdfthreshd":
                mod.head_num = int(val.shape[0])
            if verbose:
                print("%s: loaded into %s" % (key, name or "<root>"))
    return model


__all__ = ["SparseAttentionMeansim", "extract_sparse_attention_state_dict", "load_sparse_attention_state_dict"]
