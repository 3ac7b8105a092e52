"""Pipelines: the text-to-video generator."""
from fastwan.pipelines.generator import GenerationResult, VideoGenerator

__all__ = ["GenerationResult", "VideoGenerator"]
