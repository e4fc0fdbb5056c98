"""Hardware profiles: the peak numbers the roofline model divides by.

The named GPU/NPU profiles are datasheet figures (sources next to each number); achievable
fractions of those peaks are separate, stated factors. The ``"cpu"`` profile is measured on this
machine by :func:`calibrate_cpu_profile`, and a CUDA device's by :func:`calibrate_cuda_profile`
(a few seconds each in a child process, cached on disk): matmul rates by size, memory and cache
bandwidth, the per-kernel overhead.

    get_profile("h100-sxm")  -> datasheet profile
    get_profile("cpu")       -> calibrated once per machine
    get_profile("auto")      -> the CUDA device measured (its datasheet as a fallback), else "cpu"
"""
from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
import types
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from collections.abc import Iterator, Mapping
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)

TERA = 1e12
GIB = 1 << 30


@dataclass(frozen=True, kw_only=True)
class HardwareProfile:
    """One accelerator (or the local CPU) as the roofline model sees it."""

    name: str
    """Key in ``PROFILES`` (``"cpu"`` for the calibrated profile)."""
    peak_flops: dict[str, float]
    """Dense peak FLOP/s per dtype name ("float32", "bfloat16", "float16"; optional
    "tfloat32"). On GPUs "float32" is the non-tensor-core FP32 rate: PyTorch runs fp32 matmuls
    in full FP32 unless ``torch.set_float32_matmul_precision`` allows TF32."""
    memory_bandwidth_bytes_per_s: float
    """Peak device-memory bandwidth, bytes/s."""
    memory_capacity_bytes: int
    """Device memory, bytes."""
    launch_overhead_s: float
    """Fixed per-op cost added to every non-free node: kernel launch / dispatch, seconds."""
    matmul_efficiency: float = 0.7
    """Achievable fraction of ``peak_flops``. Large GEMMs reach ~70-80% of dense tensor-core
    peak with cuBLAS; transformer-shaped ones (small K, odd sizes) less, so 0.7."""
    memory_efficiency: float = 0.8
    """Achievable fraction of memory bandwidth: streaming kernels (copies, pointwise) get
    ~80-90% of HBM peak, so 0.8."""
    default_link: str
    """Key in ``comm.LINKS`` of the intra-node link collectives use when none is given."""
    matmul_rates: tuple[tuple[float, float], ...] = ()
    """Measured ``(FLOPs, achieved FLOP/s)`` of square fp32 matmuls by size, FLOPs ascending
    (the CPU profile: n = 32 to 512). A matmul of fewer FLOPs than the largest runs at a
    fraction of ``peak_flops`` (:meth:`matmul_fraction`): a small matmul (an attention head's
    64 x 64 scores) is dominated by its fixed cost, not its FLOPs. Empty: every matmul at
    ``peak_flops`` x ``matmul_efficiency`` (the datasheet profiles)."""
    cache_bytes: int = 0
    """Bytes a kernel may touch and still run at ``cache_bandwidth_bytes_per_s`` (one core's
    L2 on the CPU profile); 0: every byte at ``memory_bandwidth_bytes_per_s``."""
    cache_bandwidth_bytes_per_s: float = 0.0
    """Measured copy bandwidth over buffers within ``cache_bytes`` (the CPU profile)."""
    host_link_bytes_per_s: float = 25e9
    """Device<->host copy bandwidth, one direction, bytes/s: what prices activation offload.
    PCIe 4 x16 ~25e9 achieved (32 GB/s raw), PCIe 5 x16 ~50e9, NVLink-C2C (GH200) ~450e9
    (``HOST_LINKS``). The CPU profile uses its measured memcpy bandwidth (host is a second
    CPU buffer there)."""

    def peak_flops_for(self, dtype: torch.dtype | str, *, matmul: bool = True) -> float:
        """Peak FLOP/s for ``dtype``; dtypes without an entry (float64, ints) use "float32".

        Non-matmul ops always use the "float32" (vector unit) rate: they do not run on tensor
        cores. fp32 matmuls use "tfloat32" when the float32 matmul precision allows TF32.
        """
        key = str(dtype).removeprefix("torch.")
        if not matmul:
            return self.peak_flops["float32"]
        if key == "float32" and "tfloat32" in self.peak_flops:
            if torch.get_float32_matmul_precision() != "highest":
                return self.peak_flops["tfloat32"]
        return self.peak_flops.get(key, self.peak_flops["float32"])

    def matmul_fraction(self, flops: float) -> float:
        """The fraction of the peak rate a matmul of ``flops`` FLOPs achieves: interpolated
        (log-log) between ``matmul_rates``' points, as the largest at or above it, as the
        smallest below it; 1.0 without measured rates."""
        pts = self.matmul_rates
        if not pts or flops <= 0:
            return 1.0
        top = max(rate for _, rate in pts)
        if flops <= pts[0][0]:
            return pts[0][1] / top
        for (f0, r0), (f1, r1) in zip(pts, pts[1:]):
            if flops <= f1:
                t = math.log(flops / f0) / math.log(f1 / f0)
                return math.exp(math.log(r0) + t * (math.log(r1) - math.log(r0))) / top
        return pts[-1][1] / top

    def memory_seconds(self, nbytes: float) -> float:
        """Seconds to move ``nbytes`` in one kernel: at the cache's rate where they fit in
        ``cache_bytes``, else at the memory's, each times ``memory_efficiency``."""
        if not nbytes:
            return 0.0
        fits = self.cache_bytes and nbytes <= self.cache_bytes and self.cache_bandwidth_bytes_per_s
        rate = self.cache_bandwidth_bytes_per_s if fits else self.memory_bandwidth_bytes_per_s
        return nbytes / (rate * self.memory_efficiency)

    def summary(self) -> dict[str, Any]:
        """What prices recompute, rounded for a plan's record: peak FLOP/s by dtype (TFLOP/s),
        the smallest measured matmul's fraction of the peak, memory and cache bandwidth (GB/s),
        the per-kernel overhead (us)."""
        out: dict[str, Any] = {"name": self.name,
                               "tflops": {k: round(v / 1e12, 3) for k, v in sorted(self.peak_flops.items())},
                               "memory_gb_s": round(self.memory_bandwidth_bytes_per_s * self.memory_efficiency / 1e9, 1),
                               "launch_us": round(self.launch_overhead_s * 1e6, 2)}
        if self.matmul_rates:
            out["smallest_matmul"] = {"flops": self.matmul_rates[0][0],
                                      "fraction_of_peak": round(self.matmul_fraction(self.matmul_rates[0][0]), 3)}
        if self.cache_bytes:
            out["cache"] = {"bytes": self.cache_bytes, "gb_s": round(self.cache_bandwidth_bytes_per_s / 1e9, 1)}
        return out

    def __hash__(self) -> int:  # the dict field would make the generated hash fail
        return hash((self.name, tuple(sorted(self.peak_flops.items())), self.memory_bandwidth_bytes_per_s))

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict (JSON) form."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> HardwareProfile:
        """Inverse of :meth:`to_dict`."""
        return cls(**{**d, "peak_flops": dict(d["peak_flops"]),
                      "matmul_rates": tuple(tuple(pt) for pt in d.get("matmul_rates", ()))})


