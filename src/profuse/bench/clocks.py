"""The GPU's clocks, power and throttling through each trial, read from NVML.

A trial's time depends on the clock the GPU ran at: a card that throttles (its power cap, its
temperature) mid-run slows whichever variants it happened to be timing. One nvidia-smi reading
before a run says nothing about that, so `compare` reads, for every trial:

- the SM clock (MHz) and the temperature (C) at the trial's end;
- the mean power (W) over the trial, from the energy counter's difference (Volta and later), or
  the power reading at its end where there is no counter;
- the clock event (throttle) reasons at its end, and the time NVML counted the GPU held back by
  its power or thermal policy during the trial (nvmlDeviceGetViolationStatus, nanoseconds).

A trial throttled where a power or thermal reason was set or either violation counter moved.

NVML is read through ctypes from libnvidia-ml.so.1 (the driver's own library; no Python package
needed). Where it cannot be loaded, and on a CPU, nothing is read and the readings are absent
(never zero). Every NVML function is looked up by name and a missing one (an older driver) leaves
its field absent.
"""

from __future__ import annotations

import ctypes
import os
import time
from dataclasses import dataclass, field

import torch

NVML_LIBRARY = "libnvidia-ml.so.1"
NVML_SUCCESS = 0
NVML_CLOCK_SM = 1
NVML_TEMPERATURE_GPU = 0
NVML_PERF_POLICY_POWER = 0
NVML_PERF_POLICY_THERMAL = 1

# nvmlClocksEventReasons (nvml.h): the bits, by name. GpuIdle is left out: the readings follow a
# synchronisation, when the GPU is idle by design.
REASONS = {
    0x2: "applications clocks setting",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake",
    0x100: "display clock setting",
}
# The reasons that mean the card held its clocks back for power or heat.
THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


class _ViolationTime(ctypes.Structure):
    _fields_ = [("referenceTime", ctypes.c_ulonglong), ("violationTime", ctypes.c_ulonglong)]


@dataclass
class ClockSample:
    """One trial's readings; None where NVML could not say."""

    sm_mhz: int | None = None
    power_w: float | None = None  # mean over the trial (energy counter), else at its end
    temperature_c: int | None = None
    reasons: list[str] = field(default_factory=list)  # clock event reasons set at the trial's end
    power_violation_s: float | None = None  # held back by the power policy during the trial
    thermal_violation_s: float | None = None  # held back by the thermal policy during the trial
    reason_bits: int | None = None

    @property
    def throttled(self) -> bool:
        return bool((self.reason_bits or 0) & THROTTLE_BITS) or any(
            (v or 0) > 0 for v in (self.power_violation_s, self.thermal_violation_s)
        )

    def to_dict(self) -> dict:
        """The fields NVML gave, and `throttled`; the absent ones are left out."""
        out = {
            k: v
            for k, v in (
                ("sm_mhz", self.sm_mhz),
                ("power_w", self.power_w),
                ("temperature_c", self.temperature_c),
                ("power_violation_s", self.power_violation_s),
                ("thermal_violation_s", self.thermal_violation_s),
            )
            if v is not None
        }
        if self.reason_bits is not None:
            out["reasons"] = list(self.reasons)
        out["throttled"] = self.throttled
        return out


class Nvml:
    """The few NVML calls a trial needs, on one device handle. `lib` is the loaded library (or a
    fake with the same functions)."""

    def __init__(self, lib, handle):
        self.lib = lib
        self.handle = handle

    def _call(self, name: str, *args) -> bool:
        fn = getattr(self.lib, name, None)
        if fn is None:
            return False
        return fn(self.handle, *args) == NVML_SUCCESS

    def _uint(self, name: str, *args) -> int | None:
        out = ctypes.c_uint()
        return int(out.value) if self._call(name, *args, ctypes.byref(out)) else None

    def _ulonglong(self, name: str, *args) -> int | None:
        out = ctypes.c_ulonglong()
        return int(out.value) if self._call(name, *args, ctypes.byref(out)) else None

    def sm_mhz(self) -> int | None:
        return self._uint("nvmlDeviceGetClockInfo", NVML_CLOCK_SM)

    def power_mw(self) -> int | None:
        return self._uint("nvmlDeviceGetPowerUsage")

    def energy_mj(self) -> int | None:
        return self._ulonglong("nvmlDeviceGetTotalEnergyConsumption")

    def temperature_c(self) -> int | None:
        return self._uint("nvmlDeviceGetTemperature", NVML_TEMPERATURE_GPU)

    def reason_bits(self) -> int | None:
        # Renamed from "throttle" to "clocks event" reasons in CUDA 12.2's NVML; either name.
        bits = self._ulonglong("nvmlDeviceGetCurrentClocksEventReasons")
        return bits if bits is not None else self._ulonglong("nvmlDeviceGetCurrentClocksThrottleReasons")

    def violation_ns(self, policy: int) -> int | None:
        out = _ViolationTime()
        ok = self._call("nvmlDeviceGetViolationStatus", policy, ctypes.byref(out))
        return int(out.violationTime) if ok else None


