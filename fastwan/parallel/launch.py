"""Starting a parallel generator: ``VideoGenerator.from_pretrained(..., num_gpus=N, cfg_parallel=...)``.

* Inside a launcher's processes (torchrun sets ``WORLD_SIZE``; or ``torch.distributed`` already initialised), each
  process is one rank: :func:`join` initialises the process group if needed (NCCL on CUDA, gloo on the CPU), picks
  the rank's GPU (``LOCAL_RANK``) and builds the :class:`~fastwan.parallel.mesh.Mesh`.
* Otherwise :class:`~fastwan.parallel.workers.ParallelGenerator` starts N worker processes itself, each of which
  joins as above.

Rules: N must equal the launcher's world size; a CUDA run needs N visible GPUs, and each rank takes its own: the
device is ``"cuda"`` without an index (a launcher's rank may name its own, ``cuda:LOCAL_RANK``); NVLink multicast is
switched off (:func:`fastwan.envs.disable_multicast`) in every process before its process group starts.
"""
from __future__ import annotations

import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from fastwan import envs
from fastwan.errors import InvalidArgument
from fastwan.parallel.mesh import Mesh, check_parallel_request, check_ring_degree, degrees, sequence_layout
from fastwan.parallel.ring import check_ring_backend

logger = logging.getLogger("fastwan")
TIMEOUT = timedelta(minutes=30)  # a collective waiting longer than this ends the job (one 14B 720p step: ~20 s)


def mode(num_gpus, cfg_parallel, ring_degree=None) -> str:
    """"single" (one process), "join" (this process is a rank of a launcher's job) or "spawn" (start workers).
    A ``ring_degree`` other than None or 1 needs the processes it splits."""
    ring_degree = check_ring_degree(ring_degree)
    if num_gpus is None and cfg_parallel is False:
        if ring_degree not in (None, 1):
            raise InvalidArgument(f"ring_degree={ring_degree} splits the sequence over {ring_degree} or more "
                                  "processes, but num_gpus is not given (one process); give num_gpus (a multiple "
                                  "of the ring degree), or leave ring_degree unset.")
        return "single"
    sp, cfg = degrees(num_gpus, cfg_parallel)
    launched = envs.torchrun_env()
    if dist.is_initialized() or launched is not None:
        world = dist.get_world_size() if dist.is_initialized() else launched[2]
        if world != sp * cfg:
            raise InvalidArgument(f"num_gpus={num_gpus} but this job was launched with {world} processes "
                                  f"(WORLD_SIZE); give num_gpus={world}, or launch {num_gpus} processes.")
        return "join"
    if sp * cfg == 1:
        return "single"
    from fastwan.parallel.workers import refuse_while_importing_main

    refuse_while_importing_main(sp * cfg)  # a worker re-importing a script that starts workers unguarded
    return "spawn"


def check_devices(num_gpus: int, device: torch.device) -> None:
    """A CUDA run needs ``num_gpus`` visible GPUs (one per rank)."""
    if device.type == "cuda" and torch.cuda.device_count() < num_gpus:
        raise InvalidArgument(f"num_gpus={num_gpus} needs {num_gpus} GPUs, but {torch.cuda.device_count()} are "
                              "visible (CUDA_VISIBLE_DEVICES); use fewer, or device='cpu' for gloo processes.")


def check_device_index(num_gpus: int, device: torch.device) -> None:
    """Each rank runs on its own GPU: workers started here on GPUs 0..N-1 of the visible ones, a launcher's rank
    on ``LOCAL_RANK``'s. A device index that says otherwise is refused rather than ignored (workers) or shared by
    every rank (a launcher's job, where NCCL refuses two ranks on one GPU only at the first collective)."""
    if device.type != "cuda" or device.index is None:
        return
    launched = envs.torchrun_env()
    if launched is None and dist.is_initialized():
        return  # a worker of this module (cuda:rank), or a job the caller initialised and placed itself
    if launched is None:
        raise InvalidArgument(f"device={str(device)!r} with num_gpus={num_gpus}: the {num_gpus} processes take "
                              f"GPUs 0..{num_gpus - 1} of the visible ones, one each; pass device='cuda' and pick "
                              "the GPUs with CUDA_VISIBLE_DEVICES.")
    if device.index != launched[1]:
        raise InvalidArgument(f"device={str(device)!r}, but this process is LOCAL_RANK={launched[1]} of a launched "
                              f"job, whose GPU is cuda:{launched[1]} (each rank its own); pass device='cuda'.")


