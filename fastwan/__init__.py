"""fastwan: fast Wan2.1/Wan2.2 text-to-video diffusion."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["VideoGenerator", "GenerationResult", "__version__"]


def __getattr__(name):  # lazy: `import fastwan` stays cheap (the CLI and `fastwan env` import it)
    if name in ("VideoGenerator", "GenerationResult"):
        from fastwan.pipelines import generator

        return getattr(generator, name)
    raise AttributeError(f"module 'fastwan' has no attribute {name!r}")
