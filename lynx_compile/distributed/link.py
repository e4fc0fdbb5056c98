"""Which link prices the collectives of a graph (``LynxConfig.link``).

The length of a communication window is what the recompute optimizer may hide in it, so the
link must describe the process group the graph will actually run on. Resolution order for
``link="auto"``: lynx's emulated link (the group *is* that link, by construction), else a link
calibrated on the default group when more than one rank runs, else the hardware profile's
nominal link. Calibration is a collective: every rank runs it at the same point (the first
graph compiled), and :func:`~lynx_compile.costs.calibrate_link` max-reduces the timings, so all
ranks get the same profile and hence the same plan. It is kept on rank 0's machine
(:func:`link_cache_path`) and sent to every rank by later runs, so identical runs plan alike.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

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
        _CALIBRATED[key] = _machine_link(group, *key)
    return _CALIBRATED[key]


def link_cache_path() -> Path:
    """Where calibrated links are kept: ``$LYNX_LINK_PROFILE`` if set, else
    ``lynx/links.json`` under torch.compile's cache directory (beside the CPU profile,
    ``costs.hardware.cpu_profile_cache_path``). Delete it to measure the links again."""
    from lynx_compile import _compat

    env = os.environ.get("LYNX_LINK_PROFILE")
    return Path(env).expanduser() if env else Path(_compat.inductor_cache_dir()) / "lynx" / "links.json"


def _machine_link(group, backend: str, world: int) -> LinkProfile:
    """The link of ``group``: rank 0's calibration kept on its machine
    (:func:`link_cache_path`, keyed by torch version, backend, world size and ranks per
    machine) and sent to every rank; where rank 0 has none, calibrated now (a collective) and
    kept. A link timed in every run gave every run its own windows and so its own plans
    (torchtitan's llama3 under TP on gloo: the smallest budget named varied 0.838-0.893 over
    identical runs); measured once, identical runs plan alike."""
    import torch
    import torch.distributed as dist

    from lynx_compile.costs.hardware import load_machine_entry, store_machine_entry
    from lynx_compile.distributed.agreement import rank0_value

    path = link_cache_path()
    key = (f"torch={torch.__version__};backend={backend};world={world};"
           f"per_machine={os.environ.get('LOCAL_WORLD_SIZE', '?')}")
    first = dist.get_rank(group) == 0
    stored = rank0_value(load_machine_entry(path, key) if first else None)
    if stored is not None:
        try:
            link = LinkProfile(str(stored["name"]), float(stored["alpha_s"]), float(stored["bandwidth_bytes_per_s"]))
            log.info("lynx: link %s from %s: alpha=%.3g s, bandwidth=%.3g GB/s (delete the file to measure "
                     "again)", link.name, path, link.alpha_s, link.bandwidth_bytes_per_s / 1e9)
            return link
        except (KeyError, TypeError, ValueError) as e:  # every rank got the same entry: all measure
            log.warning("lynx: ignoring the link kept in %s (%s); measuring it again", path, e)
    link = calibrate_link(group)
    log.info("lynx: calibrated %s: alpha=%.3g s, bandwidth=%.3g GB/s (kept in %s)", link.name, link.alpha_s,
             link.bandwidth_bytes_per_s / 1e9, path)
    if first:
        store_machine_entry(path, key, dataclasses.asdict(link), "link")
    return link
