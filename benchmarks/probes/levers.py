"""Same-run A/B of the DiT's build options: each :class:`~fastwan.options.DiTOptions` variant against the defaults.

1.3B: one CFG denoising step at 480x832x81 (32,760 tokens per pass) as the pipeline runs it there (sequential
CFG with the shared first half, ``forward_cfg(batched=False)``). 14B: one forward at 720x1280x81 (75,600 tokens).
A variant is a dict of DiTOptions overrides (:func:`benchmarks.harness.option_variants`: "reference" for the
reference block); each is its own model built on the same weight tensors
(assigned, not copied), compiled per block with ``fullgraph=True``. The variants are timed in interleaved rounds
so that clock drift hits all alike. Text: ``--cond-tokens`` / ``--uncond-tokens`` random rows, the rest of the
512 zeroed as the pipelines pad a prompt.

  python -m benchmarks.probes.levers --size 1.3b --rounds 5 --out levers_13b.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from benchmarks.harness import (
    DIT_SIZES,
    TEXT_DIM,
    TEXT_TOKENS,
    build_dit,
    log,
    option_overrides,
    option_variants,
    raise_recompile_limit,
    wan_config,
)


def random_state(size: str, attention) -> dict[str, torch.Tensor]:
    """Random weights of a ``size`` DiT on CUDA, bf16 except the modules diffusers keeps in fp32."""
    from fastwan.models import WanTransformer, keep_in_fp32
    from fastwan.options import DiTOptions

    torch.manual_seed(0)
    with torch.device("cuda"):
        base = WanTransformer(wan_config(size), attention, options=DiTOptions(block="reference"))
    for name, p in base.named_parameters():
        p.data = p.data.float() if keep_in_fp32(name) else p.data.to(torch.bfloat16)
    return base.state_dict()


def build(size: str, variants: dict[str, dict]):
    """{label: compiled model built as its overrides} on one set of random weights, and the attention dispatch."""
    from fastwan.attention import AttentionDispatch

    att = AttentionDispatch.resolve(None, device="cuda", dtype=torch.bfloat16, head_dim=128)
    state = random_state(size, att)
    cfg = wan_config(size)
    models = {}
    for label, overrides in variants.items():
        m = build_dit(cfg, att, state, overrides)
        m.compile_blocks(fullgraph=True)
        models[label] = m
    return models, att


def inputs(size: str, cond_tokens: int, uncond_tokens: int):
    f, h, w = DIT_SIZES[size][1]
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, 16, (f - 1) // 4 + 1, h // 8, w // 8, device="cuda", generator=g).to(torch.bfloat16)
    texts = []
    for n in (cond_tokens, uncond_tokens):
        t = torch.randn(1, TEXT_TOKENS, TEXT_DIM, device="cuda", generator=g).to(torch.bfloat16)
        t[:, n:] = 0
        texts.append(t)
    return x, texts


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probes.levers", description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1.3b", choices=tuple(DIT_SIZES))
    p.add_argument("--variants", default=None,
                   help="comma-separated DiT variants (default: every variant of option_variants() whose options "
                        "differ on CUDA bf16), from: defaults, reference, fast")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps (1.3B) or forwards (14B) timed per round")
    p.add_argument("--cond-tokens", type=int, default=21)
    p.add_argument("--uncond-tokens", type=int, default=8)
    p.add_argument("--out", default="levers.json")
    return p


def summarize(res: dict) -> None:
    """Median, spread and change against the defaults of every variant (in ``res``), printed as a table."""
    variants = res["variants"]
    base = statistics.median(variants["defaults"]["rounds_ms"]) if "defaults" in variants else None
    print(f"\n{'variant':<16} {'ms/step':>9} {'min-max':>15} {'vs defaults':>12}")
    for label, e in variants.items():
        e["median_ms"] = statistics.median(e["rounds_ms"])
        e["spread_ms"] = max(e["rounds_ms"]) - min(e["rounds_ms"])
        rel = "" if base is None else f"{(e['median_ms'] / base - 1) * 100:+.2f}%"
        print(f"{label:<16} {e['median_ms']:9.1f} {min(e['rounds_ms']):7.1f}-{max(e['rounds_ms']):<7.1f} {rel:>12}")


@torch.no_grad()
def main(argv=None) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    try:
        labels = a.variants.split(",") if a.variants else list(option_variants("cuda", torch.bfloat16))
        variants = {label: option_overrides(label) for label in labels}
    except ValueError as exc:
        p.error(str(exc))
    raise_recompile_limit()
    models, att = build(a.size, variants)
    x, (cond, uncond) = inputs(a.size, a.cond_tokens, a.uncond_tokens)
    ts = torch.linspace(999, 20, 50, device="cuda")

    def step(m, i):
        t = ts[i % 50].expand(1)
        if a.size == "1.3b":
            return m.forward_cfg(x, t, cond, uncond, batched=False, step_index=i, num_steps=50)
        return m(x, t, cond, step_index=i, num_steps=50)

    res = {"command": " ".join(["python -m benchmarks.probes.levers"] + sys.argv[1:]),
           "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "attention": att.describe("cuda"),
           "overrides": variants, "variants": {}}
    ref = None
    for label, m in models.items():  # compile + warm-up; outputs against the first variant
        t0 = time.perf_counter()
        out = step(m, 0)
        out = torch.cat(out) if isinstance(out, tuple) else out
        step(m, 1)
        torch.cuda.synchronize()
        if ref is None:
            ref = out.float()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        res["variants"][label] = {"first_calls_s": time.perf_counter() - t0, "rel_diff_vs_first": rel,
                                  "rounds_ms": []}
        log(f"{label}: warm-up {time.perf_counter() - t0:.1f} s, rel diff vs {labels[0]} {rel:.2e}")
    for r in range(a.rounds):
        for label, m in models.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(a.steps):
                step(m, i)
            end.record()
            end.synchronize()
            res["variants"][label]["rounds_ms"].append(start.elapsed_time(end) / a.steps)
        log(f"round {r}: " + ", ".join(f"{k} {v['rounds_ms'][-1]:.1f}" for k, v in res["variants"].items()))
    summarize(res)
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
