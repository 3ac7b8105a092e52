"""Several processes, one video: sequence parallelism (:mod:`fastwan.parallel.ulysses`)."""
from fastwan.parallel.ulysses import SequenceParallel, UlyssesDispatch, shard_sizes

__all__ = ["SequenceParallel", "UlyssesDispatch", "shard_sizes"]