def check(ckpt, num_gpus: int, cfg_parallel: bool, cache, device: torch.device, ring_degree=None) -> int:
    """Every check of a parallel generator that needs the checkpoint (its heads), the default step cache and the
    device, before any process starts or joins -> the ring degree."""
    ring = check_parallel_request(ckpt.transformer_config.num_attention_heads, num_gpus, cfg_parallel, cache,
                                  ring_degree)
    check_devices(num_gpus, device)
    check_device_index(num_gpus, device)
    return ring


def ring_of(ckpt, num_gpus, cfg_parallel, ring_degree, attention) -> int:
    """The ring degree of a parallel generator (1: none), after the rule that a ring runs a dense ``attention``
    backend only (checked with the resolved backends, before any weight loads)."""
    sp, _ = degrees(num_gpus, cfg_parallel)
    ring = sequence_layout(ckpt.transformer_config.num_attention_heads, sp, ring_degree)[1]
    check_ring_backend(attention.self_backend, ring)
    return ring


def rank_device(device: torch.device) -> torch.device:
    """This rank's device: its own GPU (``LOCAL_RANK``, else the rank modulo the visible GPUs) on CUDA."""
    if device.type != "cuda" or device.index is not None:
        return device
    launched = envs.torchrun_env()
    local = launched[1] if launched is not None else dist.get_rank() % torch.cuda.device_count()
    return torch.device("cuda", local)


def spawn(loader, model, call: dict, ckpt, num_gpus: int, cfg_parallel: bool, cache, device: torch.device,
          ring_degree=None):
    """The checks a parallel generator needs, then ``num_gpus`` workers, each calling ``loader(model, **call)``
    (``VideoGenerator.from_pretrained`` and its arguments) -> a :class:`~fastwan.parallel.workers.ParallelGenerator`."""
    from fastwan.parallel.workers import ParallelGenerator

    check(ckpt, num_gpus, cfg_parallel, cache, device, ring_degree)
    return ParallelGenerator(loader, model, call, num_gpus, device)


def join(ckpt, num_gpus: int, cfg_parallel: bool, cache, device: torch.device,
         ring_degree=None) -> tuple[Mesh, torch.device]:
    """After the checks a parallel generator needs (``ckpt``'s heads, the default step ``cache``, the GPUs, the
    Ulysses x Ring split), make this process a rank of the job (initialising ``torch.distributed`` from the
    launcher's environment if needed) -> (its mesh, its device)."""
    ring = check(ckpt, num_gpus, cfg_parallel, cache, device, ring_degree)
    sp, cfg = degrees(num_gpus, cfg_parallel)
    envs.disable_multicast()
    if not dist.is_initialized():  # a launcher's process (mode "join"): its GPU from LOCAL_RANK
        if device.type == "cuda":
            torch.cuda.set_device(rank_device(device))
        try:
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=TIMEOUT)
        except ValueError as exc:  # env:// rendezvous without RANK / MASTER_ADDR / MASTER_PORT: not a launcher's
            raise InvalidArgument(f"WORLD_SIZE is set, so num_gpus={num_gpus} joins a launcher's job, but this "
                                  f"process cannot: {exc}. Start it with torchrun, or unset WORLD_SIZE to let "
                                  "fastwan start the processes.") from None
    device = rank_device(device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mesh = Mesh.create(sp, cfg, ring)
    if mesh.writes and sp > 1:
        logger.info("sequence parallelism over %d processes: Ulysses %d x Ring %d", sp, sp // ring, ring)
    return mesh, device


def leave() -> None:
    """End this process's part of a launched job: destroy its process group if one is up. A launcher's process
    that owns its rank (the ``fastwan`` CLI under torchrun) calls it before exiting, on success or error: a gloo
    or NCCL group still alive at interpreter exit may abort the process (``terminate called``) while rank 0 is
    still decoding."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
