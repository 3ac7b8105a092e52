"""``GET /metrics``: the server's state in Prometheus' text format (version 0.0.4).

Metrics: ``fastwan_queue_depth`` (videos waiting), ``fastwan_videos{status}`` (videos in the store by status),
``fastwan_steps_total`` (denoising steps run since the start), ``fastwan_step_seconds`` (the last step's duration,
measured between two steps of one video), ``fastwan_model_ready`` (1 once the model is loaded and the worker runs)
and, on CUDA, ``fastwan_gpu_memory_bytes`` (allocated on the model's device).
"""
from __future__ import annotations

STATUSES = ("queued", "in_progress", "completed", "failed")
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def _metric(name: str, kind: str, help: str, samples: list[tuple[str, float]]) -> list[str]:
    """One metric's lines; a whole number is written whole (byte counts keep every digit)."""
    values = (str(v) if isinstance(v, int) else repr(float(v)) for _, v in samples)
    return [f"# HELP {name} {help}", f"# TYPE {name} {kind}",
            *(f"{name}{labels} {value}" for (labels, _), value in zip(samples, values))]


def render(counts: dict[str, int], worker) -> str:
    """The exposition text: ``counts`` (videos by status, from the store) and ``worker``'s step figures."""
    lines = _metric("fastwan_queue_depth", "gauge", "Videos waiting in the queue.", [("", counts.get("queued", 0))])
    lines += _metric("fastwan_videos", "gauge", "Videos in the store by status.",
                     [(f'{{status="{s}"}}', counts.get(s, 0)) for s in STATUSES])
    lines += _metric("fastwan_steps_total", "counter", "Denoising steps run since the server started.",
                     [("", worker.steps_total)])
    if worker.step_seconds is not None:
        lines += _metric("fastwan_step_seconds", "gauge", "Seconds of the last denoising step.",
                         [("", worker.step_seconds)])
    lines += _metric("fastwan_model_ready", "gauge", "1 once the model is loaded and the worker runs.",
                     [("", 1 if worker.ready() else 0)])
    gen = worker.gen
    if gen is not None and gen.device.type == "cuda":
        import torch

        lines += _metric("fastwan_gpu_memory_bytes", "gauge", "GPU memory allocated on the model's device.",
                         [("", torch.cuda.memory_allocated(gen.device))])
    return "\n".join(lines) + "\n"
