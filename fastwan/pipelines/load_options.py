"""How a generator loads: :class:`LoadOptions`, every argument of ``VideoGenerator.from_pretrained``.

Building one checks each option's own rule (types, ranges, choices, the LoRA files' existence) once; what depends on
this machine or the checkpoint (CUDA present, the GPUs a parallel job needs, the attention backend's availability, a
TeaCache's coefficients for the model) is checked by ``from_pretrained`` before any weight loads. The CLI builds
its loading flags from these fields (:mod:`fastwan.fields`), and JSON callers use the JSON form (dtypes as names,
e.g. "bfloat16").
"""
from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fastwan import envs
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.fields import REQUIRED, boolean, check_fields, number_text, option
from fastwan.lora.merge import check_repeats, parse_lora_spec
from fastwan.models.wan.quantize import QUANTIZATIONS, check_quantization
from fastwan.offload.plan import parse_memory
from fastwan.parallel.mesh import check_ring_degree
from fastwan.options import BLOCKS, DiTOptions
from fastwan.pipelines.params import _decode_cache, _encode_cache
from fastwan.cache import check_cache
from fastwan.cache.schema import cache_schema
from fastwan.vae.decode import check_chunk
from fastwan.vae.tiny_weights import VAE_CHOICES, check_tiny_options
from fastwan.values import python_number

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CFG_MODES = ("auto", "batched", "sequential")
FP32_PRECISIONS = ("tf32", "ieee")  # torch.backends.cuda.matmul / cudnn.conv fp32_precision values


