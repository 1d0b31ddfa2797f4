"""Where a run happens: the device it asked for, what that device has, and the software around it."""

from __future__ import annotations

import contextlib
import datetime
import functools
import importlib.metadata
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from profuse.errors import UsageError

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}


def resolve_device(name: str | torch.device | None = "auto") -> torch.device:
    """'auto' (or None) picks cuda when a GPU is there, else cpu; 'cuda' without a GPU is an error."""
    if name is None or str(name) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as err:
        raise UsageError(f"unknown device {name!r}: use auto, cuda or cpu") from err
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError("--device cuda was asked for, but no CUDA GPU is available here")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UsageError(
                f"device {device} is not there: this machine has {torch.cuda.device_count()} GPU(s)"
            )
    elif device.type != "cpu":
        raise UsageError(f"device {name!r} is not supported: use auto, cuda or cpu")
    return device


def resolve_dtype(name: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    """None picks bf16 on CUDA and fp32 on CPU, as the lab does."""
    if isinstance(name, torch.dtype):
        return name
    if name is None or name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise UsageError(f"unknown dtype {name!r}: use bf16, fp16 or fp32") from None


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes that can still be allocated on `device`, or None where that cannot be read."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        # Memory the caching allocator holds but does not use can be handed out again.
        idx = device.index if device.index is not None else torch.cuda.current_device()
        reserved = torch.cuda.memory_reserved(idx) - torch.cuda.memory_allocated(idx)
        return int(free + reserved)
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


# The share of a device's free memory a run may plan to use: the rest for the allocator's blocks,
# the CUDA context's growth, cuBLAS and cuDNN workspaces.
FIT_SHARE = 0.9


def check_fits(need_bytes: int, device: torch.device, what: str) -> None:
    """Raise UsageError when `need_bytes` will not fit in what `device` has free."""
    free = free_memory_bytes(device)
    if free is not None and need_bytes > FIT_SHARE * free:
        raise UsageError(
            f"{what} needs about {need_bytes / 1e9:.1f} GB on {device}, more than the "
            f"{FIT_SHARE:.0%} of the {free / 1e9:.1f} GB free a run plans on (the rest for the allocator's "
            "blocks and the libraries' workspaces): choose smaller sizes"
        )


def l2_cache_bytes(device: torch.device) -> int:
    """The device's L2 size (60 MB on an H200), or 50 MB where torch cannot say."""
    props = torch.cuda.get_device_properties(device)
    return int(getattr(props, "L2_cache_size", 0) or 50 * 2**20)


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors on a GPU; a small stand-in on the CPU (the Triton interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


SMI_FIELDS = (
    "name",
    "driver_version",
    "clocks.sm",
    "clocks.mem",
    "clocks.max.sm",
    "clocks.max.mem",
    "power.limit",
    "temperature.gpu",
)


def _nvidia_smi(
    device: torch.device, fields: tuple[str, ...] = SMI_FIELDS, gpu_id: str | None = None
) -> dict:
    """nvidia-smi's `fields` for one GPU (by index, or `gpu_id`: its UUID, which holds under
    CUDA_VISIBLE_DEVICES's renumbering), or {} where nvidia-smi is missing or fails."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return {}
    if gpu_id is None:
        gpu_id = str(device.index if device.index is not None else torch.cuda.current_device())
    try:
        out = subprocess.run(
            [exe, f"--id={gpu_id}", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return {}
    values = [v.strip() for v in out.split(",")]
    return dict(zip(fields, values)) if len(values) == len(fields) else {}


def whole_number_setting(name: str, unit: str) -> int | None:
    """The environment variable `name` as an int, None where unset or empty; ValueError naming
    it where it is not a whole number (of `unit`)."""
    raw = os.environ.get(name)
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number of {unit}") from None


def interpreting() -> bool:
    """Does Triton run its kernels through the interpreter (on CPU tensors)?"""
    return os.environ.get("TRITON_INTERPRET") == "1"


def environment(device: torch.device) -> dict:
    """What a result needs beside it to be compared later: card, clocks, driver, versions."""
    info: dict = {
        "device": str(device),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "argv": sys.argv[1:],
        # Triton's kernels ran through its interpreter: their times are the interpreter's.
        "triton_interpret": device.type != "cuda" and interpreting(),
        **cpu_threads(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            gpu=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            sm_count=props.multi_processor_count,
            memory_gb=round(props.total_memory / 1e9, 1),
            l2_cache_mb=round(l2_cache_bytes(device) / 2**20, 1),
            cuda=torch.version.cuda,
        )
        smi = _nvidia_smi(device)
        if smi:
            info["driver"] = smi.pop("driver_version", None)
            info["nvidia_smi"] = smi
    return info


# --------------------------------------------------------------------------------------------
# Provenance: what any saved file needs to be traced to its run and checked again
# --------------------------------------------------------------------------------------------

# The packages whose versions change what a run measures; a missing one is recorded as None.
PACKAGES = ("torch", "triton", "transformers", "liger-kernel", "numpy", "scipy")
# Environment variables that change what profuse does or where it runs; PROFUSE_* too.
BEHAVIOUR_ENV = ("TRITON_INTERPRET", "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")
# Where a tree copied without its .git came from, said by whoever copied it: the commit, and 1
# where the copy held uncommitted changes.
SOURCE_COMMIT_ENV = "PROFUSE_SOURCE_COMMIT"
SOURCE_DIRTY_ENV = "PROFUSE_SOURCE_DIRTY"
# The card, as nvidia-smi names its fields.
CARD_FIELDS = (
    "name",
    "uuid",
    "driver_version",
    "memory.total",
    "clocks.sm",
    "clocks.mem",
    "clocks.max.sm",
    "clocks.max.mem",
    "power.limit",
)


def utc_now() -> str:
    """'2026-12-07T04:01:32Z': the time in UTC, to the second."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def provenance(started_utc: str | None = None, command: list[str] | None = None) -> dict:
    """Where a saved result came from: the source tree (git commit and whether it had uncommitted
    changes), the versions of the packages that change a measurement, the card (or the CPU), the
    host, the command line and the environment variables that change behaviour, and when the run
    started and ended (now). `command`: profuse's own arguments where the CLI was called from
    Python (sys.argv is then the caller's). Never raises: a piece that cannot be read is None."""
    return {
        "profuse": _profuse_version(),
        "source": source_tree(),
        "versions": versions(),
        "card": card(),
        "host": socket.gethostname(),
        "command": {
            "argv": list(sys.argv),
            **({"profuse_args": list(command)} if command is not None else {}),
            "env": behaviour_env(),
        },
        "started_utc": started_utc,
        "ended_utc": utc_now(),
    }


def _profuse_version() -> str | None:
    with contextlib.suppress(Exception):
        from profuse import __version__

        return __version__
    return None


def behaviour_env(environ: dict | None = None) -> dict[str, str]:
    """The environment variables set that change what a run does: PROFUSE_* and BEHAVIOUR_ENV."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if k.startswith("PROFUSE_") or k in BEHAVIOUR_ENV}


@functools.lru_cache(maxsize=1)
def source_tree(root: str | None = None) -> dict:
    """{'commit', 'dirty', 'path'} of the git checkout profuse's source lies in: the commit checked
    out, and whether the package's own files (src/profuse) differ from it or hold new ones. Both
    None where it is not a checkout (an installed wheel) or git cannot be run. Read once a
    process."""
    where = Path(root) if root else Path(__file__).resolve().parent
    out: dict = {"commit": None, "dirty": None, "path": str(where)}
    git = shutil.which("git")
    try:
        if git is not None:
            commit = _git(git, where, "rev-parse", "HEAD")
            status = _git(git, where, "status", "--porcelain", "--", ".")
            out.update(commit=commit or None, dirty=bool(status) if commit else None)
    except (OSError, subprocess.SubprocessError):
        pass
    if os.environ.get(SOURCE_COMMIT_ENV):
        # a copy of a checkout sent to a GPU machine: its sender knows the commit, where the copy
        # has no .git or a stale one (seen 2026-12-07: the session's first commit, "dirty")
        if out["commit"] is not None:
            out["git_saw"] = {"commit": out["commit"], "dirty": out["dirty"]}
        out.update(
            commit=os.environ[SOURCE_COMMIT_ENV],
            dirty=os.environ.get(SOURCE_DIRTY_ENV, "").lower() in ("1", "true", "yes"),
            told_by=SOURCE_COMMIT_ENV,
        )
    return out


def _git(git: str, where: Path, *args: str) -> str:
    return subprocess.run(
        [git, "-C", str(where), *args], capture_output=True, text=True, timeout=10, check=True
    ).stdout.strip()


@functools.lru_cache(maxsize=1)
def versions() -> dict:
    """Python, the PACKAGES (None where not installed), and CUDA's runtime, cuDNN and driver
    (None on a machine without them)."""
    out: dict = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    out["torch"] = torch.__version__  # the one imported, local build tag and all
    out["cuda_runtime"] = torch.version.cuda
    cudnn = None
    with contextlib.suppress(Exception):
        if torch.backends.cudnn.is_available():
            cudnn = torch.backends.cudnn.version()
    out["cudnn"] = cudnn
    out["driver"] = _driver_version()
    return out


def _driver_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    return _nvidia_smi(torch.device("cuda"), ("driver_version",), "0").get("driver_version")


def card(device: torch.device | None = None) -> dict:
    """The GPU a run used (the current CUDA device): name, UUID, SMs, memory, SM and memory clocks
    now and at most, power limit, from nvidia-smi where it is there and from torch's device
    properties otherwise; on a machine without CUDA, the CPU's model and cores."""
    if device is None or device.type == "cuda":
        with contextlib.suppress(Exception):
            if torch.cuda.is_available():
                return _gpu_card(device or torch.device("cuda", torch.cuda.current_device()))
    return {
        "kind": "cpu",
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "cores_available": available_cores(),
    }


def _gpu_card(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", "") or "") or None
    if uuid and not uuid.startswith("GPU-"):
        uuid = f"GPU-{uuid}"
    out = {
        "kind": "cuda",
        "name": props.name,
        "uuid": uuid,
        "sm_count": props.multi_processor_count,
        "memory_bytes": int(props.total_memory),
        "compute_capability": f"{props.major}.{props.minor}",
        "source": "torch",
    }
    smi = _nvidia_smi(device, CARD_FIELDS, uuid)
    if smi:
        out.update(
            uuid=smi.get("uuid") or uuid,
            sm_clock=smi.get("clocks.sm"),
            memory_clock=smi.get("clocks.mem"),
            max_sm_clock=smi.get("clocks.max.sm"),
            max_memory_clock=smi.get("clocks.max.mem"),
            power_limit=smi.get("power.limit"),
            driver=smi.get("driver_version"),
            source="nvidia-smi",
        )
    return out


def available_cores() -> int:
    """The cores this process may run on (its affinity mask), or os.cpu_count()."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def cpu_threads() -> dict:
    """torch's intra-op threads, the cores this process may use, and the 1-minute load average:
    what says whether the CPU was oversubscribed while it timed (oversubscribed())."""
    try:
        load = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    return {"threads": torch.get_num_threads(), "cores_available": available_cores(), "load_1m": load}


def set_threads(n: int | None) -> None:
    """torch.set_num_threads(n) for the CPU's intra-op work (None: leave torch's default, one
    thread per core); the environment dict then records it."""
    if n is not None:
        if n < 1:
            raise UsageError(f"--threads must be 1 or more, got {n}")
        torch.set_num_threads(n)


def oversubscribed(env: dict) -> str:
    """A one-line note where a CPU run's threads outnumbered the cores free for them (more intra-op
    threads than cores, or a load average above the cores: other work wanted them too), else ''.
    Such threads wait for each other and for other processes, and a trial's time swings with them
    (a tiny step went from 2.6 ms to 545 ms on a shared 2-core machine; 2.9-3.5 ms on one thread)."""
    if env.get("gpu") or "threads" not in env:
        return ""
    threads, load = env["threads"], env.get("load_1m")
    cores = env.get("cores_available") or env.get("cpu_count") or 1
    busy = load is not None and load > cores
    if threads <= cores and not busy:
        return ""
    why = f"{threads} intra-op thread{'s' if threads != 1 else ''} on {cores} core{'s' if cores != 1 else ''}"
    if load is not None:
        why += f" with a 1-minute load of {load:g}"
    fewer = max(1, min(threads - 1, cores - 1)) if threads > 1 else 1
    fix = (
        f"--threads {fewer} (torch.set_num_threads) leaves cores to the rest and keeps trials steadier"
        if threads > 1
        else "time it on a quieter machine"
    )
    return f"note: the CPU was oversubscribed ({why}): threads waited on other work, so trials swing; {fix}"


def cpu_model() -> str:
    """The CPU's marketing name ('AMD EPYC 7B13'), or the architecture where none can be read."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:  # Linux
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True,
                                 text=True, timeout=5, check=True).stdout.strip()  # fmt: skip
            if out:
                return out
    return platform.processor() or platform.machine() or "unknown"


