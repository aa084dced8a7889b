"""gearshift: every part installs under this one import root.

``gearshift.bus_schema`` (messages, the bus contract), ``gearshift.bus`` (the
runtime every process that talks NATS shares), ``gearshift.services`` and
``gearshift.agent`` (peers over the bus), ``gearshift.perfmodel``,
``gearshift.policies`` and ``gearshift.sim`` (the pure core), and the
``gearshift`` command itself (``gearshift.cli``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def numba_cache_dir() -> str:
    """Where numba's ``cache=True`` kernels are stored: ``$NUMBA_CACHE_DIR`` if
    set, else the user's cache directory (``$XDG_CACHE_HOME`` or ``~/.cache``),
    never next to the code (site-packages on a wheel install)."""
    explicit = os.environ.get("NUMBA_CACHE_DIR")
    if explicit:
        return explicit
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "gearshift" / "numba")


# numba reads NUMBA_CACHE_DIR when it is imported; every gearshift module is
# imported after this package, and processes it starts inherit the variable.
os.environ["NUMBA_CACHE_DIR"] = numba_cache_dir()
if "numba" in sys.modules:  # imported before gearshift: tell its config directly
    sys.modules["numba"].config.CACHE_DIR = os.environ["NUMBA_CACHE_DIR"]