# Sources: "NVIDIA A100 Tensor Core GPU" datasheet (2021), "NVIDIA H100 Tensor Core GPU"
# datasheet (2023), "NVIDIA H200 Tensor Core GPU" datasheet (2024). Tensor-core figures below
# are the *dense* ones (datasheets headline the 2:4-sparsity numbers, which are 2x).
DATASHEET_PROFILES: dict[str, HardwareProfile] = {
    "a100-sxm4-80gb": HardwareProfile(
        name="a100-sxm4-80gb",
        peak_flops={
            "float32": 19.5 * TERA,  # A100 datasheet: FP32 19.5 TFLOPS
            "tfloat32": 156 * TERA,  # TF32 tensor core 156 (312 sparse)
            "bfloat16": 312 * TERA,  # BF16 tensor core 312 (624 sparse)
            "float16": 312 * TERA,  # FP16 tensor core 312 (624 sparse)
        },
        memory_bandwidth_bytes_per_s=2039e9,  # A100 80GB SXM: 2,039 GB/s HBM2e
        memory_capacity_bytes=80 * GIB,  # 80GB HBM2e (5 stacks x 16 GiB)
        launch_overhead_s=3e-6,  # GPU-timeline gap per kernel when the CPU runs ahead
        default_link="nvlink3",  # NVLink 3: 600 GB/s
        host_link_bytes_per_s=25e9,  # host over PCIe 4 x16
    ),
    "a100-pcie-80gb": HardwareProfile(
        name="a100-pcie-80gb",
        peak_flops={  # A100 datasheet, PCIe column: same compute peaks as SXM (at lower TDP,
            "float32": 19.5 * TERA,  # so sustained clocks may be lower under load)
            "tfloat32": 156 * TERA,
            "bfloat16": 312 * TERA,
            "float16": 312 * TERA,
        },
        memory_bandwidth_bytes_per_s=1935e9,  # A100 80GB PCIe: 1,935 GB/s
        memory_capacity_bytes=80 * GIB,
        launch_overhead_s=3e-6,
        default_link="pcie4",  # PCIe Gen4 64 GB/s bidir (NVLink bridge pairs only 2 GPUs)
        host_link_bytes_per_s=25e9,  # PCIe 4 x16
    ),
    "h100-sxm": HardwareProfile(
        name="h100-sxm",
        peak_flops={
            "float32": 67 * TERA,  # H100 SXM datasheet: FP32 67 TFLOPS
            "tfloat32": 494.5 * TERA,  # TF32 989 TFLOPS with sparsity -> 494.5 dense
            "bfloat16": 989.5 * TERA,  # BF16 1,979 TFLOPS with sparsity -> 989.5 dense
            "float16": 989.5 * TERA,  # FP16 1,979 TFLOPS with sparsity -> 989.5 dense
        },
        memory_bandwidth_bytes_per_s=3.35e12,  # 3.35 TB/s HBM3
        memory_capacity_bytes=80 * GIB,  # 80GB HBM3
        launch_overhead_s=3e-6,
        default_link="nvlink4",  # NVLink 4: 900 GB/s
        host_link_bytes_per_s=50e9,  # host over PCIe 5 x16 (GH200 would be NVLink-C2C, 450e9)
    ),
    "h200": HardwareProfile(
        name="h200",
        peak_flops={  # H200 SXM datasheet: same Hopper compute as H100 SXM
            "float32": 67 * TERA,
            "tfloat32": 494.5 * TERA,
            "bfloat16": 989.5 * TERA,
            "float16": 989.5 * TERA,
        },
        memory_bandwidth_bytes_per_s=4.8e12,  # 4.8 TB/s HBM3e
        memory_capacity_bytes=141 * GIB,  # "141GB" HBM3e (about 139 GiB visible to CUDA)
        launch_overhead_s=3e-6,
        default_link="nvlink4",  # NVLink 900 GB/s
        host_link_bytes_per_s=50e9,  # PCIe 5 x16
    ),
    # Huawei publishes few official 910B numbers; these are the commonly quoted public figures
    # and are UNCERTAIN. FP16 is quoted 280-376 TFLOPS depending on SKU (910B4..910B2); we
    # take ~313 (910B3). No FP32 figure is published: we assume 1/4 of FP16 (the Cube unit
    # does FP16; FP32 goes through HF32 / the vector unit) -- a guess. 64 GB HBM2e is
    # consistent across sources; bandwidth is quoted 1.2-1.8 TB/s, we take 1.6 TB/s.
    "ascend-910b": HardwareProfile(
        name="ascend-910b",
        peak_flops={"float32": 78 * TERA, "bfloat16": 313 * TERA, "float16": 313 * TERA},
        memory_bandwidth_bytes_per_s=1.6e12,
        memory_capacity_bytes=64 * GIB,
        launch_overhead_s=10e-6,  # NPU op dispatch is heavier than CUDA launch (guess)
        default_link="hccs",
        host_link_bytes_per_s=25e9,  # PCIe 4 x16 (assumed, like the rest of this profile)
    ),
}

