"""Which link prices the collectives of a graph (``LynxConfig.link``).

The length of a communication window is what the recompute optimizer may hide in it, so the
link must describe the process group the graph will actually run on. Resolution order for
``link="auto"``: lynx's emulated link (the group *is* that link, by construction), else a link
calibrated on the default group when more than one rank runs, else the hardware profile's
nominal link. Calibration is a collective: every rank runs it at the same point (the first
graph compiled), and :func:`~lynx_compile.costs.calibrate_link` max-reduces the timings, so all
ranks get the same profile and hence the same plan.
"""
from __future__ import annotations

import logging

from lynx_compile.costs import LINKS, LinkProfile, calibrate_link

log = logging.getLogger("lynx_compile")

_CALIBRATED: dict[tuple[str, int], LinkProfile] = {}


def _dist_world() -> int:
    from lynx_compile.distributed.agreement import planning_world_size

    return planning_world_size()


def _emulated() -> LinkProfile | None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    from lynx_compile.distributed.emulated_link import emulated_link_of

    return emulated_link_of()


def resolve_link(link: str, default_link: str) -> LinkProfile:
    """The ``LinkProfile`` for option value ``link``; ``default_link`` is the profile's key."""
    if link in LINKS:
        return LINKS[link]
    if link not in ("auto", "calibrate"):
        raise ValueError(f"link={link!r} is not valid; choose one of {['auto', 'calibrate', *LINKS]}")
    emulated = _emulated()
    if emulated is not None:
        return emulated
    world = _dist_world()
    if link == "calibrate" and world < 2:
        raise RuntimeError("link='calibrate' needs torch.distributed initialized with >= 2 ranks; "
                           "launch with torchrun, or name a link (e.g. link='nvlink4')")
    if world < 2:
        return LINKS[default_link]
    import torch.distributed as dist

    from lynx_compile.distributed.agreement import current_planning_group

    group = current_planning_group()
    key = (str(dist.get_backend(group)), world)
    if key not in _CALIBRATED:
        _CALIBRATED[key] = calibrate_link(group)
        p = _CALIBRATED[key]
        log.info("lynx: calibrated %s: alpha=%.3g s, bandwidth=%.3g GB/s", p.name, p.alpha_s,
                 p.bandwidth_bytes_per_s / 1e9)
    return _CALIBRATED[key]