def default_dtype(device: torch.device) -> torch.dtype:
    """Rule: one default dtype per device, for the API and the CLI alike: bfloat16 on CUDA, float32 elsewhere
    (the CPU's bfloat16 matmuls are slow and round more)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _dtype(name: str):
    def check(value):
        if value is None or value in DTYPE_NAMES.values():
            return value
        raise (InvalidArgument if isinstance(value, torch.dtype) else InvalidArgumentType)(
            f"{name}={value!r} must be torch.float32, torch.bfloat16 or torch.float16.")
    return check


def dtype_of(name):
    """A dtype's JSON / CLI name ("bfloat16") -> the torch dtype; anything else is left for the field's rule."""
    return DTYPE_NAMES.get(name, name) if isinstance(name, str) else name


def _dtype_name(value) -> str:
    return str(value).removeprefix("torch.")


def _optional_str(name: str, example: str):
    def check(value):
        if value is not None and not isinstance(value, (str, os.PathLike)):
            raise InvalidArgumentType(f"{name}={value!r} must be a string (e.g. {example}) or None.")
        return value
    return check


def _model(value):
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip():
        raise (InvalidArgument if isinstance(value, str) else InvalidArgumentType)(
            f"model={value!r} must name a checkpoint: a Hub id, a Diffusers-format folder or a tiny model name "
            "(e.g. 'tiny').")
    return value


def _device(value):
    if value is None:
        return None
    try:
        return str(torch.device(value))
    except (RuntimeError, TypeError, ValueError):
        raise InvalidArgument(f"device={value!r} is not a torch device (e.g. 'cuda', 'cuda:1', 'cpu').") from None


def _backend(value):
    if value is None or isinstance(value, str):
        return value
    from fastwan.attention import AttentionBackend

    if isinstance(value, AttentionBackend):
        return value
    raise InvalidArgumentType(f"attention_backend={value!r} must be a backend name (e.g. 'TORCH_SDPA') or None.")


def _attention_config(value):
    if value is None:
        return None
    from fastwan.attention.sparse import load_attention_config

    return load_attention_config(value, given_by="attention_config= (CLI --attention-config)")


def _compile_kwargs(value):
    if value is not None and not isinstance(value, Mapping):
        raise InvalidArgumentType(f"torch_compile_kwargs={value!r} must be a dict of torch.compile kwargs.")
    return None if value is None else dict(value)


def _gate(value):
    return None if value is None else envs.validate_cfg_gate_step(python_number(value))


def _choice(name: str, choices: tuple, why: str):
    def check(value):
        if value not in choices:
            raise (InvalidArgument if isinstance(value, str) else InvalidArgumentType)(
                f"{name}={value!r} must be one of {choices} ({why}).")
        return value
    return check


def _dit_options(value):
    if value is None or isinstance(value, DiTOptions):
        return value
    raise InvalidArgumentType(f"dit_options={value!r} must be a fastwan.options.DiTOptions.")


def dit_options_of(value):
    """DiT options' JSON form ({"block": "fast"}) or the CLI's --dit-block name -> DiTOptions."""
    if isinstance(value, str):
        return DiTOptions(block=value)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {f.name for f in dataclasses.fields(DiTOptions)})
        if unknown:
            raise InvalidArgument(f"dit_options={dict(value)!r}: {unknown[0]!r} is not a DiT option; the options "
                                  f"are {[f.name for f in dataclasses.fields(DiTOptions)]}.")
        return DiTOptions(**value)
    return value


def _vae_tiling(value):
    if isinstance(value, bool) or isinstance(value, Mapping):
        return value if isinstance(value, bool) else dict(value)
    raise InvalidArgumentType(f"vae_tiling={value!r} must be True, False or a dict of tile sizes (pixels).")


def _chunk(value):
    value = python_number(value)
    check_chunk(value)
    return value


def _memory(value):
    return parse_memory(python_number(value))


def _num_gpus(value):
    value = python_number(value)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"num_gpus={value!r} must be a whole number >= 1 (processes, one GPU each), or None "
                              "for one process.")
    return value


def _ring_degree(value):
    return check_ring_degree(python_number(value))


def _causal_recipe(value):
    from fastwan.checkpoint.causal_files import family_recipe

    if value is not None and not isinstance(value, str):
        family_recipe(value)  # a CausalRecipe, or the type error naming the choices
    elif value is not None:
        family_recipe(value.strip().lower())
        value = value.strip().lower()
    return value


def _encode_recipe(value):
    return value if isinstance(value, str) else {k: list(v) if isinstance(v, tuple) else v
                                                 for k, v in dataclasses.asdict(value).items()}


def _decode_recipe(value):
    if not isinstance(value, Mapping):
        return value
    from fastwan.checkpoint.causal import CausalRecipe

    fields = {f.name for f in dataclasses.fields(CausalRecipe)}
    unknown = sorted(set(value) - fields)
    if unknown:
        raise InvalidArgument(f"causal_recipe={dict(value)!r}: {unknown[0]!r} is not a CausalRecipe field; the fields "
                              f"are {sorted(fields)}.")
    return CausalRecipe(**{k: tuple(v) if isinstance(v, list) else v for k, v in value.items()})


def _encode_lora(value):
    return [list(item) for item in value]


def _decode_lora(value):
    if isinstance(value, list):
        return [tuple(v) if isinstance(v, list) else v for v in value]
    return value


@dataclass(frozen=True)
class LoadOptions:
    """How ``VideoGenerator.from_pretrained`` loads a checkpoint: every one of its arguments.

    Checked once when built; the machine's and the checkpoint's rules are checked by ``from_pretrained`` before
    any weight loads. ``attention_backend`` beats ``FASTVIDEO_ATTENTION_BACKEND``; unset means automatic (the
    fastest lossless kernel for the device). ``dtype`` None: bfloat16 on CUDA, float32 elsewhere
    (:func:`default_dtype`).

    ``enable_torch_compile`` compiles each DiT block (``fullgraph=True`` by default; with a sparse backend
    the attention call is a graph break, so the default becomes ``fullgraph=False``).

    ``dit_options`` (:class:`fastwan.options.DiTOptions`, default ``DiTOptions()``): how the DiT is built,
    resolved once here for the device and dtype. Its default block is the fast one where fastwan's kernels
    run (CUDA, fp16/bf16, Triton) and the reference one (diffusers' rounding points) elsewhere; the fast build
    also fuses the VAE decoder's RMSNorm + SiLU pairs.

    ``cfg_mode``: "batched" runs the conditional and unconditional passes as one batch of 2, "sequential"
    one after the other (less memory), "auto" (default) sequential on CUDA for videos of at least
    ``AUTO_SEQUENTIAL_TOKENS`` DiT tokens per sample, batched otherwise. Either way the part the two passes
    share (everything before the first block's cross-attention) runs once.

    ``fp32_precision``: the math of fp32 matmuls and convolutions on CUDA (an fp32 VAE, text or image encoder, or an
    fp32 DiT): "tf32" (default; TensorFloat-32 tensor cores, a 10-bit mantissa on the products, fp32 sums) or
    "ieee" (full fp32). torch keeps one setting per process (``torch.backends.cuda.matmul.fp32_precision`` and
    ``torch.backends.cudnn.conv.fp32_precision``); a CUDA load sets it, so the generators of one process share the
    last load's. bf16 and fp16 math is unaffected; a CPU load changes nothing.

    ``vae_tiling`` decodes in overlapping spatial tiles (diffusers' ``AutoencoderKLWan.enable_tiling``): about
    5x less decode memory at 720p for about 2x the decode time; True uses diffusers' tile sizes, a dict sets
    ``tile_sample_min_height/_width`` and ``tile_sample_stride_height/_width`` (pixels, multiples of the
    VAE's spatial factor, stride <= tile). On CUDA the VAE's 3-D conv weights are stored channels-last
    (measured: decode -9%, decode memory -10%), and the VAE's causal convolutions, bias adds and upsampling
    run with fewer full-tensor copies, the same math (:mod:`fastwan.vae.convs`; 480p decode -27%).

    ``cache``: the default step cache of the generator's videos (:mod:`fastwan.cache`: ``FirstBlockCache``,
    ``TeaCache``, ``MagCache``, ``TaylorSeer``, ``SkipSteps``, or their string form such as
    ``"teacache:threshold=0.1"``; None or a threshold of 0: none). Under a cache each CFG pass decides with its own
    state, one pass after the other.

    ``lora``: LoRA file(s) merged into the DiT after loading: a path, (path, scale), (path, scale, expert), or a
    list of them (see ``VideoGenerator.load_lora``; expert 0 / 1: one Wan2.2 A14B expert, as paired LoRAs need); one
    file
    given twice for one DiT raises. ``allow_pickle`` also lets pickle LoRA files (.pt, .bin, ...) load.

    ``quantization``: None (the DiT in ``dtype``) or "fp8": every linear layer of the DiT's blocks holds an e4m3
    weight with per-output-channel scales, quantized while loading (:mod:`fastwan.models.wan.quantize`): half
    the DiT's weight memory; on sm89+ GPUs the GEMMs run in FP8 with per-token activation scales (a speed lever
    with ``enable_torch_compile``, which fuses the activation quantization), elsewhere each weight is
    dequantized for its matmul. LoRAs (``lora=`` or ``load_lora``) merge into the FP8 weights: the
    dequantized weight plus the update, quantized again with new scales (as PEFT merges into quantized layers),
    the same whether given here or loaded later. A folder written by ``fastwan quantize`` loads in FP8 without
    this argument.

    ``max_gpu_memory``: a CUDA memory budget (bytes, or a string such as "24GiB"): the planner
    (:mod:`fastwan.offload.plan`) picks the fewest levers that fit the preset's video in it -- the text encoder
    on the GPU only while encoding (or streamed layer by layer), the A14B expert not in use in host memory, the
    DiT in host memory while encoding and decoding, tiled VAE decoding, the DiT's last blocks streamed from
    pinned host memory with the next block's copy overlapping the current block's compute
    (:mod:`fastwan.offload.placement`). The generator's ``memory_plan`` describes the plan and its expected peak per
    phase; a
    budget nothing fits raises before loading; each video gets its own plan before compute (the same video
    the same plan, whatever came before), or the planner's error.

    ``vae``: "full" (default) decodes with the checkpoint's VAE; "tiny" with TAEHV's tiny decoder
    (:mod:`fastwan.vae.tiny`), whose weights come from the local file ``vae_path`` (taew2_1 for 16-channel latents,
    taew2_2 for Wan2.2 TI2V's 48; safetensors, or a pickle with ``allow_pickle``), checked against the checkpoint
    before any weight loads (:mod:`fastwan.vae.tiny_weights`). The full VAE still loads (image-to-video encodes
    with it).

    ``causal_weights``: a Self-Forcing or CausVid generator file (their released ``self_forcing_dmd.pt`` /
    ``model.pt``, or the same tensors as .safetensors; a pickle only with ``allow_pickle``, read weights-only) whose DiT
    replaces ``model``'s: ``model`` is then the Wan2.1 text-to-video checkpoint the generator was trained from (it
    gives the config, text encoder and VAE; Wan-AI/Wan2.1-T2V-1.3B-Diffusers for both families), and the generator
    samples causally, chunk after chunk (``gen.causal``). ``causal_recipe``: which family's sampling rule, as the
    files do not say: "self-forcing" (None, the default: 4 warped steps at shift 5) or "causvid" (1000/757/522,
    shift 8), or a :class:`~fastwan.checkpoint.causal.CausalRecipe`; only with ``causal_weights`` (FastVideo's
    causal checkpoints carry their own rule). :mod:`fastwan.checkpoint.causal_files` says how the file is read.

    ``vae_chunk_frames``: latent frames per VAE decoder call after the first (diffusers decodes one at a time;
    the result is the same, :mod:`fastwan.vae.decode`). "auto" (default) takes as many as keep a call's
    output within 8 frames of 480x832 (2 at 480p, 1 from 720p); larger chunks use more decode memory.
    """

    model: str = option(REQUIRED, help="Hub id, Diffusers-format folder, or tiny / tiny-wan2.1 / tiny-wan2.2-a14b / "
                                       "tiny-wan2.2-ti2v / tiny-wan2.1-i2v / tiny-wan2.1-flf2v / tiny-wan2.2-i2v-a14b /"
                                       " tiny-fastwan2.1 / tiny-wan2.2-animate (CLI default: tiny)",
                        schema={"type": "string", "minLength": 1}, check=_model, encode=os.fspath, flag="--model",
                        cli_default="tiny")
    device: str | None = option(None, help="torch device, e.g. cuda, cuda:1, cpu (default: cuda if available)",
                                nullable=True, schema={"type": "string"}, check=_device, flag="--device")
    dtype: Any = option(None, help="DiT and text encoder dtype (default: bfloat16 on CUDA, float32 elsewhere)",
                        nullable=True, schema={"enum": list(DTYPE_NAMES)}, check=_dtype("dtype"),
                        encode=_dtype_name, decode=dtype_of, flag="--dtype", parse=dtype_of,
                        choices=tuple(DTYPE_NAMES.values()), metavar="{" + ",".join(DTYPE_NAMES) + "}")
    attention_backend: Any = option(None, help="TORCH_SDPA, FLASH_ATTN, SAGE_ATTN, ATTN_8BIT, "
                                               "SLIDING_TILE_ATTN, VIDEO_SPARSE_ATTN, NEIGHBORHOOD_ATTN (default: "
                                               "automatic, or FASTVIDEO_ATTENTION_BACKEND)", nullable=True,
                                    schema={"type": "string"}, check=_backend,
                                    encode=lambda b: b if isinstance(b, str) else b.name,
                                    flag="--attention-backend")
    attention_config: Any = option(None, help="the backend's settings: a JSON file, or inline JSON such as "
                                              "'{\"sparsity\": 0.9}'", nullable=True, schema={"type": "object"},
                                   check=_attention_config, flag="--attention-config")
    enable_torch_compile: bool = option(False, help="torch.compile the DiT blocks", schema={"type": "boolean"},
                                        check=boolean("enable_torch_compile"), flag="--compile", action="store_true")
    torch_compile_kwargs: Any = option(None, help="torch.compile's keyword arguments (default: fullgraph unless the "
                                                  "attention is sparse)", nullable=True, schema={"type": "object"},
                                       check=_compile_kwargs)
    cfg_gate_step: float | None = option(None, help="fraction of the steps with full CFG, in [0, 1] (default: "
                                                    "FASTVIDEO_CFG_GATE_STEP, else 1)", nullable=True,
                                         schema={"type": "number", "minimum": 0, "maximum": 1}, check=_gate,
                                         flag="--cfg-gate-step", parse=number_text)
    cfg_mode: str = option("auto", help="CFG as one batch of 2, two passes, or auto (two passes for large videos "
                                        "on CUDA)", schema={"enum": list(CFG_MODES)},
                           check=_choice("cfg_mode", CFG_MODES, "'auto' picks per video size; 'sequential' saves "
                                                                 "memory"), flag="--cfg-mode", choices=CFG_MODES)
    fp32_precision: str = option("tf32", help="fp32 matmuls and convolutions on CUDA: tf32 (TensorFloat-32) or ieee "
                                              "(full fp32); torch's setting for the whole process",
                                 schema={"enum": list(FP32_PRECISIONS)},
                                 check=_choice("fp32_precision", FP32_PRECISIONS, "'ieee' pins full fp32 precision"),
                                 flag="--fp32-precision", choices=FP32_PRECISIONS)
    vae_dtype: Any = option(None, help="VAE dtype (default: --dtype)", nullable=True,
                            schema={"enum": list(DTYPE_NAMES)}, check=_dtype("vae_dtype"), encode=_dtype_name,
                            decode=dtype_of, flag="--vae-dtype", parse=dtype_of, choices=tuple(DTYPE_NAMES.values()),
                            metavar="{" + ",".join(DTYPE_NAMES) + "}")
    dit_options: Any = option(DiTOptions(), help="the DiT block: fast (fused kernels), reference (diffusers' rounding "
                                         "points), or auto (fast where the kernels run)", nullable=True,
                              schema={"type": "object", "properties": {"block": {"enum": list(BLOCKS)}}},
                              check=_dit_options, encode=dataclasses.asdict, decode=dit_options_of,
                              flag="--dit-block", parse=dit_options_of, metavar="{" + ",".join(BLOCKS) + "}")
    vae_tiling: Any = option(False, help="decode in spatial tiles (diffusers' VAE tiling): ~5x less decode memory, "
                                         "~2x slower decode (from Python, a dict of tile sizes in pixels)",
                             schema={"anyOf": [{"type": "boolean"}, {"type": "object"}]}, check=_vae_tiling,
                             flag="--vae-tiling", action="store_true")
    vae_chunk_frames: Any = option("auto", help="latent frames per VAE decoder call after the first: auto or an int "
                                                ">= 1 (1 = diffusers' frame-by-frame decode)",
                                   schema={"anyOf": [{"const": "auto"}, {"type": "integer", "minimum": 1}]},
                                   check=_chunk, flag="--vae-chunk-frames",
                                   parse=lambda t: t if t == "auto" else int(t))
    vae: str = option("full", help="the decoder: full (the checkpoint's VAE) or tiny (TAEHV's tiny decoder from "
                                    "--vae-path: faster, less memory, lower quality)",
                      schema={"enum": list(VAE_CHOICES)},
                      check=_choice("vae", VAE_CHOICES, "'tiny' decodes with TAEHV's decoder from vae_path"),
                      flag="--vae", choices=VAE_CHOICES)
    vae_path: Any = option(None, help="the tiny decoder's weight file (vae tiny): taew2_1 for Wan2.1 / Wan2.2 A14B, "
                                      "taew2_2 for Wan2.2 TI2V, .safetensors (.pth with --allow-pickle)",
                           nullable=True, schema={"type": "string"},
                           check=_optional_str("vae_path", "'taew2_1.safetensors'"), encode=os.fspath,
                           flag="--vae-path", metavar="FILE")
    cache: Any = option(None, help="step cache: none, first_block, teacache, magcache, taylorseer or skip_steps, "
                                   "with settings, e.g. teacache:threshold=0.1 (see fastwan.cache)", nullable=True,
                        schema=cache_schema(), check=check_cache,
                        encode=_encode_cache, decode=_decode_cache, flag="--cache", metavar="TYPE[:KEY=VALUE,...]")
    lora: Any = option(None, help="LoRA files merged into the DiT: (path, scale, expert) items; expert 0 / 1: one "
                                  "Wan2.2 A14B expert, None: every DiT", nullable=True,
                       schema={"type": "array", "items": {"type": "array", "prefixItems": [
                           {"type": "string"}, {"type": "number"}, {"type": ["integer", "null"]}]}},
                       encode=_encode_lora, decode=_decode_lora)
    quantization: str | None = option(None, help="fp8: e4m3 DiT weights with per-channel scales (half the memory; "
                                                 "FP8 GEMMs on sm89+)", nullable=True,
                                      schema={"enum": list(QUANTIZATIONS)}, check=check_quantization,
                                      flag="--quantization", choices=tuple(QUANTIZATIONS))
    max_gpu_memory: Any = option(None, help="GPU memory budget, e.g. 24GiB: offload / streaming levers are planned "
                                            "to fit it", nullable=True,
                                 schema={"anyOf": [{"type": "integer", "minimum": 1}, {"type": "string"}]},
                                 check=_memory, flag="--max-gpu-memory", metavar="SIZE")
    allow_pickle: bool = option(False, help="also read PyTorch pickle weights (.bin, .pt, ...) of the checkpoint, "
                                            "LoRA and --causal-weights files, for sources you trust (unpickling can "
                                            "run code; read weights-only)",
                                schema={"type": "boolean"}, check=boolean("allow_pickle"), flag="--allow-pickle",
                                action="store_true")
    causal_weights: Any = option(None, help="a Self-Forcing / CausVid generator file whose DiT replaces the model's "
                                            "(the model: the Wan2.1 T2V base it was trained from); the generator "
                                            "becomes causal (.safetensors; .pt with --allow-pickle)", nullable=True,
                                 schema={"type": "string"}, check=_optional_str("causal_weights",
                                                                                "'self_forcing_dmd.pt'"),
                                 encode=os.fspath, flag="--causal-weights", metavar="FILE")
    causal_recipe: Any = option(None, help="the sampling rule of --causal-weights' family: self-forcing (default) or "
                                           "causvid", nullable=True,
                                schema={"anyOf": [{"type": "string"}, {"type": "object"}]}, check=_causal_recipe,
                                encode=_encode_recipe, decode=_decode_recipe, flag="--causal-recipe",
                                metavar="{self-forcing,causvid}")
    revision: str | None = option(None, help="Hub branch, tag or commit of the model (Hub ids only)", nullable=True,
                                  schema={"type": "string"}, check=_optional_str("revision", "'main'"),
                                  flag="--revision")
    num_gpus: int | None = option(None, help="processes (one GPU each) that make each video together",
                                  nullable=True, schema={"type": "integer", "minimum": 1}, check=_num_gpus)
    cfg_parallel: bool = option(False, help="run the two CFG passes on two groups of processes",
                                schema={"type": "boolean"}, check=boolean("cfg_parallel", InvalidArgument),
                                flag="--cfg-parallel", action="store_true")
    ring_degree: int | None = option(None, help="processes of the ring-attention part of the sequence split (the "
                                                "rest Ulysses; 1: Ulysses alone); unset: Ulysses as far as the "
                                                "attention heads divide, the ring for the rest", nullable=True,
                                     schema={"type": "integer", "minimum": 1}, check=_ring_degree, flag="--ring",
                                     parse=int, metavar="R")

    def __post_init__(self) -> None:
        check_fields(self)
        loras = parse_lora_spec(self.lora, self.allow_pickle)
        check_repeats(loras)  # one file twice for one DiT: a slip (load_lora adds a file again on purpose)
        object.__setattr__(self, "lora", loras)
        check_tiny_options(self.vae, self.vae_path, self.allow_pickle)
        if self.causal_weights is not None:
            from fastwan.checkpoint.causal_files import check_generator_path

            check_generator_path(self.causal_weights, self.allow_pickle)
        elif self.causal_recipe is not None:
            raise InvalidArgument(f"causal_recipe={self.causal_recipe!r} is the sampling rule of a causal_weights "
                                  "file, and none is given; pass causal_weights= (CLI --causal-weights), or drop "
                                  "causal_recipe (FastVideo's causal checkpoints carry their own rule).")
        if self.torch_compile_kwargs and not self.enable_torch_compile:
            raise InvalidArgument(f"torch_compile_kwargs={self.torch_compile_kwargs!r} apply only when the DiT is "
                                  "compiled; pass enable_torch_compile=True with them, or drop them.")

    def kwargs(self) -> dict[str, Any]:
        """The options as ``from_pretrained``'s keyword arguments (``model`` excluded)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "model"}