#: Device<->host links, one direction, achieved bytes/s (datasheet raw: PCIe 4 x16 32 GB/s,
#: PCIe 5 x16 64 GB/s, NVLink-C2C 900 GB/s total = 450 GB/s per direction).
HOST_LINKS: dict[str, float] = {"pcie4": 25e9, "pcie5": 50e9, "nvlink-c2c": 450e9}

#: An on-disk cache for the calibrated CPU profile outside torch's cache directory (opt-in).
DEFAULT_CPU_PROFILE_CACHE = Path("~/.cache/lynx_compile/cpu_profile.json").expanduser()
_MACHINE_CACHE = object()  # calibrate_cpu_profile's default: cpu_profile_cache_path()


def cpu_profile_cache_path() -> Path:
    """Where the calibrated CPU profile is kept for every process of this machine:
    ``$LYNX_CPU_PROFILE`` if set, else ``lynx/cpu_profile.json`` under torch.compile's cache
    directory (``TORCHINDUCTOR_CACHE_DIR``; ``torch._inductor.utils.fresh_cache()`` gives a
    fresh one). Plans are priced by this profile: measured once and shared, every process
    plans the same graph alike (issue M: a profile timed per process gave each its own plan).
    Delete the file to measure the CPU again."""
    from lynx_compile import _compat

    env = os.environ.get("LYNX_CPU_PROFILE")
    return Path(env).expanduser() if env else Path(_compat.inductor_cache_dir()) / "lynx" / "cpu_profile.json"