def _handle(lib, device: torch.device):
    """The NVML handle of a CUDA device: by UUID, else by PCI bus id, else by index where no
    CUDA_VISIBLE_DEVICES renumbers the devices. None where none works."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    handle = ctypes.c_void_p()
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        text = str(uuid)
        key = (text if text.startswith("GPU-") else f"GPU-{text}").encode()
        if lib.nvmlDeviceGetHandleByUUID(key, ctypes.byref(handle)) == NVML_SUCCESS:
            return handle
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        dom, dev = getattr(props, "pci_domain_id", 0), getattr(props, "pci_device_id", 0)
        key = f"{dom:08x}:{bus:02x}:{dev:02x}.0".encode()
        fn = getattr(lib, "nvmlDeviceGetHandleByPciBusId_v2", None)
        if fn is not None and fn(key, ctypes.byref(handle)) == NVML_SUCCESS:
            return handle
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        fn = getattr(lib, "nvmlDeviceGetHandleByIndex_v2", None)
        if fn is not None and fn(ctypes.c_uint(index), ctypes.byref(handle)) == NVML_SUCCESS:
            return handle
    return None


def load_nvml(device: torch.device, loader=ctypes.CDLL) -> Nvml | None:
    """NVML on `device`, or None (a CPU, no library, no handle)."""
    if device.type != "cuda":
        return None
    try:
        lib = loader(NVML_LIBRARY)
    except OSError:
        return None
    init = getattr(lib, "nvmlInit_v2", None) or getattr(lib, "nvmlInit", None)
    if init is None or init() != NVML_SUCCESS:
        return None
    handle = _handle(lib, device)
    return Nvml(lib, handle) if handle is not None else None


class ClockMonitor:
    """`start()` before a trial, `stop()` after it: the trial's ClockSample."""

    def __init__(self, nvml: Nvml, clock=None):
        self.nvml = nvml
        self.clock = clock or time.perf_counter
        self._energy: int | None = None
        self._power_ns: int | None = None
        self._thermal_ns: int | None = None
        self._t0 = 0.0

    def start(self) -> None:
        self._energy = self.nvml.energy_mj()
        self._power_ns = self.nvml.violation_ns(NVML_PERF_POLICY_POWER)
        self._thermal_ns = self.nvml.violation_ns(NVML_PERF_POLICY_THERMAL)
        self._t0 = self.clock()

    def stop(self) -> ClockSample:
        seconds = self.clock() - self._t0
        energy = self.nvml.energy_mj()
        if energy is not None and self._energy is not None and seconds > 0:
            power = (energy - self._energy) / 1e3 / seconds
        else:
            mw = self.nvml.power_mw()
            power = mw / 1e3 if mw is not None else None
        bits = self.nvml.reason_bits()
        return ClockSample(
            sm_mhz=self.nvml.sm_mhz(),
            power_w=power,
            temperature_c=self.nvml.temperature_c(),
            reasons=[name for bit, name in REASONS.items() if bits is not None and bits & bit],
            power_violation_s=_delta_s(self._power_ns, self.nvml.violation_ns(NVML_PERF_POLICY_POWER)),
            thermal_violation_s=_delta_s(self._thermal_ns, self.nvml.violation_ns(NVML_PERF_POLICY_THERMAL)),
            reason_bits=bits,
        )


def _delta_s(before: int | None, after: int | None) -> float | None:
    return (after - before) / 1e9 if before is not None and after is not None else None


_LOADED: dict[str, Nvml | None] = {}  # by device: NVML is loaded and initialised once a process


def monitor_for(device: torch.device) -> ClockMonitor | None:
    """A ClockMonitor on `device`, or None (a CPU, or no NVML)."""
    if device.type != "cuda":
        return None
    key = str(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))
    if key not in _LOADED:
        _LOADED[key] = load_nvml(device)
    nvml = _LOADED[key]
    return ClockMonitor(nvml) if nvml is not None else None


def throttle_warning(samples: list[ClockSample]) -> str:
    """'' where no trial throttled; else the one warning line."""
    hit = [s for s in samples if s.throttled]
    if not hit:
        return ""
    reasons = sorted({r for s in hit for r in s.reasons if r in _THROTTLE_NAMES})
    held = sum((s.power_violation_s or 0) + (s.thermal_violation_s or 0) for s in hit)
    clocks = [s.sm_mhz for s in samples if s.sm_mhz is not None]
    parts = [", ".join(reasons)] if reasons else []
    if held > 0:
        parts.append(f"held back {held:.3g} s by the power or thermal policy")
    if clocks:
        parts.append(f"SM clock {min(clocks)}-{max(clocks)} MHz over the run")
    detail = f" ({'; '.join(parts)})" if parts else ""
    return (
        f"WARNING: the GPU throttled in {len(hit)} of {len(samples)} trials{detail}: the variants timed "
        "then ran at lower clocks, and their medians may be slower for it"
    )


_THROTTLE_NAMES = {name for bit, name in REASONS.items() if bit & THROTTLE_BITS}
