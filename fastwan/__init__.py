"""fastwan: fast Wan2.1/Wan2.2 text-to-video diffusion."""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["VideoGenerator", "GenerationResult", "GenerationRequest", "LoadOptions", "__version__"]


def __getattr__(name):  # lazy: `import fastwan` stays cheap (the CLI and `fastwan env` import it)
    if name in ("VideoGenerator", "GenerationResult"):
        from fastwan.pipelines import generator

        return getattr(generator, name)
    if name == "GenerationRequest":
        from fastwan.pipelines.params import GenerationRequest

        return GenerationRequest
    if name == "LoadOptions":
        from fastwan.pipelines.load_options import LoadOptions

        return LoadOptions
    raise AttributeError(f"module 'fastwan' has no attribute {name!r}")
