"""Which host-time measurement can be trusted on a long step? Every candidate on three synthetic
steps of 3,000 launches each, whose host and device times are known by construction.

    PYTHONPATH=src python benchmarks/host_time_probe.py --out results/host-probe    # CUDA, < 60 s

The steps (each `--launches` in-place adds on one tensor):
    host      256 elements: each kernel ~2 us, each launch ~5 us: host-bound, the queue never fills
    device    `--big` elements (16M fp32, 128 MB a kernel): ~30 us a kernel on an H200:
              device-bound, and held or not the launch queue (~1,000 deep) fills
    busy      `device` with `--busy-us` (20 us) of the CPU's own work before each launch: the host
              time is at least launches x busy-us by construction (60 ms), under the device's

The candidates, for each step:
    wall_after_sync   the call's wall time from an idle GPU (the GPU runs behind the CPU)
    wall_queued       its wall time right after another call of it: the harness's old host rounds,
                      which read 222 ms of host for the 196 ms Llama-3.2-1B eager step
    held              bench.host.measure_host: issued while a sleep kernel holds the GPU; exact
                      where the hold outlived the issue, else a lower bound from the trace
    thread_time       the issuing thread's CPU time (time.thread_time) during a held issue:
                      exact if the driver sleeps while the queue is full, the wall time if it spins
    trace             one held issue under torch.profiler (CUDA activity only): the CPU's time
                      outside CUDA calls (at least) and the window less each call's excess (estimate)
    loop              wall time per call over 10 back-to-back calls after a discarded one: ~max(H, D)
    device            CUDA events around 10 calls with the CPU ahead: the device time D
and the launch queue's depth (launches into a held GPU before one blocks).

What to look for: `held` (or its trace's at_least) at or under the true host time on every step,
at least launches x busy-us on `busy`, and never near the device time on `device`; `wall_queued`
over the step's device time shows the old inflation. Writes host_time_probe.json under --out.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from profuse.bench.host import host_from_trace, measure_host
from profuse.timers import HeldIssue

ROUNDS = 5


def make_step(x: torch.Tensor, launches: int, busy_s: float):
    def step():
        for _ in range(launches):
            if busy_s:
                end = time.perf_counter() + busy_s
                while time.perf_counter() < end:
                    pass
            x.add_(1.0)

    return step


def wall_after_sync(fn, dev) -> float:
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize(dev)
    return t


def wall_queued(fn, dev) -> float:
    torch.cuda.synchronize(dev)
    fn()  # its kernels are still queued when the timed call starts
    t0 = time.perf_counter()
    fn()
    t = time.perf_counter() - t0
    torch.cuda.synchronize(dev)
    return t


def thread_time_held(fn, held: HeldIssue, hold_s: float) -> tuple[float, float, bool]:
    """(wall, thread CPU time, filled) of one held issue."""
    torch.cuda.synchronize(held.device)
    torch.cuda._sleep(int(hold_s * held.cycles_per_s))
    released = torch.cuda.Event()
    released.record()
    w0, c0 = time.perf_counter(), time.thread_time()
    fn()
    w1, c1 = time.perf_counter(), time.thread_time()
    filled = released.query()
    torch.cuda.synchronize(held.device)
    return w1 - w0, c1 - c0, bool(filled)


def loop_per_call(fn, dev, calls: int = 10) -> float:
    torch.cuda.synchronize(dev)
    fn()  # discarded: the queue fills as a loop's does
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize(dev)
    return (time.perf_counter() - t0) / calls


def device_per_call(fn, held: HeldIssue, calls: int = 10) -> float:
    torch.cuda.synchronize(held.device)
    torch.cuda._sleep(int(0.05 * held.cycles_per_s))  # the CPU gets ahead
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(calls):
        fn()
    end.record()
    torch.cuda.synchronize(held.device)
    return start.elapsed_time(end) / 1e3 / calls


def queue_depth(dev, held: HeldIssue, limit: int = 5000) -> int | None:
    """Launches a held GPU takes before one blocks (a launch over 200 us)."""
    x = torch.zeros(1, device=dev)
    torch.cuda.synchronize(dev)
    torch.cuda._sleep(int(2.0 * held.cycles_per_s))
    found = None
    for i in range(limit):
        t0 = time.perf_counter()
        x.add_(1.0)
        if time.perf_counter() - t0 > 200e-6 and i > 10:
            found = i
            break
    torch.cuda.synchronize(dev)
    return found


def med(xs):
    return statistics.median(xs) if xs else None


def probe(name: str, fn, dev, held: HeldIssue, floor_s: float) -> dict:
    for _ in range(2):  # warm-up
        fn()
    torch.cuda.synchronize(dev)
    out: dict = {"floor_s": floor_s}
    out["wall_after_sync_s"] = med([wall_after_sync(fn, dev) for _ in range(ROUNDS)])
    out["wall_queued_s"] = med([wall_queued(fn, dev) for _ in range(ROUNDS)])
    host = measure_host({name: fn}, held, ROUNDS, seed=0)[name]
    out["held"] = host.to_dict()
    tt = [thread_time_held(fn, held, 1.0) for _ in range(3)]
    out["thread_time"] = {"wall_s": med([a for a, _, _ in tt]), "cpu_s": med([b for _, b, _ in tt]),
                          "filled": [f for _, _, f in tt]}  # fmt: skip
    events = held.traced_issue(fn, 0.05)
    tr = host_from_trace(events) if events else None
    out["trace"] = tr.to_dict() if tr else None
    out["loop_s"] = med([loop_per_call(fn, dev) for _ in range(3)])
    out["device_s"] = med([device_per_call(fn, held) for _ in range(3)])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="folder for host_time_probe.json")
    parser.add_argument("--launches", type=int, default=3000, help="kernels a step")
    parser.add_argument("--big", type=int, default=16 * 2**20, help="elements of the device step's tensor")
    parser.add_argument("--busy-us", type=float, default=20.0, help="CPU work before each launch (busy step)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("host_time_probe.py needs a CUDA GPU")
    dev = torch.device("cuda")
    held = HeldIssue(dev)
    if not held.available:
        raise SystemExit("this torch has no torch.cuda._sleep: nothing to hold the GPU with")
    small = torch.zeros(256, device=dev)
    big = torch.zeros(args.big, device=dev)
    busy_s = args.busy_us * 1e-6
    t_start = time.perf_counter()
    result = {
        "device": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "launches": args.launches,
        "queue_depth": queue_depth(dev, held),
        "steps": {},
    }
    steps = {
        "host": (make_step(small, args.launches, 0.0), 0.0),
        "device": (make_step(big, args.launches, 0.0), 0.0),
        "busy": (make_step(big, args.launches, busy_s), args.launches * busy_s),
    }
    for name, (fn, floor) in steps.items():
        result["steps"][name] = probe(name, fn, dev, held, floor)
    result["seconds"] = time.perf_counter() - t_start
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "host_time_probe.json").write_text(json.dumps(result, indent=2))
    ms = lambda s: f"{s * 1e3:8.2f}" if s is not None else "       -"
    print(f"{result['device']}, torch {result['torch']}; launch queue depth {result['queue_depth']}")
    print(f"{'step':>7} {'floor':>8} {'after':>8} {'queued':>8} {'held':>8} {'lower?':>6} {'thread':>8} "
          f"{'tr.least':>8} {'tr.est':>8} {'loop':>8} {'device':>8}   (ms)")  # fmt: skip
    for name, r in result["steps"].items():
        tr = r["trace"] or {}
        print(
            f"{name:>7} {ms(r['floor_s'] or None)} {ms(r['wall_after_sync_s'])} {ms(r['wall_queued_s'])} "
            f"{ms(r['held']['host_s'])} {str(r['held']['lower_bound']):>6} {ms(r['thread_time']['cpu_s'])} "
            f"{ms(tr.get('at_least_s'))} {ms(tr.get('estimate_s'))} {ms(r['loop_s'])} {ms(r['device_s'])}"
        )
    print(f"{result['seconds']:.1f} s; {out / 'host_time_probe.json'}")


if __name__ == "__main__":
    main()
