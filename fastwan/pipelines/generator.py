"""``VideoGenerator``: load a Wan checkpoint, make videos.

Text encoder/tokenizer come from transformers, the VAE and scheduler from diffusers; the DiT is fastwan's own
(:mod:`fastwan.models`). The denoising loop runs CFG as one batch of 2 or as two batch-1 passes (``cfg_mode``),
with the passes' common start computed once (:meth:`WanTransformer.forward_cfg`), optionally gated (skip the
uncond forward late in sampling and reuse the last guidance delta).

Every input of :meth:`VideoGenerator.generate_video` (sizes, step count against the scheduler's limit, seed range,
output destination) is checked before any compute; calls on one generator from several threads run one at a time
(a per-instance lock: the VAE's decode cache and the DiT's text K/V cache live on the modules). The mp4 is written
by :mod:`fastwan.pipelines.output` (automatic names, no overwrite unless asked, atomic moves).
"""
from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fastwan.attention import AttentionBackend, AttentionDispatch
from fastwan.attention.registry import context_backend
from fastwan.cache import CacheConfig, CacheRun, resolve_coefficients
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.kernels.fp8 import Fp8Linear
from fastwan.lora import LoraState, apply_lora, check_loras
from fastwan.models import load_transformer
from fastwan.models.wan.causal_graph import ChunkGraphs
from fastwan.offload import plan_offload
from fastwan.options import DiTOptions
from fastwan.parallel.launch import join, mode as parallel_mode, ring_of, spawn
from fastwan.parallel.plan import apply_sequence_parallel
from fastwan.vae.decode import decode_frames, tiling_state, vae_scale_factors, vae_tiling_kwargs
from fastwan.vae.tiny_weights import read_tiny_for
from fastwan.pipelines import output
from fastwan.pipelines.output import GenerationResult
from fastwan.checkpoint.resolver import Checkpoint, resolve
from fastwan.checkpoint.causal_files import causal_checkpoint
from fastwan.checkpoint.components import tokenizer_class
from fastwan.pipelines.denoise import cache_report, denoise
from fastwan.pipelines.load_options import LoadOptions
from fastwan.pipelines.params import GenerationRequest
from fastwan.pipelines.request import ResolvedRequest, check_resolved_for, resolve_request
from fastwan.offload.placement import Placement, job_footprint, usable, weight_bytes
from fastwan.pipelines.image import ImageRequest, encode_request
from fastwan.checkpoint.presets import runs_cfg
from fastwan.pipelines.inputs import random_seed
from fastwan.pipelines.setup import attention_config as attention_config_arg, compile_kwargs as compile_kwargs_for
from fastwan.pipelines.step_parallel import check_chords_generator
from fastwan.pipelines.animate_run import animate_frames
from fastwan.pipelines.setup import (cfg_batched, check_load_options, load_scheduler, load_vae, on_device,
                                     set_fp32_precision, sync, trained_attention)
from fastwan.pipelines.text import encode_prompts
from fastwan.pipelines.stream import VideoStream, causal_frames, stream_video
from fastwan.pipelines.vace import VaceRequest, check_vace_generator, vace_run
from fastwan.pipelines.video import VideoRequest, start_latents, steps_run

logger = logging.getLogger("fastwan")

# Rule: loads run one at a time per process. transformers and diffusers build modules under process-wide state
# (meta-device initialisation patches, lazily imported submodules), so two loads in two threads (a server's worker
# per GPU) corrupt each other's modules.
_LOADS = threading.Lock()


