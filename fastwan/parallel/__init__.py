"""Several processes, one video: Ulysses sequence parallelism (:mod:`fastwan.parallel.ulysses`) and ring attention
for the rest of a Ulysses x Ring split (:mod:`fastwan.parallel.ring`), the CFG x sequence layout of the ranks
(:mod:`fastwan.parallel.mesh`), joining a launcher's job or starting worker processes
(:mod:`fastwan.parallel.launch`, :mod:`fastwan.parallel.workers`)."""
from fastwan.parallel.ulysses import SequenceParallel, UlyssesDispatch, shard_sizes

__all__ = ["SequenceParallel", "UlyssesDispatch", "shard_sizes"]
