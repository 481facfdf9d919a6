"""What recording costs a training run: ``python -m m2po_oracle.bench.capture_overhead [DIR]``.

Times a recorded step of a 256 x 4096 float32 micro-batch (validation, CPU copies, the
safetensors file, its CRC-32, the manifest), its gradient capture beyond the backward itself,
a skipped step's ``record`` and ``watch_gradient`` calls, and the manifest rewrite at 10 to
1,000 records, and prints them as JSON (figures with their machine: internals "Performance").
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from m2po_oracle.capture.recorder import Recorder, record_name


def measure(directory: str | None = None, rows: int = 256, columns: int = 4096, steps: int = 20) -> dict[str, float]:
    torch.manual_seed(0)
    logp = torch.randn(rows, columns, requires_grad=True)
    behavior = torch.randn(rows, columns)
    advantages = torch.randn(rows, columns)
    mask = torch.rand(rows, columns) < 0.9
    keep = mask & (torch.rand(rows, columns) < 0.95)
    metrics = {"m2_before": 0.1, "m2_after": 0.04, "masked_fraction": 0.05, "valid_count": int(mask.sum())}
    with tempfile.TemporaryDirectory(dir=directory) as tmp:
        recorder = Recorder(tmp, rank=0, world_size=1, topology="dp=1", every=2)
        recorded, grads, plain = [], [], []
        for _ in range(5):  # the same backward without a watch, to subtract
            loss = (logp * advantages).mean()
            start = time.perf_counter()
            loss.backward()
            plain.append(time.perf_counter() - start)
            logp.grad = None
        base = logp.detach()
        for index in range(steps):
            step = 2 * index
            logp = base.clone().requires_grad_()  # a fresh forward's logp, as in training
            loss = (logp * advantages).mean()
            start = time.perf_counter()
            recorder.record(
                step=step,
                micro_batch=0,
                logp=logp,
                behavior_logp=behavior,
                advantages=advantages,
                mask=mask,
                keep=keep,
                loss=0.5,
                tau=0.04,
                metrics=metrics,
            )
            recorder.watch_gradient(logp)
            recorded.append(time.perf_counter() - start)
            start = time.perf_counter()
            loss.backward()
            grads.append(time.perf_counter() - start)
            logp.grad = None
        calls = 200_000
        start = time.perf_counter()
        for _ in range(calls):
            recorder.record(
                step=1,
                micro_batch=0,
                logp=logp,
                behavior_logp=behavior,
                advantages=advantages,
                mask=mask,
                keep=keep,
                loss=0.5,
                tau=0.04,
                metrics=metrics,
            )
        skipped = (time.perf_counter() - start) / calls
        start = time.perf_counter()
        for _ in range(calls):
            recorder.watch_gradient(logp)
        skipped_watch = (time.perf_counter() - start) / calls
        # The manifest rewrite alone, at sizes a long run reaches: tiny records, then one rewrite timed.
        manifest_ms = {}
        for count in (10, 100, 1000):
            many = Recorder(Path(tmp) / f"manifest-{count}", rank=0, world_size=1, topology="dp=1")
            one, flag = torch.zeros(1, 1), torch.ones(1, 1, dtype=torch.bool)
            for i in range(count):
                many.record(
                    step=i,
                    micro_batch=0,
                    logp=one,
                    behavior_logp=one,
                    advantages=one,
                    mask=flag,
                    keep=flag,
                    loss=0.5,
                    tau=0.04,
                    metrics=metrics,
                )
            start = time.perf_counter()
            for _ in range(5):
                many.write_manifest()
            manifest_ms[count] = (time.perf_counter() - start) / 5 * 1e3
        size = (Path(tmp) / record_name(0, 0, 0)).stat().st_size
    figures = {
        "record_median_ms": statistics.median(recorded) * 1e3,
        "record_min_ms": min(recorded) * 1e3,
        "record_max_ms": max(recorded) * 1e3,
        "gradient_capture_median_ms": (statistics.median(grads) - statistics.median(plain)) * 1e3,
        "skipped_record_us": skipped * 1e6,
        "skipped_watch_gradient_us": skipped_watch * 1e6,
        "record_file_mb": size / 1e6,
        **{f"manifest_rewrite_ms_at_{count}_records": ms for count, ms in manifest_ms.items()},
    }
    print(json.dumps({"tokens": rows * columns, "torch": torch.__version__, "python": sys.version.split()[0], **figures}, indent=1))
    return figures


if __name__ == "__main__":
    import sys

    measure(sys.argv[1] if len(sys.argv) > 1 else None)
