"""Ulysses sequence parallelism on the CPU: 2 and 4 gloo processes, fp32. Every rank's gathered prediction equals
the single-process prediction of the same weights and inputs, at token counts the world size does not divide, with
a per-token timestep (TI2V), a sparse backend, CFG's shared start and both DiT builds."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fastwan.attention import AttentionDispatch
from fastwan.errors import InvalidArgument
from fastwan.models import WanConfig, WanTransformer
from fastwan.options import DiTOptions
from fastwan.parallel import SequenceParallel, UlyssesDispatch, shard_sizes
from fastwan.parallel.plan import apply_sequence_parallel, remove_sequence_parallel

HEADS, HEAD_DIM = 4, 8
# latents 3 x 6 x 10 with patch (1, 2, 2): a 3 x 3 x 5 grid, 45 tokens (not divisible by 2 or 4)
LATENT = (1, 4, 3, 6, 10)


def model(options: str, backend: str, conf: dict | None, heads: int = HEADS) -> WanTransformer:
    cfg = WanConfig(num_layers=2, num_attention_heads=heads, attention_head_dim=HEAD_DIM, ffn_dim=32, text_dim=8,
                    freq_dim=16, in_channels=4, out_channels=4, cross_attn_norm=True,
                    qk_norm="rms_norm_across_heads")
    attn = AttentionDispatch.resolve(backend, device="cpu", dtype=torch.float32, head_dim=HEAD_DIM, config=conf)
    torch.manual_seed(0)
    m = WanTransformer(cfg, attn, DiTOptions(block=options))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    return m.eval().requires_grad_(False)


def inputs(per_token: bool):
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(LATENT, generator=g)
    tokens = LATENT[2] * (LATENT[3] // 2) * (LATENT[4] // 2)
    timestep = torch.rand(1, tokens, generator=g) * 1000 if per_token else torch.tensor([700.0])
    text = torch.randn(1, 7, 8, generator=g)
    text_uncond = torch.randn(1, 7, 8, generator=g)
    return latents, timestep, text, text_uncond


def _worker(rank: int, world: int, store: str, case: dict, errors) -> None:
    """Runs ``case["call"](rank, case)`` (default :func:`_compare`) as rank ``rank``, its result reported."""
    try:
        # a file store: no TCP server whose process (rank 0) may exit while another rank still talks to it
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
        torch.set_num_threads(1)
        case.get("call", _compare)(rank, case)
        dist.barrier()
        errors.put(f"ok {rank}")
    except BaseException as exc:  # reported to the parent with this rank named
        errors.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _compare(rank: int, case: dict) -> None:
    """The sequence-parallel DiT's prediction equals the one-process DiT's."""
    ref = model(case["options"], case["backend"], case["conf"])
    par = model(case["options"], case["backend"], case["conf"])
    apply_sequence_parallel(par, SequenceParallel.from_group())
    latents, timestep, text, text_uncond = inputs(case["per_token"])
    with torch.no_grad():
        want = ref(latents, timestep, text, step_index=0, num_steps=1)
        got = par(latents, timestep, text, step_index=0, num_steps=1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if case["cfg"]:
            for batched in (True, False):
                w = ref.forward_cfg(latents, timestep, text, text_uncond, batched=batched)
                g = par.forward_cfg(latents, timestep, text, text_uncond, batched=batched)
                for a, b in zip(g, w):
                    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        remove_sequence_parallel(par)  # the plan off: the plain model again, bit for bit
        assert torch.equal(par(latents, timestep, text, step_index=0, num_steps=1), want)


def run(world: int, store: str, **case) -> None:
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    try:
        mp.start_processes(_worker, args=(world, store, case, errors), nprocs=world, start_method="spawn")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        pass  # judged by what the ranks reported: gloo's teardown at exit sometimes aborts a rank that finished
    msgs, ok = [], set()
    while not errors.empty():
        m = errors.get()
        ok.add(int(m[3:])) if m.startswith("ok ") else msgs.append(m)
    assert not msgs, "\n".join(msgs)
    assert ok == set(range(world)), f"ranks {sorted(set(range(world)) - ok)} ended before reporting their result"


CASES = [
    (2, dict(options="reference", backend="TORCH_SDPA", conf=None, per_token=False, cfg=True)),
    (4, dict(options="reference", backend="TORCH_SDPA", conf=None, per_token=True, cfg=False)),
    (2, dict(options="fast", backend="TORCH_SDPA", conf=None, per_token=False, cfg=True)),
    (2, dict(options="reference", backend="SLIDING_TILE_ATTN", conf={"tile": [1, 2, 2], "window": 1},
             per_token=True, cfg=False)),
    (2, dict(options="reference", backend="VIDEO_SPARSE_ATTN", conf={"tile": [1, 2, 2], "sparsity": 0.5},
             per_token=False, cfg=False)),
    # per-head windows: each rank applies the windows of the heads it holds
    (2, dict(options="reference", backend="SLIDING_TILE_ATTN", conf={"tile": [1, 2, 2], "window": 1, "strategy": {
        "0_0_1": [3, 3, 3], "0_1_0": [3, 3, 3]}}, per_token=False, cfg=False)),
    (2, dict(options="reference", backend="SLIDING_TILE_ATTN", conf={"tile": [1, 2, 2], "window": 1, "strategy": {
        "*": {"*": [[1, 1, 1], [3, 3, 3], [1, 3, 1], [3, 1, 3]]}}}, per_token=False, cfg=False)),
]


@pytest.mark.parametrize("world,case", CASES,
                         ids=[f"{w}-{c['options']}-{c['backend']}-{i}" for i, (w, c) in enumerate(CASES)])
def test_sequence_parallel_matches_one_process(world, case, tmp_path):
    run(world, str(tmp_path / "store"), **case)


def test_shard_sizes():
    assert shard_sizes(45, 2) == (23, 22) and shard_sizes(45, 4) == (12, 11, 11, 11)
    assert shard_sizes(40, 4, unit=8) == (16, 8, 8, 8) and shard_sizes(43, 2, unit=8) == (24, 19)
    assert sum(shard_sizes(3, 4)) == 3


def test_heads_must_divide():
    with pytest.raises(InvalidArgument, match="4 attention heads, which 3 does not divide"):
        SequenceParallel(None, 3, 0).check_heads(4)


def test_step_cache_refused_under_sequence_parallelism():
    """Either order: a step cache on a sequence-parallel DiT, or the plan on a DiT with a step cache, is refused
    with the one rule's message, and the DiT is left as it was."""
    from fastwan.cache import CacheRun, FirstBlockCache
    from fastwan.hooks import HookRegistry
    from fastwan.models.wan.step_cache import apply_step_cache, remove_step_cache

    m = model("reference", "TORCH_SDPA", None)
    run = CacheRun(FirstBlockCache(0.1), 4)
    apply_sequence_parallel(m, SequenceParallel(None, 2, 0))
    with pytest.raises(InvalidArgument, match="step caches do not run with sequence parallelism"):
        apply_step_cache(m, run)
    assert HookRegistry.of(m).names() == ["sequence_parallel"]
    remove_sequence_parallel(m)
    apply_step_cache(m, run)
    with pytest.raises(InvalidArgument, match="step caches do not run with sequence parallelism"):
        apply_sequence_parallel(m, SequenceParallel(None, 2, 0))
    assert HookRegistry.of(m).names() == ["step_cache"] and not isinstance(m.attention, UlyssesDispatch)
    remove_step_cache(m)
    assert HookRegistry.of(m).names() == []


def test_the_step_cache_rule_is_written_once():
    """The rule lives in fastwan.parallel.mesh.check_cache; the request checks, the step cache's hook and the plan
    raise it from there."""
    import fastwan

    root = Path(fastwan.__file__).parent
    written = [p.relative_to(root).as_posix() for p in sorted(root.rglob("*.py"))
               if re.search(r"step caches do not run\s+with sequence parallelism", p.read_text())]
    assert written == ["parallel/mesh.py"]
