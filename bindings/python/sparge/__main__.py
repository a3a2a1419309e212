"""python3 -m sparge tune ...: the tuning command (sparge.tune)."""
import sys


def _main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] != "tune":
        sys.stderr.write("usage: python3 -m sparge tune CAPTURES.npz ... (--rel-l1 X | --cosine X) --out FILE\n")
        return 2
    from .tune import main
    return main(sys.argv[2:])


sys.exit(_main())