def card_name(env: dict) -> str:
    """A short name for the hardware a result came from: the GPU, or the CPU and its cores."""
    if env.get("gpu"):
        return env["gpu"]
    # Files saved before cpu_model was recorded name the architecture (x86_64) instead.
    return f"{env.get('cpu_model') or env.get('processor') or 'CPU'} ({env.get('cpu_count')} cores)"


def describe(env: dict) -> str:
    """'card: NVIDIA H200, torch 2.11.0, triton 3.6.0' or 'CPU: AMD EPYC (2 cores), torch 2.13.0,
    triton not installed': the hardware and the versions a saved result came from."""
    what = "card" if env.get("gpu") else "CPU"
    triton = f"triton {env['triton']}" if env.get("triton") else "triton not installed"
    return f"{what}: {card_name(env)}, torch {env.get('torch')}, {triton}"


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


# Lines that native code writes straight to the process's stderr (fd 2), past Python: torch's
# profiler (Kineto) at every start and stop ("USDT: ... profiler_start", "STAGE: ... Warm Up",
# at any KINETO_LOG_LEVEL), and a CUDA build of torch on a machine without a GPU.
NATIVE_NOISE = re.compile(r"^(USDT|STAGE):|gpuGetDeviceCount failed|No CUDA runtime is found")


@contextlib.contextmanager
def quiet_native_stderr(noise: re.Pattern = NATIVE_NOISE):
    """Hold fd 2 in a temporary file for the block, then write back what came there less the
    lines `noise` matches: the profiler's start and stop lines go, anything else (a warning, an
    error) still comes out, after the block and in its order. Where fd 2 cannot be held (no such
    descriptor), the block runs as it is."""
    try:
        saved = os.dup(2)
    except OSError:
        yield
        return
    held = tempfile.TemporaryFile()
    try:
        sys.stderr.flush()
        os.dup2(held.fileno(), 2)
        yield
    finally:
        with contextlib.suppress(Exception):
            sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        held.seek(0)
        text = held.read().decode("utf-8", errors="replace")
        held.close()
        kept = "".join(line for line in text.splitlines(keepends=True) if not noise.search(line))
        if kept:
            os.write(2, kept.encode("utf-8"))