_cpu_profiles: dict[str, HardwareProfile] = {}  # per-process calibration cache, by machine key


CPU_PROFILE_VERSION = 2
"""Bumped when the CPU profile measures something new (2: matmul rates by size, the cache's
bandwidth): a profile cached by an older version is measured again."""


def _cpu_key() -> str:
    return (f"torch={torch.__version__};cpus={os.cpu_count()};threads={torch.get_num_threads()};"
            f"v{CPU_PROFILE_VERSION}")


def calibrate_cpu_profile(
    seconds_budget: float = 1.5, *, cache_file: Any = _MACHINE_CACHE, force: bool = False
) -> HardwareProfile:
    """Measure this CPU and return it as the ``"cpu"`` profile (cached per process).

    Measures fp32 ``torch.mm`` FLOP/s (best over sizes 128, 256, 512), bf16/fp16 mm FLOP/s
    (one size), memory bandwidth (best of a 64 MB copy and add), and per-op dispatch overhead
    (median time of a 1-element add). Takes about ``seconds_budget`` seconds at most (plus
    one-time warm-up). The numbers are achieved rates, so both efficiency factors are 1.0.

    ``cache_file`` persists the result as JSON keyed by torch version, CPU count and torch
    thread count, read back by later processes (default :func:`cpu_profile_cache_path`, shared
    by the machine's processes; None: this process only); ``force`` re-measures.
    """
    return _kept_profile(_cpu_key(), _cpu_profiles, cache_file, force, lambda: (_measure_cpu(seconds_budget), True))


def _kept_profile(key: str, memo: dict[str, HardwareProfile], cache_file: Any, force: bool,
                  measure: Callable[[], tuple[HardwareProfile, bool]]) -> HardwareProfile:
    """The profile kept under ``key``: from this process's ``memo``, else from the machine's
    file (``cache_file``; :data:`_MACHINE_CACHE`: :func:`cpu_profile_cache_path`; None: none),
    else ``measure()`` = (profile, whether to keep it in the file), under the file's lock
    (processes starting together: one measures, the others read it); ``force`` measures."""
    if not force and key in memo:
        return memo[key]
    if cache_file is _MACHINE_CACHE:
        cache_file = cpu_profile_cache_path()
    path = Path(cache_file).expanduser() if cache_file is not None else None
    with _machine_lock(path):
        if not force and path is not None and path.exists():
            try:
                stored = json.loads(path.read_text())
                if key in stored:
                    memo[key] = HardwareProfile.from_dict(stored[key])
                    return memo[key]
            except (OSError, ValueError, TypeError, KeyError) as e:
                log.warning("ignoring unreadable profile cache %s: %s", path, e)
        profile, keep = measure()
        memo[key] = profile
        if keep and path is not None:
            _write_cache(path, key, profile)
    return profile


