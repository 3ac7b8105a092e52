"""Same-run A/B of the DiT's fast-path options: each option switched off (or on) alone against the defaults.

1.3B: one CFG denoising step at 480x832x81 (32,760 tokens per pass) as the pipeline runs it there (sequential
CFG with the shared first half, ``forward_cfg(batched=False)``). 14B: one forward at 720x1280x81 (75,600 tokens).
Every variant is its own model built on the same weight tensors (no copy; ``fuse_qkv`` concatenates its own),
compiled per block with ``fullgraph=True``; the variants are timed in interleaved rounds so that clock drift
hits all alike. Text: ``--cond-tokens`` / ``--uncond-tokens`` random rows, the rest of the 512 zeroed as the
pipelines pad a prompt.

  python benchmarks/levers.py --size 1.3b --rounds 5 --out levers_13b.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

VARIANTS = {  # label: set_fast_paths arguments (text_normq: the per-attention attribute)
    "defaults": {},
    "-gelu_epilogue": {"gelu_epilogue": False},
    "-fused_norms": {"fused_norms": False},
    "-gemm_residual": {"gemm_residual": False},
    "-text_collapse": {"text_collapse": False},
    "-text_kv_cache": {"text_kv_cache": False},
    "-text_fold": {"text_fold": False},
    "-text_normq": {"text_normq": False},
    "+fuse_qkv": {"fuse_qkv": True},
}
SIZES = {  # DiT shape and the job's video (frames, height, width)
    "1.3b": (dict(num_attention_heads=12, ffn_dim=8960, num_layers=30), (81, 480, 832)),
    "14b": (dict(num_attention_heads=40, ffn_dim=13824, num_layers=40), (81, 720, 1280)),
}


def build(size: str, variants: list[str]):
    from fastwan.attention import AttentionDispatch
    from fastwan.models import WanConfig, WanTransformer, keep_in_fp32

    dims, _ = SIZES[size]
    cfg = WanConfig.from_dict({"_class_name": "WanTransformer3DModel", "patch_size": (1, 2, 2),
                               "attention_head_dim": 128, "in_channels": 16, "out_channels": 16, "text_dim": 4096,
                               "freq_dim": 256, "cross_attn_norm": True, "qk_norm": "rms_norm_across_heads",
                               "eps": 1e-6, "rope_max_seq_len": 1024, **dims})
    att = AttentionDispatch.resolve(None, device="cuda", dtype=torch.bfloat16, head_dim=128)
    torch.manual_seed(0)
    with torch.device("cuda"):
        base = WanTransformer(cfg, att)
    for name, p in base.named_parameters():
        p.data = p.data.float() if keep_in_fp32(name) else p.data.to(torch.bfloat16)
    state = base.state_dict()
    del base
    models = {}
    for label in variants:
        with torch.device("meta"):
            m = WanTransformer(cfg, att)
        m.load_state_dict(state, assign=True, strict=True)
        m.eval().requires_grad_(False)
        opts = dict(VARIANTS[label])
        normq = opts.pop("text_normq", True)
        m.set_fast_paths(**opts)
        for blk in m.blocks:
            blk.attn2.text_normq = normq
        m.compile_blocks(fullgraph=True)
        models[label] = m
    return models, att


def inputs(size: str, cond_tokens: int, uncond_tokens: int):
    f, h, w = SIZES[size][1]
    g = torch.Generator("cuda").manual_seed(0)
    x = torch.randn(1, 16, (f - 1) // 4 + 1, h // 8, w // 8, device="cuda", generator=g).to(torch.bfloat16)
    texts = []
    for n in (cond_tokens, uncond_tokens):
        t = torch.randn(1, 512, 4096, device="cuda", generator=g).to(torch.bfloat16)
        t[:, n:] = 0
        texts.append(t)
    return x, texts


@torch.no_grad()
def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="1.3b", choices=tuple(SIZES))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=4, help="steps (1.3B) or forwards (14B) timed per round")
    p.add_argument("--cond-tokens", type=int, default=21)
    p.add_argument("--uncond-tokens", type=int, default=8)
    p.add_argument("--out", default="levers.json")
    a = p.parse_args()
    import torch._dynamo.config as dcfg

    for name in ("recompile_limit", "cache_size_limit"):  # the variants compile the same block code object
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(getattr(dcfg, name), 64))
    labels = a.variants.split(",")
    models, att = build(a.size, labels)
    x, (cond, uncond) = inputs(a.size, a.cond_tokens, a.uncond_tokens)
    ts = torch.linspace(999, 20, 50, device="cuda")

    def step(m, i):
        t = ts[i % 50].expand(1)
        if a.size == "1.3b":
            return m.forward_cfg(x, t, cond, uncond, batched=False, step_index=i, num_steps=50)
        return m(x, t, cond, step_index=i, num_steps=50)

    res = {"command": " ".join(["python"] + sys.argv), "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "attention": att.describe("cuda"), "variants": {}}
    ref = None
    for label, m in models.items():  # compile + warm-up; outputs against the defaults
        t0 = time.perf_counter()
        out = step(m, 0)
        out = torch.cat(out) if isinstance(out, tuple) else out
        step(m, 1)
        torch.cuda.synchronize()
        if ref is None:
            ref = out.float()
        rel = ((out.float() - ref).norm() / ref.norm()).item()
        res["variants"][label] = {"first_calls_s": time.perf_counter() - t0, "rel_diff_vs_defaults": rel,
                                  "rounds_ms": []}
        print(f"{label}: warm-up {time.perf_counter() - t0:.1f} s, rel diff vs defaults {rel:.2e}", flush=True)
    for r in range(a.rounds):
        for label, m in models.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(a.steps):
                step(m, i)
            end.record()
            end.synchronize()
            res["variants"][label]["rounds_ms"].append(start.elapsed_time(end) / a.steps)
        print(f"round {r}: " + ", ".join(f"{k} {v['rounds_ms'][-1]:.1f}" for k, v in res["variants"].items()),
              flush=True)
    base = statistics.median(res["variants"]["defaults"]["rounds_ms"]) if "defaults" in models else None
    print(f"\n{'variant':<16} {'ms/step':>9} {'min-max':>15} {'vs defaults':>12}")
    for label, e in res["variants"].items():
        e["median_ms"] = statistics.median(e["rounds_ms"])
        e["spread_ms"] = max(e["rounds_ms"]) - min(e["rounds_ms"])
        rel = "" if base is None else f"{(e['median_ms'] / base - 1) * 100:+.2f}%"
        print(f"{label:<16} {e['median_ms']:9.1f} {min(e['rounds_ms']):7.1f}-{max(e['rounds_ms']):<7.1f} {rel:>12}")
    with open(a.out, "w") as fh:
        json.dump(res, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
