"""Run a service's ``main()`` under cProfile (``loadtest.scale --profile``):

    python -m loadtest.profiled OUT.prof gearshift.services.admission --max-jobs-per-tenant 100

The module is imported as itself, not run as ``__main__`` (``python -m cProfile -m``
does that, and msgspec cannot resolve the configs' postponed annotations there); the
stats are written to ``OUT.prof`` when ``main()`` returns (SIGTERM stops a service).
"""

from __future__ import annotations

import cProfile
import importlib
import sys


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit("usage: python -m loadtest.profiled OUT.prof MODULE [ARGS...]")
    out, name, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    module = importlib.import_module(name)
    sys.argv = [name, *args]
    prof = cProfile.Profile()
    try:
        prof.runcall(module.main)
    finally:
        prof.dump_stats(out)


if __name__ == "__main__":
    main()