@contextlib.contextmanager
def _machine_lock(path: Path | None):
    """An exclusive lock on ``<path>.lock`` (POSIX ``flock``) while the block runs; nothing when
    ``path`` is None, the platform has no ``fcntl`` or the lock file cannot be made."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        fcntl = None
    if path is None or fcntl is None:
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        f = open(path.with_name(path.name + ".lock"), "a")
    except OSError:
        yield
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _measured_fields(m: dict[str, Any]) -> dict[str, Any]:
    """The profile fields a measurement (``cpu_measure`` / ``cuda_measure``'s dict) gives."""
    return dict(
        peak_flops=dict(m["peak_flops"]),
        memory_bandwidth_bytes_per_s=max(m["copy_bytes_per_s"], m["add_bytes_per_s"]),
        launch_overhead_s=float(m["launch_overhead_s"]),
        matmul_efficiency=1.0,  # measured rates are already achieved rates
        memory_efficiency=1.0,
        matmul_rates=tuple((float(f), float(r)) for f, r in m["matmul_rates"]),
        cache_bytes=int(m["cache_bytes"]),
        cache_bandwidth_bytes_per_s=float(m["cache_bytes_per_s"]),
    )


def _measure_cpu(budget: float) -> HardwareProfile:
    from lynx_compile.costs import cpu_measure

    try:
        m = _child_measurement(cpu_measure, budget, torch.get_num_threads())
    except _CHILD_ERRORS as e:
        log.warning("measuring the CPU profile in a child process failed (%s); measuring in this process, whose "
                    "~192 MB of bandwidth buffers count in this step's memory. LYNX_CPU_PROFILE naming a profile "
                    "file an earlier process wrote avoids the measurement.", _why(e))
        m = cpu_measure.measure(budget)
    return HardwareProfile(
        name="cpu", memory_capacity_bytes=_physical_memory(), default_link="loopback-gloo",
        # "host" is another CPU buffer: a memcpy (read + write)
        host_link_bytes_per_s=m["copy_bytes_per_s"] / 2, **_measured_fields(m))


_CHILD_ERRORS = (OSError, subprocess.SubprocessError, ValueError, IndexError)
"""What :func:`_child_measurement` raises where the child cannot run or answer."""


def _child_measurement(module: types.ModuleType, *args: Any) -> dict[str, Any]:
    """``module``'s source (``cpu_measure``, ``cuda_measure``) run in a fresh interpreter with
    ``args``, its last line of output read as JSON: nothing it allocates is this process's (on a
    CPU device its bandwidth buffers would be the peak of the step that compiles first; on a GPU
    they live in the child's own CUDA context)."""
    cmd = [sys.executable, "-c", Path(module.__file__).read_text(), *map(repr, args)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _why(e: Exception) -> str:
    """An exception of :func:`_child_measurement` in a line, with the child's last line of
    stderr (not the command: it holds the measuring module's whole source)."""
    if isinstance(e, subprocess.CalledProcessError):
        what = f"the child exited with status {e.returncode}"
    elif isinstance(e, subprocess.TimeoutExpired):
        what = f"the child ran past {e.timeout:g} s"
    else:
        what = str(e)
    stderr = e.stderr if isinstance(getattr(e, "stderr", None), str) else ""
    return f"{what}: {stderr.strip().splitlines()[-1]}" if stderr.strip() else what


_cuda_profiles: dict[str, HardwareProfile] = {}  # per-process, by device key


def _cuda_key(index: int) -> str:
    return (f"cuda={torch.cuda.get_device_name(index)};torch={torch.__version__};"
            f"cuda_version={torch.version.cuda};v{CPU_PROFILE_VERSION}")


def calibrate_cuda_profile(index: int | None = None, seconds_budget: float = 3.0, *,
                           cache_file: Any = _MACHINE_CACHE, force: bool = False) -> HardwareProfile:
    """The current (or ``index``-th) CUDA device measured as ``cpu`` is (issue R, item 2): bf16
    matmul rates by size (the best is the peak), fp32/fp16 matmul rates, HBM and L2
    bandwidth, the GPU-timeline gap per kernel (``cuda_measure``, in a child process: nothing
    allocated in this one). Kept in the same file as the CPU profile, keyed by device name,
    torch and CUDA versions, and read back by every later process. The link and host-link
    figures stay the datasheet profile's (``profile_name_for_device``). Where measuring
    fails, the datasheet profile, with a warning naming why."""
    index = torch.cuda.current_device() if index is None else index

    def measure() -> tuple[HardwareProfile, bool]:
        from lynx_compile.costs import cuda_measure

        datasheet = PROFILES[profile_name_for_device(torch.cuda.get_device_name(index))]
        try:
            m = _child_measurement(cuda_measure, seconds_budget, index)
        except _CHILD_ERRORS as e:
            log.warning("measuring CUDA device %d failed (%s); pricing recompute with the %s datasheet profile",
                        index, _why(e), datasheet.name)
            return datasheet, False
        profile = profile_from_measurement(m, datasheet)
        log.info("lynx: measured %s: bf16 mm %.0f TFLOP/s, HBM %.0f GB/s, L2 %.0f GB/s, %.1f us per kernel",
                 m["device_name"], m["peak_flops"]["bfloat16"] / 1e12, profile.memory_bandwidth_bytes_per_s / 1e9,
                 profile.cache_bandwidth_bytes_per_s / 1e9, profile.launch_overhead_s * 1e6)
        return profile, True

    return _kept_profile(_cuda_key(index), _cuda_profiles, cache_file, force, measure)


def profile_from_measurement(m: dict[str, Any], datasheet: HardwareProfile) -> HardwareProfile:
    """A measured device profile (``cuda_measure.measure``'s dict) on ``datasheet``'s links."""
    return replace(datasheet, name=datasheet.name + "-measured",
                   memory_capacity_bytes=int(m["memory_capacity_bytes"]), **_measured_fields(m))


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 16 * GIB


def _write_cache(path: Path, key: str, profile: HardwareProfile) -> None:
    store_machine_entry(path, key, profile.to_dict(), "CPU profile")


def store_machine_entry(path: Path, key: str, data: dict, what: str) -> None:
    """``data`` kept under ``key`` in the JSON file ``path`` (a machine's measurements: the CPU
    profile, a calibrated link), the file's other entries kept; ``what`` names it in a warning
    when the file cannot be written."""
    try:
        stored = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError):
        stored = {}
    stored[key] = data
    try:  # atomic: a process reading it meanwhile (another rank) sees the old file or the new one
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(stored, indent=2))
        os.replace(tmp, path)
    except OSError as e:
        log.warning("could not write %s cache %s: %s", what, path, e)


