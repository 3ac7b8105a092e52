"""``GET /metrics``: the server's state in Prometheus' text format (version 0.0.4).

Metrics: ``fastwan_queue_depth`` (videos waiting), ``fastwan_videos{status}`` (videos in the store by status),
``fastwan_steps_total`` (denoising steps run since the start, by this process's workers),
``fastwan_step_seconds{device}`` (each worker's last step, measured between two steps of one video),
``fastwan_model_ready`` (1 once every worker here has loaded its model) and, on CUDA,
``fastwan_gpu_memory_bytes{device}`` (allocated on each worker's device).
"""
from __future__ import annotations

STATUSES = ("queued", "in_progress", "completed", "failed")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    """One metric's lines; a whole number is written whole (byte counts keep every digit)."""
    values = (str(v) if isinstance(v, int) else repr(float(v)) for _, v in samples)
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}",
            *(f"{name}{labels} {value}" for (labels, _), value in zip(samples, values))]


def render(counts: dict[str, int], workers: list) -> str:
    """The exposition text: ``counts`` (videos by status, from the store) and this process's ``workers``' step
    figures (none with ``--role api``), each labelled with its device."""
    lines = _metric("fastwan_queue_depth", "gauge", "Videos waiting in the queue.", [("", counts.get("queued", 0))])
    lines += _metric("fastwan_videos", "gauge", "Videos in the store by status.",
                     [(f'{{status="{s}"}}', counts.get(s, 0)) for s in STATUSES])
    lines += _metric("fastwan_steps_total", "counter", "Denoising steps run since the server started.",
                     [("", sum(w.steps_total for w in workers))])
    devices = [(w, f'{{device="{w.gen.device if w.gen is not None else w.options.device}"}}') for w in workers]
    timed = [(label, w.step_seconds) for w, label in devices if w.step_seconds is not None]
    if timed:
        lines += _metric("fastwan_step_seconds", "gauge", "Seconds of the last denoising step.", timed)
    lines += _metric("fastwan_model_ready", "gauge", "1 once every worker here has loaded its model and runs.",
                     [("", 1 if workers and all(w.ready() for w in workers) else 0)])
    cuda = [(label, w.gen.device) for w, label in devices if w.gen is not None and w.gen.device.type == "cuda"]
    if cuda:
        import torch

        lines += _metric("fastwan_gpu_memory_bytes", "gauge", "GPU memory allocated on a worker's device.",
                         [(label, torch.cuda.memory_allocated(device)) for label, device in cuda])
    return "\n".join(lines) + "\n"
