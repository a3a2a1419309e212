"""transformers integration: ``attn_implementation="sparge"``.

::

    import sparge.integrations.transformers as st
    st.register()                                  # once; registers "sparge" with transformers
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation="sparge")
    sparge.integrations.apply(model, topk=0.5, layers={0: {"enabled": False}})   # optional

The attention function follows transformers' SDPA integration: query ``[B, H, L, D]``,
key/value ``[B, Hkv, S, D]`` (GQA without repeating heads), causal when the model's module is
causal, there is no mask and ``L > 1``; the mask function registered with it
(:func:`sparge_mask`) is transformers' ``sdpa_mask``, so a mask is only created where SDPA would
need one (padding, chunked prefill), also under ``torch.compile``.
Such calls follow the layer's ``on_mask`` setting. Returns ``[B, L, H, D]`` as transformers
expects, written directly by the library (no transpose copy).
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from .. import _capi as C
from .._api import _records_grad
from .._sdpa import sdpa
from . import mask_policy, sdpa_kwargs, settings_for

NAME = "sparge"


def _dense(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: Optional[torch.Tensor],
           causal: bool, scale: Optional[float]) -> torch.Tensor:
    gqa = query.shape[1] != key.shape[1]
    if gqa:  # repeat heads (enable_gqa is not available on every torch/backend combination)
        rep = query.shape[1] // key.shape[1]
        key = key.repeat_interleave(rep, dim=1)
        value = value.repeat_interleave(rep, dim=1)
    if mask is not None and mask.dtype != torch.bool:
        mask = mask.to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=0.0,
                                                           is_causal=causal, scale=scale)
    return out.transpose(1, 2).contiguous()


def sparge_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                             value: torch.Tensor, attention_mask: Optional[torch.Tensor], dropout: float = 0.0,
                             scaling: Optional[float] = None, is_causal: Optional[bool] = None,
                             **kwargs: Any) -> Tuple[torch.Tensor, None]:
    """The attention function transformers calls for ``attn_implementation="sparge"``."""
    st = settings_for(module)
    if dropout:
        raise C.UnsupportedError("dropout=%r: libsparge is inference only (call model.eval())" % (dropout,))
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    if attention_mask is not None:
        mask_policy(st, "transformers attention (layer %s)" % getattr(module, "layer_idx", "?"))
        return _dense(query, key, value, attention_mask, False, scaling), None
    if not st.get("enabled", True):
        return _dense(query, key, value, None, causal, scaling), None
    B, H, L, D = query.shape
    if _records_grad(query, key, value):  # no out= there: the result carries a node whose backward raises
        o = sdpa(query, key, value, None, 0.0, causal, scaling, key.shape[1] != H, **sdpa_kwargs(st))
        return o.transpose(1, 2).contiguous(), None
    out = query.new_empty((B, L, H, D))
    sdpa(query, key, value, None, 0.0, causal, scaling, key.shape[1] != H, out=out.transpose(1, 2),
         **sdpa_kwargs(st))
    return out, None


def sparge_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
                mask_function: Any = None, attention_mask: Optional[torch.Tensor] = None,
                local_size: Optional[int] = None, allow_is_causal_skip: bool = True, **kwargs: Any) -> Any:
    """transformers' ``sdpa_mask``, except that a plain causal mask with no padding mask is
    dropped (None: the attention function then uses ``is_causal``) also while compiling: the
    decision depends only on Python values (no padding mask given, ``q_length == kv_length`` or
    ``q_length == 1``), so it is as valid under ``torch.compile`` as in eager mode. transformers'
    own rule keeps the mask while tracing (for ``torch.export``, where the values could change)."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    fn = causal_mask_function if mask_function is None else mask_function
    if (allow_is_causal_skip and attention_mask is None and local_size is None and fn is causal_mask_function
            and (q_length == 1 or q_length == kv_length)):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length, q_offset=q_offset,
                     kv_offset=kv_offset, mask_function=fn, attention_mask=attention_mask, local_size=local_size,
                     allow_is_causal_skip=allow_is_causal_skip, **kwargs)


def register(name: str = NAME) -> None:
    """Registers the attention function under ``name`` with transformers' ``AttentionInterface``,
    and :func:`sparge_mask` with its ``AttentionMaskInterface``. Idempotent."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, sparge_attention_forward)
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, causal_mask_function  # noqa: F401

        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sparge_mask)
    except ImportError:  # transformers without masking_utils: masks come from the model
        pass


__all__ = ["register", "sparge_attention_forward", "sparge_mask", "NAME"]
