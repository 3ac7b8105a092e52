"""Third-party output that fastwan's commands turn off at its source, so that a run prints fastwan's own lines only.

Rules: :func:`quiet_libraries` switches off, for the whole process, the progress bars of transformers, diffusers and
huggingface_hub (writing a tiny checkpoint's shards, loading weights, fetching a Hub snapshot: fastwan draws its own
bars for the steps it runs) and drops one transformers notice: that an image processor falls back to its PIL
version because torchvision is not installed (the PIL version is the one fastwan's image-to-video input was
written against). It uses the libraries' own switches and a logging filter on the one logger that says it, never a
redirect of stderr: every other warning still shows. The ``fastwan`` commands and the worker processes of
``num_gpus=N`` call it; a Python caller of the API keeps the libraries' settings it chose.
"""
from __future__ import annotations

import logging

TORCHVISION_FALLBACK = "requires torchvision (not installed); falling back to"  # the notice's own words
TORCHVISION_LOGGER = "transformers.utils.import_utils"  # the logger that says it


class _DropTorchvisionFallback(logging.Filter):
    """Drops transformers' notice that an image processor falls back to PIL without torchvision."""

    def filter(self, record: logging.LogRecord) -> bool:
        return TORCHVISION_FALLBACK not in record.getMessage()


DROP_TORCHVISION_FALLBACK = _DropTorchvisionFallback()  # one instance: a second call finds it on the logger


def quiet_libraries() -> None:
    """Turn off third-party progress bars and transformers' torchvision-fallback notice for this process (see the
    module docstring); calling it again changes nothing."""
    import diffusers.utils.logging as diffusers_logging
    import huggingface_hub.utils as hub_utils
    import transformers.utils.logging as transformers_logging

    hub_utils.disable_progress_bars()
    transformers_logging.disable_progress_bar()
    diffusers_logging.disable_progress_bar()
    logger = logging.getLogger(TORCHVISION_LOGGER)
    if DROP_TORCHVISION_FALLBACK not in logger.filters:
        logger.addFilter(DROP_TORCHVISION_FALLBACK)
