"""The lab's torch-only GPU paths on a real GPU: the probe's peaks, precision choice's shape rates,
NVML energy, CUDA-event phase timing and pinned host<->device copies.

Made for a machine with torch and CUDA but without TorchRec/fbgemm-gpu (the lab's device machine):
it imports only the modules these paths live in, so it runs where the full CLI cannot. What needs
fbgemm (the probe's embedding gather, the model, serving instances) is named in `left_out`.

    PYTHONPATH=. python3 benchmarks/gpu_paths.py --out $OUT/gpu_paths.json

Checks (each one line, PASS/FAIL, and the script exits non-zero on any FAIL):
- every GEMM precision rates > 0, and bf16 beats fp32 on the GPU;
- precision choice's shape rates on the kaggle GEMM shapes at served batch sizes;
- NVML's energy counter integrates a GEMM burn: energy > 0 J, mean power within the board's limit,
  and J per TFLOP printed;
- CUDA-event phases of a step sum to its host wall time (synchronised) within 5%;
- the probe's bf16 peak is at least 0.9 of the rate the energy burn sustains at n=8192;
- pinned copies beat pageable ones host->device.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import header, results_path, write_results  # noqa: E402

from dlrm_lab.config import load_any_preset  # noqa: E402
from dlrm_lab.metrics import device_peaks  # noqa: E402
from dlrm_lab.metrics.energy import EnergySampler  # noqa: E402
from dlrm_lab.metrics.precision import measure_shape_rates, model_gemm_shapes  # noqa: E402
from dlrm_lab.metrics.sensors import open_power_sources  # noqa: E402

CHECKS: list[tuple[str, bool, str]] = []


def check(name: str, ok: bool, detail: str) -> None:
    CHECKS.append((name, ok, detail))
    print(f"{'PASS' if ok else 'FAIL'} {name}: {detail}", flush=True)


def step_timer_class() -> Any:
    # train/timing.py itself; the train package's __init__ imports TorchRec
    path = Path(__file__).resolve().parents[1] / "dlrm_lab" / "train" / "timing.py"
    spec = importlib.util.spec_from_file_location("dlrm_lab_timing", path)
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module.StepTimer


def peaks(device: torch.device, quick: bool) -> dict[str, Any]:
    """What `dlrm-lab machine probe` measures of a GPU, less the embedding gather (fbgemm)."""
    sizes = device_peaks.ProbeSizes.preset(quick)
    out: dict[str, Any] = {"gemm_flops_per_s": {}, "gemm_size": {}, "gemm_spread": {}}
    for name, dtype in {**dict(device_peaks.GEMM_DTYPES), "tf32": torch.float32}.items():
        torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
        gemm = device_peaks.gemm_flops_per_s(device, dtype, sizes.gpu_gemm_sizes, sizes.repeats, sizes.gemm_min_flops)
        out["gemm_flops_per_s"][name] = gemm["flops_per_s"]
        out["gemm_size"][name] = gemm["size"]
        out["gemm_spread"][name] = gemm["spread"]
        print(f"  GEMM {name}: {gemm['flops_per_s'] / 1e12:,.1f} TFLOP/s (n={gemm['size']})", flush=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    out["memory_bytes_per_s"] = device_peaks.copy_bytes_per_s(device, sizes.copy_bytes, sizes.repeats)
    out.update(device_peaks.host_device_bytes_per_s(device, sizes.copy_bytes // 4, sizes.repeats))
    rates = out["gemm_flops_per_s"]
    check("gemm peaks", all(v > 0 for v in rates.values()) and rates["bf16"] > rates["fp32"],
          ", ".join(f"{k} {v / 1e12:,.1f}" for k, v in rates.items()) + " TFLOP/s")  # fmt: skip
    return out


def shape_rates(device: torch.device) -> dict[str, Any]:
    spec = load_any_preset("kaggle")
    out = {}
    for rows in (100, 400, 2048):
        rates = measure_shape_rates(model_gemm_shapes(spec, rows), ["fp32", "bf16", "fp16"], device, 1)
        out[str(rows)] = rates
        print(f"  kaggle shapes at {rows} rows: " + ", ".join(f"{k} {v / 1e9:,.0f}" for k, v in rates.items())
              + " GFLOP/s", flush=True)  # fmt: skip
    check("shape rates", all(v > 0 for r in out.values() for v in r.values()), f"{len(out)} batch sizes")
    return out


def energy(device: torch.device, seconds: float) -> dict[str, Any]:
    sources, missing = open_power_sources("cuda", nvml_devices=[device.index or 0], packages=False)  # the GPU alone
    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    torch.mm(a, b)
    torch.cuda.synchronize(device)
    sampler = EnergySampler(sources, unavailable=missing, host=True, interval_s=0.05)
    products = 0
    with sampler:
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            for _ in range(20):
                torch.mm(a, b)
            products += 20
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - t0
    summary = sampler.summary()
    tflop = products * 2 * n**3 / 1e12
    limit_w = None
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        limit_w = pynvml.nvmlDeviceGetEnforcedPowerLimit(handle) / 1e3
        pynvml.nvmlShutdown()
    except Exception as e:  # the limit is context for the check, not the check itself
        print(f"  (power limit unreadable: {e})")
    gpu_j = summary.get("energy_j")
    power = gpu_j / wall if gpu_j else None
    detail = f"no energy: {summary}"
    if gpu_j:
        detail = (f"{gpu_j:,.0f} J over {wall:.1f} s ({power:,.0f} W mean, limit {limit_w} W), "
                  f"{gpu_j / tflop:.3f} J/TFLOP at {tflop / wall:,.0f} TFLOP/s")  # fmt: skip
    check("nvml energy", bool(gpu_j) and (limit_w is None or 0 < power <= 1.1 * limit_w), detail)
    return {"summary": summary, "wall_s": wall, "tflop": tflop, "power_limit_w": limit_w}


def event_timing(device: torch.device) -> dict[str, Any]:
    StepTimer = step_timer_class()
    timer = StepTimer(device)
    x = torch.randn(4096, 4096, device=device)
    w = torch.randn(4096, 4096, device=device)
    for _ in range(3):
        x @ w
    torch.cuda.synchronize(device)
    ratios = []
    phases_seen: dict[str, float] = {}
    for _ in range(5):
        t0 = time.perf_counter()
        timer.start()
        for _ in range(4):
            x @ w
        timer.mark("dense_forward")
        for _ in range(8):
            x @ w
        timer.mark("backward")
        phases = timer.phases_ms()  # waits for the step's last event
        wall_ms = (time.perf_counter() - t0) * 1e3
        ratios.append(sum(phases.values()) / wall_ms)
        phases_seen = phases
    ratio = statistics.median(ratios)
    fwd, bwd = phases_seen["dense_forward"], phases_seen["backward"]
    check("cuda-event phases", 0.95 <= ratio <= 1.0 + 1e-6 and 1.6 <= bwd / fwd <= 2.4,
          f"phases sum to {ratio:.3f} of host wall; backward/forward {bwd / fwd:.2f} (8 vs 4 products)")  # fmt: skip
    return {"sum_over_wall": ratios, "last_phases_ms": phases_seen}


def pinned(device: torch.device) -> dict[str, Any]:
    nbytes = 256 << 20
    pageable = torch.empty(nbytes // 4)
    pinned_host = pageable.pin_memory()
    dev = torch.empty(nbytes // 4, device=device)
    rate = {}
    for name, host in (("pageable", pageable), ("pinned", pinned_host)):
        seconds = device_peaks.timed(lambda h=host: dev.copy_(h, non_blocking=True), 5, device)
        rate[name] = nbytes / seconds
    check("pinned h2d", rate["pinned"] > rate["pageable"],
          f"pinned {rate['pinned'] / 1e9:,.1f} GB/s, pageable {rate['pageable'] / 1e9:,.1f} GB/s")  # fmt: skip
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--quick", action="store_true", help="the quick probe's sizes")
    parser.add_argument("--energy-seconds", type=float, default=5.0)
    opts = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit(f"gpu_paths: no CUDA device is visible to this torch build (torch {torch.__version__})")
    device = torch.device("cuda", 0)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,power.limit",
                          "--format=csv,noheader"], capture_output=True, text=True)  # fmt: skip
    left_out = ["probe's embedding gather (fbgemm TBE)", "model and serving instances (TorchRec)"]
    results = header(gpu=torch.cuda.get_device_name(device), nvidia_smi=smi.stdout.strip(), torch=torch.__version__,
                     left_out=left_out)  # fmt: skip
    print(f"{results['gpu']} | torch {torch.__version__} | {results['nvidia_smi']}", flush=True)
    results["peaks"] = peaks(device, opts.quick)
    results["shape_rates"] = shape_rates(device)
    results["energy"] = energy(device, opts.energy_seconds)
    burn = results["energy"]["tflop"] * 1e12 / results["energy"]["wall_s"]
    peak = results["peaks"]["gemm_flops_per_s"]["bf16"]
    check("probe's bf16 peak", peak >= 0.9 * burn,
          f"{peak / 1e12:,.0f} TFLOP/s against {burn / 1e12:,.0f} sustained by the energy burn (n=8192)")  # fmt: skip
    results["event_timing"] = event_timing(device)
    results["pinned"] = pinned(device)
    results["checks"] = [{"name": n, "ok": ok, "detail": d} for n, ok, d in CHECKS]
    write_results(results_path("gpu_paths", opts.out), results)
    if not all(ok for _, ok, _ in CHECKS):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
