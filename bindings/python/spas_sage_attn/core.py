"""``spas_sage_attn.core`` of the original package (same names)."""

from sparge.compat import *  # noqa: F401,F403
from sparge.compat import __all__  # noqa: F401
