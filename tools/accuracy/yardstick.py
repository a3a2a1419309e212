#!/usr/bin/env python3
"""Oracle yardstick for predicted block masks: the command line of sparge.yardstick
(bindings/python/sparge/yardstick.py, which documents it).

    python3 tools/accuracy/yardstick.py CAPTURE.npz [...] [--topk 0.2 0.5] [--estimators mean rows4]
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python"))
from sparge.yardstick import *  # noqa: E402,F401,F403
from sparge.yardstick import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