def load_machine_entry(path: Path, key: str) -> dict | None:
    """The entry ``key`` of the JSON file ``path`` (:func:`store_machine_entry`), None when the
    file or the entry is missing or unreadable."""
    try:
        stored = json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable cache %s: %s", path, e)
        return None
    entry = stored.get(key) if isinstance(stored, dict) else None
    return entry if isinstance(entry, dict) else None


class _ProfileTable(Mapping):
    """Read-only name -> profile mapping whose dynamic entries (``"cpu"``) are computed on
    first lookup, so listing the names never triggers a calibration."""

    def __init__(self, static: dict[str, HardwareProfile], lazy: dict[str, Callable[[], HardwareProfile]]):
        self._static, self._lazy = static, lazy

    def __getitem__(self, name: str) -> HardwareProfile:
        if name in self._static:
            return self._static[name]
        return self._lazy[name]()

    def __iter__(self) -> Iterator[str]:
        return iter([*self._static, *self._lazy])

    def __len__(self) -> int:
        return len(self._static) + len(self._lazy)

    def __repr__(self) -> str:
        return f"PROFILES({list(self)})"


#: Every named profile: the datasheet ones plus ``"cpu"`` (calibrated on first lookup).
PROFILES: Mapping[str, HardwareProfile] = _ProfileTable(DATASHEET_PROFILES, {"cpu": calibrate_cpu_profile})


def profile_name_for_device(device_name: str) -> str:
    """Map a CUDA device name (``torch.cuda.get_device_name()``) to a ``PROFILES`` key."""
    up = device_name.upper()
    if "H200" in up:
        return "h200"
    if "H100" in up or "H800" in up:
        if "PCIE" in up:
            log.warning("%s: using the h100-sxm profile (PCIe parts are slower)", device_name)
        return "h100-sxm"
    if "A100" in up or "A800" in up:
        return "a100-pcie-80gb" if "PCIE" in up else "a100-sxm4-80gb"
    log.warning("no profile for device %r; falling back to a100-sxm4-80gb", device_name)
    return "a100-sxm4-80gb"


def get_profile(name: str) -> HardwareProfile:
    """Profile by name: a ``PROFILES`` key (``"cpu"`` is calibrated once), or ``"auto"``.

    ``"auto"``: the current CUDA device measured (:func:`calibrate_cuda_profile`; its
    datasheet profile, :func:`profile_name_for_device`, where measuring fails or
    ``LYNX_DATASHEET_PROFILE=1``), an Ascend NPU (torch_npu) as ``"ascend-910b"``, else
    ``"cpu"``. Unknown names raise ValueError.
    """
    if name in PROFILES:
        return PROFILES[name]
    if name == "auto":
        if torch.cuda.is_available():
            if os.environ.get("LYNX_DATASHEET_PROFILE") == "1":
                return PROFILES[profile_name_for_device(torch.cuda.get_device_name())]
            return calibrate_cuda_profile()
        npu = getattr(torch, "npu", None)
        if npu is not None and npu.is_available():
            return PROFILES["ascend-910b"]
        return calibrate_cpu_profile()
    raise ValueError(f"unknown hardware profile {name!r}; valid: {[*PROFILES, 'auto']}")


def with_overrides(profile: HardwareProfile, **changes: Any) -> HardwareProfile:
    """A copy of ``profile`` with some fields replaced (e.g. a measured bandwidth)."""
    return replace(profile, **changes)
