"""Framework integrations: per-layer settings shared by the transformers attention function
(:mod:`sparge.integrations.transformers`) and the diffusers attention processor
(:mod:`sparge.integrations.diffusers`).

Settings are keyword arguments of :func:`sparge.sdpa` (``topk``, ``mode``, ``cdf_threshold``,
``sim_threshold``, ``smooth_k``, ``attention_sink``, ``local_window``, ``estimator``, ``precision``,
``block_size``, ``pv_threshold``) plus two of the integrations' own:

- ``enabled`` (default True): False runs the layer with torch's dense
  ``scaled_dot_product_attention`` instead;
- ``on_mask`` (default ``"error"``): what a call with a dense attention mask (padding, or a
  mask the framework could not drop) does: ``"error"`` raises :class:`sparge.UnsupportedError`,
  ``"sdpa"`` runs that call with torch's dense SDPA (exact).

Where a layer's settings come from, later wins: :func:`configure`'s process-wide defaults, then
the settings :func:`apply` attached to the layer's module (``module.sparge_settings``), which
merge the ``default`` and the matching ``layers`` entries of a settings file or argument.
"""

from __future__ import annotations

import fnmatch
import json
import os
from typing import Any, Dict, Iterable, Mapping, Optional, Tuple, Union

from .. import _capi as C

#: keyword arguments passed through to sparge.sdpa
SDPA_KEYS = ("topk", "mode", "cdf_threshold", "sim_threshold", "smooth_k", "attention_sink", "local_window",
             "estimator", "precision", "block_size", "pv_threshold")
#: the integrations' own keys
OWN_KEYS = ("enabled", "on_mask")
KEYS = SDPA_KEYS + OWN_KEYS

_DEFAULTS: Dict[str, Any] = {}

LayerKey = Union[int, str]


def check_settings(settings: Mapping[str, Any], where: str = "settings") -> Dict[str, Any]:
    """A validated copy: unknown keys and bad values of the integrations' own keys are errors
    (the sparsity values are checked by the library on the first call, naming the argument)."""
    out: Dict[str, Any] = {}
    for k, v in settings.items():
        if k not in KEYS:
            raise C.InvalidArgumentError("%s: unknown setting %r; known: %s" % (where, k, ", ".join(KEYS)))
        if k == "on_mask" and v not in ("error", "sdpa"):
            raise C.InvalidArgumentError("%s: on_mask must be 'error' or 'sdpa', got %r" % (where, v))
        if k == "block_size":
            v = tuple(v)
        if isinstance(v, list):
            v = tuple(v)
        out[k] = v
    return out


def configure(**settings: Any) -> Dict[str, Any]:
    """Sets process-wide default settings (merged into what was set before); returns them all.
    ``configure()`` with no arguments just returns them; :func:`reset` clears them."""
    _DEFAULTS.update(check_settings(settings, "configure"))
    return dict(_DEFAULTS)


def reset() -> None:
    """Clears the process-wide defaults of :func:`configure`."""
    _DEFAULTS.clear()


def load_settings(path: Union[str, "os.PathLike[str]"]) -> Dict[str, Any]:
    """Reads a settings file: JSON ``{"default": {...}, "layers": {"<key>": {...}, ...}}``, where a
    key is a layer index (``"3"``, matched against the module's ``layer_idx``), a module name
    (``"model.layers.3.self_attn"``) or a glob of names (``"transformer_blocks.*.attn1"``).
    Returns ``{"default": dict, "layers": {key: dict}}``."""
    with open(os.fspath(path), encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict) or set(data) - {"default", "layers"}:
        raise C.InvalidArgumentError("%s: expected an object with 'default' and/or 'layers'" % os.fspath(path))
    default = check_settings(data.get("default") or {}, "%s: default" % os.fspath(path))
    layers = {}
    for k, v in (data.get("layers") or {}).items():
        if not isinstance(v, dict):
            raise C.InvalidArgumentError("%s: layers[%r] must be an object" % (os.fspath(path), k))
        layers[k] = check_settings(v, "%s: layers[%r]" % (os.fspath(path), k))
    return {"default": default, "layers": layers}


def _matches(key: LayerKey, name: str, module: Any) -> bool:
    idx = getattr(module, "layer_idx", None)
    if isinstance(key, int) or (isinstance(key, str) and key.isdigit()):
        return idx is not None and int(idx) == int(key)
    return name == key or fnmatch.fnmatchcase(name, key)


def is_attention_module(module: Any) -> bool:
    """transformers attention modules (they carry ``layer_idx``) and diffusers ``Attention``."""
    cls = type(module)
    if cls.__name__ in ("Attention", "AttentionModuleMixin") and "diffusers" in cls.__module__:
        return True
    for base in cls.__mro__:
        if base.__name__ == "AttentionModuleMixin" and "diffusers" in base.__module__:
            return True
    return hasattr(module, "layer_idx") and hasattr(module, "config") and "Attention" in cls.__name__


def apply(model: Any, settings_file: Optional[Union[str, "os.PathLike[str]"]] = None, *,
          layers: Optional[Mapping[LayerKey, Mapping[str, Any]]] = None, **default: Any) -> Dict[str, Dict[str, Any]]:
    """Attaches per-layer settings to every attention module of ``model`` (as
    ``module.sparge_settings``): ``default`` keywords, then the settings file's ``default``, then
    every matching ``layers`` entry (the file's, then the argument's). Returns
    ``{module name: settings}`` for the modules it set. For diffusers models it also installs a
    :class:`sparge.integrations.diffusers.SpargeAttnProcessor` on each ``Attention``."""
    base = check_settings(default, "apply")
    entries: list = []
    if settings_file is not None:
        f = load_settings(settings_file)
        base.update(f["default"])
        entries += list(f["layers"].items())
    if layers:
        entries += [(k, check_settings(v, "layers[%r]" % (k,))) for k, v in layers.items()]
    done: Dict[str, Dict[str, Any]] = {}
    for name, module in model.named_modules():
        if not is_attention_module(module):
            continue
        st = dict(base)
        for key, val in entries:
            if _matches(key, name, module):
                st.update(val)
        module.sparge_settings = st
        if "diffusers" in type(module).__module__ and hasattr(module, "set_processor"):
            from .diffusers import SpargeAttnProcessor

            module.set_processor(SpargeAttnProcessor())
        done[name] = st
    if not done:
        raise C.InvalidArgumentError("apply: %s has no attention modules this integration knows "
                                     "(transformers attention with layer_idx, diffusers Attention)" % type(model).__name__)
    return done


def settings_for(module: Any, override: Optional[Mapping[str, Any]] = None) -> Dict[str, Any]:
    """The effective settings of one call: defaults, the module's, then ``override``."""
    st = dict(_DEFAULTS)
    own = getattr(module, "sparge_settings", None)
    if own:
        st.update(own)
    if override:
        st.update(override)
    return st


def sdpa_kwargs(st: Mapping[str, Any]) -> Dict[str, Any]:
    return {k: st[k] for k in SDPA_KEYS if k in st}


def mask_policy(st: Mapping[str, Any], what: str) -> str:
    pol = st.get("on_mask", "error")
    if pol != "sdpa":
        raise C.UnsupportedError(
            "%s: this call has a dense attention mask (padding, or a mask the framework could not drop), "
            "which libsparge does not support; set on_mask='sdpa' (sparge.integrations.configure or apply) to "
            "run such calls with torch's dense scaled_dot_product_attention" % what)
    return pol


__all__ = ["configure", "reset", "apply", "load_settings", "settings_for", "check_settings", "KEYS"]
