"""diffusers integration: an attention processor for ``diffusers.models.attention_processor.Attention``.

::

    from sparge.integrations.diffusers import SpargeAttnProcessor
    unet_or_transformer.set_attn_processor(SpargeAttnProcessor(topk=0.5))     # every layer alike
    sparge.integrations.apply(model, "tuned.json")                            # or per layer

It computes what diffusers' default ``AttnProcessor2_0`` computes (spatial and group norms,
cross-attention, q/k norms, output projection, residual and rescale), with the attention itself
by :func:`sparge.sdpa` (non-causal, default scale ``1/sqrt(head_dim)`` like ``AttnProcessor2_0``).
A processor's own settings win over the module's ``sparge_settings`` (see :func:`sparge.integrations.apply`).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from .._api import _records_grad
from .._sdpa import sdpa
from . import check_settings, mask_policy, sdpa_kwargs, settings_for


class SpargeAttnProcessor:
    """A diffusers attention processor running :func:`sparge.sdpa`; keyword settings as in
    :mod:`sparge.integrations` (``topk``, ``precision``, ``enabled``, ``on_mask``, ...)."""

    def __init__(self, **settings: Any) -> None:
        self.settings = check_settings(settings, "SpargeAttnProcessor")

    def __call__(self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: Optional[torch.Tensor] = None,
                 attention_mask: Optional[torch.Tensor] = None, temb: Optional[torch.Tensor] = None,
                 *args: Any, **kwargs: Any) -> torch.Tensor:
        st = settings_for(attn, self.settings)
        residual = hidden_states
        if attn.spatial_norm is not None:
            hidden_states = attn.spatial_norm(hidden_states, temb)
        image_like = hidden_states.ndim == 4
        if image_like:
            b, c, h, w = hidden_states.shape
            hidden_states = hidden_states.view(b, c, h * w).transpose(1, 2)
        context = hidden_states if encoder_hidden_states is None else encoder_hidden_states
        batch, ctx_len = context.shape[0], context.shape[1]
        if attention_mask is not None:
            mask_policy(st, "diffusers attention processor")
            attention_mask = attn.prepare_attention_mask(attention_mask, ctx_len, batch)
            attention_mask = attention_mask.view(batch, attn.heads, -1, attention_mask.shape[-1])
        if attn.group_norm is not None:
            hidden_states = attn.group_norm(hidden_states.transpose(1, 2)).transpose(1, 2)
        q = attn.to_q(hidden_states)
        if encoder_hidden_states is None:
            encoder_hidden_states = hidden_states
        elif attn.norm_cross:
            encoder_hidden_states = attn.norm_encoder_hidden_states(encoder_hidden_states)
        k = attn.to_k(encoder_hidden_states)
        v = attn.to_v(encoder_hidden_states)
        head_dim = k.shape[-1] // attn.heads
        q = q.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        k = k.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        v = v.view(batch, -1, attn.heads, head_dim).transpose(1, 2)
        if attn.norm_q is not None:
            q = attn.norm_q(q)
        if attn.norm_k is not None:
            k = attn.norm_k(k)
        if attention_mask is not None or not st.get("enabled", True):
            o = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0,
                                                                 is_causal=False)
            o = o.transpose(1, 2).reshape(batch, -1, attn.heads * head_dim)
        else:
            L = q.shape[2]
            if _records_grad(q, k, v):  # no out= there: the result carries a node whose backward raises
                o = sdpa(q, k, v, **sdpa_kwargs(st)).transpose(1, 2).reshape(batch, L, attn.heads * head_dim)
            else:
                o4 = q.new_empty((batch, L, attn.heads, head_dim))
                sdpa(q, k, v, out=o4.transpose(1, 2), **sdpa_kwargs(st))
                o = o4.view(batch, L, attn.heads * head_dim)
        o = o.to(q.dtype)
        o = attn.to_out[0](o)
        o = attn.to_out[1](o)
        if image_like:
            o = o.transpose(-1, -2).reshape(b, c, h, w)
        if attn.residual_connection:
            o = o + residual
        return o / attn.rescale_output_factor


__all__ = ["SpargeAttnProcessor"]
