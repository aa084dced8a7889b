"""The baselines a user could pick instead of rubick, the best of which a comparison
reports against (issue 21): Sia, Synergy with its FIFO and its SRTF order, AntMan and
Pollux. A name not registered (yet) is left out, by registry lookup."""

from __future__ import annotations

BEST_OF = ("sia", "synergy", "synergy-srtf", "antman", "pollux")


def best_baselines() -> list[str]:
    from gearshift.policies.registry import policy_names

    known = set(policy_names())
    return [n for n in BEST_OF if n in known]