class VideoGenerator:
    """Text-to-video with a Wan2.1/Wan2.2 checkpoint. Build with :meth:`from_pretrained`."""

    def __init__(self, ckpt: Checkpoint, *, device, dtype, vae_dtype, attention, transformers, text_encoder,
                 tokenizer, vae, scheduler, cfg_gate_step, cfg_mode, vae_chunk_frames="auto", image_encoder=None,
                 image_processor=None, cache=None, tiny_vae=None):
        self.checkpoint = ckpt
        self.tiny_vae = tiny_vae  # vae="tiny": the decoder that replaces the VAE's (fastwan.vae.tiny), or None
        self.progress_bars = True  # the denoising and decoding bars on stderr (set_progress_bar_config)
        self.cache = cache  # the default step cache of generate_video (a fastwan.cache config, or None)
        self._loras = [LoraState() for _ in transformers]  # per expert: the originals merged LoRAs changed
        self.device, self.dtype, self.vae_dtype = device, dtype, vae_dtype
        self.attention: AttentionDispatch = attention
        self.transformers = transformers  # one or two experts (high noise first)
        self.text_encoder, self.tokenizer, self.vae, self.scheduler = text_encoder, tokenizer, vae, scheduler
        self.cfg_gate_step, self.cfg_mode, self.vae_chunk_frames = cfg_gate_step, cfg_mode, vae_chunk_frames
        self.image_encoder, self.image_processor = image_encoder, image_processor  # CLIP (Wan2.1 I2V / FLF2V)
        self.preset, self.causal = ckpt.preset, ckpt.causal  # causal: a causal checkpoint's CausalRecipe, or None
        # set by from_pretrained(max_gpu_memory=...); _weight_bytes: memory.weight_bytes, computed once
        self.memory_plan = self.max_gpu_memory = self.placement = self._weight_bytes = None
        self.parallel = None  # a fastwan.parallel.Mesh: this process is one rank of from_pretrained(num_gpus=N)
        self.quantization = "fp8" if any(isinstance(m, Fp8Linear) for t in transformers for m in t.modules()) \
            else None
        # generate_video holds this from text encoding to decode: the modules keep per-call caches (the VAE's
        # decode feature cache, the DiT's text K/V cache), so one generator makes one video at a time
        self._lock = threading.Lock()
        # stream_video's state, kept from stream to stream: its decodes' side stream (the allocator reuses a block
        # only on the stream that freed it) and its CUDA graphs with the caches they read (close() frees them)
        self.decode_stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.stream_graphs = ChunkGraphs() if device.type == "cuda" else None

    # ---------------------------------------------------------------------------------------------------------
    @classmethod
    def from_pretrained(
        cls,
        model: str | Path,
        *,
        device: str | torch.device | None = None,
        dtype: torch.dtype | None = None,
        attention_backend: str | AttentionBackend | None = None,
        attention_config: Mapping[str, Any] | str | None = None,
        enable_torch_compile: bool = False,
        torch_compile_kwargs: Mapping[str, Any] | None = None,
        cfg_gate_step: float | None = None,
        cfg_mode: str = "auto",
        vae_dtype: torch.dtype | None = None,
        dit_options: DiTOptions | None = None,
        vae_tiling: bool | Mapping[str, int] = False,
        vae_chunk_frames: int | str = "auto",
        vae: str = "full",
        vae_path: str | Path | None = None,
        cache: CacheConfig | str | None = None,
        lora=None,
        quantization: str | None = None,
        max_gpu_memory: int | str | None = None,
        allow_pickle: bool = False,
        revision: str | None = None,
        num_gpus: int | None = None,
        cfg_parallel: bool = False,
        ring_degree: int | None = None,
        fp32_precision: str = "tf32",
        causal_weights: str | Path | None = None, causal_recipe=None,
    ) -> VideoGenerator:
        """Load ``model`` (Hub id, at ``revision`` if given; Diffusers-format folder; or ``"tiny"``) onto ``device``.

        Each argument is a field of :class:`~fastwan.pipelines.load_options.LoadOptions`, where each is documented;
        they are checked when that object is built, and the rules of this machine and the checkpoint before any
        weight loads. :meth:`load` takes a ``LoadOptions`` itself (e.g. one read from JSON).
        """
        return cls.load(LoadOptions(model=model, **{k: v for k, v in locals().items() if k not in ("cls", "model")}))

    @classmethod
    def load(cls, options: LoadOptions) -> VideoGenerator:
        """A generator loaded as ``options`` say (:meth:`from_pretrained`'s arguments as one checked object). Loads
        run one at a time in a process (:data:`_LOADS`); threads may call this at once."""
        with _LOADS:
            return cls._load(options)

    @classmethod
    def _load(cls, options: LoadOptions) -> VideoGenerator:
        if not isinstance(options, LoadOptions):
            raise InvalidArgumentType(f"options={options!r} must be a fastwan.LoadOptions.")
        o = options
        model, num_gpus, cfg_parallel, cache, vae_chunk_frames = (o.model, o.num_gpus, o.cfg_parallel, o.cache,
                                                                  o.vae_chunk_frames)
        allow_pickle, quantization, cfg_mode, loras = o.allow_pickle, o.quantization, o.cfg_mode, o.lora
        enable_torch_compile, attention_backend = o.enable_torch_compile, o.attention_backend
        # ---- the rules of this machine and the checkpoint (before any weight loads) ----
        launch = parallel_mode(num_gpus, cfg_parallel, o.ring_degree)
        device, dtype, vae_dtype, cfg_gate_step, dit_options = check_load_options(o)
        config = attention_config_arg(o.attention_config)
        budget = o.max_gpu_memory
        if budget is not None and device.type != "cuda":
            raise InvalidArgument(f"max_gpu_memory={budget!r} budgets CUDA memory, but device={device}; "
                                  "leave it unset off CUDA.")
        ckpt = causal_checkpoint(resolve(model, allow_pickle=allow_pickle, revision=o.revision), o)
        check_vace_generator(ckpt, budget)
        mesh = None
        if launch == "join":  # this process is one rank: its own device from here on
            mesh, device = join(ckpt, num_gpus, cfg_parallel, cache, device, o.ring_degree)
        lora_files = check_loras(loras, ckpt.transformer_config, len(ckpt.experts), allow_pickle)
        resolve_coefficients(cache, ckpt.variant, ckpt.transformer_config.inner_dim, ckpt.preset.height,
                             ckpt.preset.width)  # a TeaCache without coefficients for this model raises here
        tiling = vae_tiling_kwargs(o.vae_tiling, ckpt.folder("vae"))
        tiny = read_tiny_for(o.vae_path, ckpt.folder("vae"), allow_pickle, str(model)) if o.vae == "tiny" else None
        attention_backend, config, source = trained_attention(ckpt, attention_backend, config)
        head_dim = ckpt.transformer_config.attention_head_dim
        dit_options = dit_options.resolve(device, dtype)
        attention = AttentionDispatch.resolve(attention_backend, device=device, dtype=dtype, head_dim=head_dim,
                                              config=config, model=ckpt.transformer_config, source=source)
        ring = 1 if launch == "single" else ring_of(ckpt, num_gpus, cfg_parallel, o.ring_degree, attention)
        compile_kwargs = compile_kwargs_for(o.torch_compile_kwargs, attention, ring,
                                            ckpt.causal is not None) if enable_torch_compile else None

        plan = None
        if budget is not None:
            weights = weight_bytes(ckpt, dtype=dtype, vae_dtype=vae_dtype, quantization=quantization)
            fp = job_footprint(ckpt, weights, ckpt.preset, dtype, quantization,
                               lambda tokens: cfg_batched(cfg_mode, device, tokens), vae_chunk_frames)
            plan = plan_offload(fp, usable(budget))
            logger.info("max_gpu_memory %s: %s", budget, plan.describe())
        if launch == "spawn":  # every check passed (a budget too small too); the workers, "join" ranks, load
            call = o.kwargs()
            if call["attention_backend"] is None and context_backend() is not None:  # contexts stay in this process
                call = {**call, "attention_backend": context_backend()}
            return spawn(cls.from_pretrained, model, call, ckpt, num_gpus, cfg_parallel, cache, device,
                         o.ring_degree)
        if plan is not None:
            # offloading allocates and frees weight-sized tensors of many sizes: without expandable segments the
            # caching allocator's partly used blocks (2.4-3.9 GiB seen on an H100) push a planned peak over budget
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
        home = device if plan is None or not plan.levers() else torch.device("cpu")  # offloading loads to the host

        set_fp32_precision(device, o.fp32_precision)
        # ---- loading ----
        from transformers import UMT5EncoderModel

        transformers_ = [
            load_transformer(ckpt.folder(e), dtype=dtype, device=home, attention=attention, options=dit_options,
                             allow_pickle=allow_pickle, quantization=quantization, compute_device=device,
                             tensors=ckpt.dit_weights)
            for e in ckpt.experts
        ]
        if enable_torch_compile:
            for t in transformers_:
                t.compile_blocks(**compile_kwargs)
        tokenizer = tokenizer_class(ckpt.index).from_pretrained(ckpt.folder("tokenizer"))
        text_encoder = UMT5EncoderModel.from_pretrained(
            ckpt.folder("text_encoder"), dtype=dtype, use_safetensors=None if allow_pickle else True,
            variant=ckpt.variants.get("text_encoder")).to(home).eval()
        vae = load_vae(ckpt.folder("vae"), vae_dtype, device, dit_options.fast, tiling, allow_pickle,
                       ckpt.variants.get("vae"))
        scheduler = load_scheduler(ckpt)
        image_encoder = image_processor = None
        if ckpt.image_encoder:
            from transformers import CLIPImageProcessor, CLIPVisionModel

            image_encoder = CLIPVisionModel.from_pretrained(
                ckpt.folder("image_encoder"), dtype=dtype, use_safetensors=None if allow_pickle else True,
                variant=ckpt.variants.get("image_encoder")).to(home).eval()
            image_processor = CLIPImageProcessor.from_pretrained(ckpt.folder("image_processor"))
        gen = cls(ckpt, device=device, dtype=dtype, vae_dtype=vae_dtype, attention=attention,
                  transformers=transformers_, text_encoder=text_encoder, tokenizer=tokenizer, vae=vae,
                  scheduler=scheduler, cfg_gate_step=cfg_gate_step, cfg_mode=cfg_mode,
                  vae_chunk_frames=vae_chunk_frames, image_encoder=image_encoder, image_processor=image_processor,
                  cache=cache, tiny_vae=None if tiny is None else tiny.load(vae_dtype, device))
        for (path, scale, expert), tensors in zip(loras, lora_files):
            apply_lora(gen.transformers, gen._loras, path, scale, expert, tensors=tensors, device=device)
        if plan is not None:
            gen.memory_plan, gen.max_gpu_memory, gen._weight_bytes = plan, budget, weights
            gen.placement = Placement(plan, device, transformers=transformers_, text_encoder=text_encoder,
                                      image_encoder=image_encoder, vae=vae)
        if mesh is not None:
            gen.parallel = mesh
            for t in transformers_ if mesh.sp is not None else ():
                apply_sequence_parallel(t, mesh.sp)
        return gen

    def load_lora(self, path: str | Path, scale: float = 1.0, expert: int | None = None, *,
                  allow_pickle: bool = False) -> None:
        """Merge a LoRA file into the DiT weights (:mod:`fastwan.lora`: diffusers/PEFT or original-Wan keys);
        ``expert``: 0 (high noise) or 1 for one Wan2.2 A14B expert, None for all; ``scale``: any finite number (0
        changes nothing, a negative one subtracts the update, as diffusers' adapter weights do). Safetensors only
        unless ``allow_pickle=True`` (a .pt / .bin / .ckpt file you trust, read weights-only). Checked before any
        change, a merged weight that would overflow its dtype (inf) included. On FP8 weights the update merges into
        the dequantized weight, which is quantized again."""
        with self._lock:
            apply_lora(self.transformers, self._loras, path, scale, expert, allow_pickle=allow_pickle,
                       device=self.device)

    def unload_lora(self) -> None:
        """Restore every weight the loaded LoRAs changed, bit for bit."""
        with self._lock:
            for state in self._loras:
                state.restore()

    # ---------------------------------------------------------------------------------------------------------
    @property
    def vae_scale_factors(self) -> tuple[int, int]:
        """(temporal, spatial) latent compression of the VAE."""
        return vae_scale_factors(self.vae)

    def _check_backend_context(self) -> None:
        """Rule: the attention backend is fixed when the generator is built; an ``attention_backend()`` context
        around a call must name the one it runs (a context meant for the call would otherwise go unheard)."""
        scoped = context_backend()
        if scoped is None:
            return
        name = scoped.name if isinstance(scoped, AttentionBackend) else str(scoped).strip().upper()
        built = self.attention.self_backend.name
        if name != built:
            raise InvalidArgument(
                f"an attention_backend({name!r}) context is active, but this generator was built with {built}; the "
                "backend is chosen when the model loads: enter the context around VideoGenerator.from_pretrained "
                "(or pass attention_backend= there).")

    def _identity(self, negative_prompt: str, settings: Mapping[str, Any], images: str | None) -> dict[str, Any]:
        """Everything but the prompt and seed that determines the video (for the automatic file name's digest)."""
        backends = (self.attention.self_backend, self.attention.cross_backend)
        return {"model": str(Path(self.checkpoint.root).resolve()), "negative_prompt": negative_prompt,
                "settings": dict(settings), "dtype": str(self.dtype), "vae_dtype": str(self.vae_dtype),
                "quantization": self.quantization, "vae_tiling": tiling_state(self.vae),
                "attention": [repr((b.name, b.settings())) for b in backends], "images": images,
                "loras": [state.loaded for state in self._loras],
                **({"tiny_vae": self.tiny_vae.digest} if self.tiny_vae is not None else {}),
                **({"causal": [repr(self.causal), str(self.checkpoint.dit_weights)]} if self.causal else {})}

    def _check_budget(self, s) -> None:
        """Under a memory budget: each video gets the plan the planner picks for it (the planner raises when
        nothing fits), carried out before any compute when it differs from the current one."""
        if self.memory_plan is None:
            return
        fp = job_footprint(self.checkpoint, self._weight_bytes, s, self.dtype, self.quantization, self._cfg_batched,
                           self.vae_chunk_frames)
        plan = plan_offload(fp, usable(self.max_gpu_memory))
        if plan.levers() == self.memory_plan.levers():
            return
        logger.info("max_gpu_memory: a %dx%dx%d video needs a new plan: %s", s.height, s.width, s.num_frames,
                    plan.describe())
        with self._lock:  # not while another thread's video runs
            self.placement.detach()
            self.memory_plan = plan
            self.placement = Placement(plan, self.device, transformers=self.transformers,
                                       text_encoder=self.text_encoder, image_encoder=self.image_encoder, vae=self.vae)

    # ---------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def generate_video(
        self,
        prompt: str,
        *,
        image: Any = None,
        last_image: Any = None,
        video: Any = None,
        mask: Any = None, reference_images: Any = None, conditioning_scale: Any = None,  # VACE
        pose_video: Any = None, face_video: Any = None, background_video: Any = None, mask_video: Any = None,  # Animate
        mode: str | None = None, segment_frames: int | None = None, overlap: int | None = None, motion_batch_size=None,
        strength: float | None = None,
        negative_prompt: str | None = None,
        height: int | None = None,
        width: int | None = None,
        num_frames: int | None = None,
        num_inference_steps: int | None = None,
        guidance_scale: float | None = None,
        guidance_scale_2: float | None = None,
        seed: int | None = None,
        fps: int | None = None,
        output_path: str | Path = "outputs/",
        save_video: bool = True,
        return_frames: bool = True,
        overwrite: bool = False,
        cache: CacheConfig | str | None = None,
        sampler: str | None = None,
        timesteps=None,
        flow_shift: float | None = None,
        parallel_sampling: str | None = None,
        chords_cores: int | None = None,
        chords_init=None,
    ) -> GenerationResult:
        """Make one video. Each argument is a field of :class:`~fastwan.pipelines.params.GenerationRequest`
        (documented there); ``None`` fields take the checkpoint's preset (``self.preset``). The same as
        ``self.generate(GenerationRequest(prompt, ...))``.
        """
        return self.generate(GenerationRequest(**{k: v for k, v in locals().items() if k != "self"}))

    @torch.no_grad()
    def resolve(self, request: GenerationRequest) -> ResolvedRequest:
        """``request`` resolved for this generator's checkpoint (the preset filling unset fields, every rule of the
        checkpoint checked), with no compute; :meth:`generate` takes the result."""
        return resolve_request(self.checkpoint, self.scheduler, self.vae_scale_factors, request, self.cache)

    @torch.no_grad()
    def generate(self, request: GenerationRequest | ResolvedRequest, *,
                 on_step: Callable[[int, int], None] | None = None) -> GenerationResult:
        """Make the video ``request`` describes (a :class:`~fastwan.pipelines.params.GenerationRequest`, or one
        resolved for this checkpoint by :meth:`resolve` or :func:`~fastwan.pipelines.request.resolve_request`).

        ``seed`` None draws a new random one; the seed used is ``result.seed`` and part of the automatic file name,
        so passing it back makes the same video. ``output_path``: a ``.mp4`` path (any case) is the file, anything
        else a folder where the file gets the automatic name ``<prompt slug>_<seed>_<digest>.mp4``; no file is
        replaced unless ``overwrite``; the file appears only when complete (:mod:`fastwan.pipelines.output`). Every
        check runs before any compute. Calls on one generator from several threads run one at a time (a
        per-instance lock).

        ``on_step(done, total)``, when given, is called on the host after each denoising step (a progress report);
        an exception it raises (e.g. to cancel) ends the call and propagates, and no file is written."""
        self._check_backend_context()
        if isinstance(request, ResolvedRequest):
            check_resolved_for(request, self.checkpoint)
            plan = request
        else:
            plan = self.resolve(request)
        r, s, req, cache = plan.request, plan.settings, plan.image, plan.cache
        self.attention.layout_for(plan.grid, self.device)  # the attention backend's grid rules
        self._check_budget(s)
        if self.parallel is not None:
            self.parallel.check_cache(cache)
        if plan.chords is not None:
            check_chords_generator(self, r.chords_cores)
        target = output.check_output_path(r.output_path, r.overwrite)
        seed = random_seed() if r.seed is None else r.seed
        negative_prompt = plan.negative_prompt
        settings = {**s.__dict__, "cfg_gate_step": self.cfg_gate_step, "cfg_mode": self.cfg_mode,
                    "vae_chunk_frames": self.vae_chunk_frames, "cache": repr(cache)}
        settings.update(plan.identity())  # the inputs that make the video besides the settings
        save_video = r.save_video
        if save_video:  # every rank checks, so a bad path fails on all of them before compute; one rank writes
            output.prepare_output(target)  # folder created and writable, explicit file free (or overwrite)
        save_video = save_video and (self.parallel is None or self.parallel.writes)
        logger.info("video: %s, seed %d", plan.describe(), seed)

        with self._lock, on_device(self.device):
            frames, forwards, timings, peak, report = self._generate(r.prompt, negative_prompt, s, seed, req,
                                                                     (cache, plan.coefficients), on_step,
                                                                     plan.video, plan.chords, plan.vace, plan.animate)
        t0 = time.perf_counter()
        video_file = None
        if save_video:
            name = output.automatic_name(r.prompt, seed,
                                         self._identity(negative_prompt, settings, req and req.digest))
            video_file = output.save_video(target, name, frames, s.fps)
        timings["saving"] = time.perf_counter() - t0
        timings["total"] = timings.pop("total") + timings["saving"]  # total last
        return GenerationResult(
            frames=frames if r.return_frames else None, video_path=str(video_file) if video_file else None,
            seed=seed, timings=timings, attention_backend=self.attention.describe(self.device), peak_memory=peak,
            num_transformer_forwards=forwards, settings=settings, cache=report,
        )

    def _generate(self, prompt: str, negative_prompt: str, s, seed: int, req: ImageRequest | None = None,
                  cache: tuple = (None, None), on_step: Callable[[int, int], None] | None = None,
                  video: VideoRequest | None = None, chords: tuple[int, ...] | None = None,
                  vace: VaceRequest | None = None, animate=None):
        """Text (and image) encoding, denoising, decoding (the caller holds ``self._lock``) -> (frames, transformer
        forwards, timings in seconds, peak CUDA memory in bytes or None, the step cache's report or None).
        ``cache``: (step cache config or None, TeaCache coefficients or None)."""
        if self.checkpoint.causal is not None:  # a causal checkpoint: its stream's chunks, joined
            return causal_frames(self, prompt, s, seed, on_step)
        if animate is not None:  # Wan2.2-Animate: segment by segment
            return animate_frames(self, prompt, negative_prompt, s, seed, animate, on_step)
        dev = self.device
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        t0 = time.perf_counter()
        do_cfg = runs_cfg(s)
        texts = [prompt, negative_prompt] if do_cfg else [prompt]
        with self._phase("encoding"):
            emb = encode_prompts(texts, self.tokenizer, self.text_encoder, device=dev, dtype=self.dtype)
            cond = None
            if req is not None:
                cond = encode_request(req, s.height, s.width, s.num_frames, self.vae, self.image_encoder,
                                      self.image_processor, dev, self.dtype)
            start = None  # video-to-video: the video's clean latents and the steps that run from them
            if video is not None:
                start = (start_latents(self.vae, video, s.height, s.width, self.vae_scale_factors[1]),
                         steps_run(s.num_inference_steps, video.strength))
        sync(dev)
        t1 = time.perf_counter()
        run = None if cache[0] is None else CacheRun(cache[0], s.num_inference_steps, cache[1])
        with self._phase("denoising"), vace_run(self, vace, s) as (denoised, crop):  # VACE: its control, frames
            latents, forwards = self._denoise(emb, denoised, seed, do_cfg, cond, run, on_step, start, chords)
            latents = crop(latents)
        sync(dev)
        t2 = time.perf_counter()
        frames = self._decode(latents) if self.parallel is None or self.parallel.writes else None
        sync(dev)
        t3 = time.perf_counter()
        timings = {"text_encoding": t1 - t0, "denoising": t2 - t1, "decoding": t3 - t2, "total": t3 - t0}
        peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
        return frames, forwards, timings, peak, None if run is None else cache_report(run, self.parallel)

    # ---------------------------------------------------------------------------------------------------------
    def _denoise(self, emb: torch.Tensor, s, seed: int, do_cfg: bool, image_inputs=None,
                 run: CacheRun | None = None, on_step=None, start=None, chords=None) -> tuple[torch.Tensor, int]:
        """The denoising loop (:func:`fastwan.pipelines.denoise.denoise`)."""
        return denoise(self, emb, s, seed, do_cfg, image_inputs, run, on_step=on_step, start=start, chords=chords)

    def _cfg_batched(self, tokens: int) -> bool:
        """Whether CFG runs as one batch of 2 (else two batch-1 passes), from ``cfg_mode``. "auto": two passes
        on CUDA from AUTO_SEQUENTIAL_TOKENS tokens per sample up (each pass fills the GPU alone; measured on an
        H100 at 32,760 tokens: 1.1-1.3% faster per step, less memory), one batch below that or off CUDA."""
        batched = cfg_batched(self.cfg_mode, self.device, tokens)
        if self.cfg_mode != "auto":
            return batched
        logger.info("cfg_mode='auto': %s CFG (%d tokens per sample)", "batched" if batched else "sequential",
                    tokens)
        return batched

    def _phase(self, name: str):
        """Under a memory plan, the components of phase ``name`` ("encoding", "denoising") on the GPU for its
        duration; otherwise nothing."""
        return contextlib.nullcontext() if self.placement is None else getattr(self.placement, name)()

    def _decode(self, latents: torch.Tensor) -> np.ndarray:
        """latents [1, C, F, H, W] -> uint8 frames [T, H, W, 3] (with the tiny decoder under vae="tiny")."""
        if self.tiny_vae is not None:
            return self.tiny_vae.frames(latents, self.vae_chunk_frames)
        return decode_frames(self.vae, latents, self.vae_chunk_frames, self.progress_bars)

    def stream_video(self, prompt: str, **kwargs) -> VideoStream:
        """A causal checkpoint's video as it is made: :func:`fastwan.pipelines.stream.stream_video`."""
        return stream_video(self, prompt, **kwargs)

    def set_progress_bar_config(self, *, disable: bool) -> None:
        """``disable=True``: no denoising or decoding progress bar on stderr from now on (a server writing a log,
        a caller drawing its own progress from ``on_step``); ``False`` shows them again. The one setting of
        diffusers' method of that name that fastwan reads."""
        if not isinstance(disable, bool):
            raise InvalidArgumentType(f"disable={disable!r} must be True or False.")
        self.progress_bars = not disable
