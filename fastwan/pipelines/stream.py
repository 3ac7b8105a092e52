"""Streaming video from a causal Wan checkpoint: :func:`stream_video` and its per-chunk rule :func:`sample_chunk`.

The video is made ``recipe.frames_per_chunk`` latent frames at a time (:class:`fastwan.checkpoint.causal.
CausalRecipe`). Each chunk (Self-Forcing's inference loop):

1. starts from fresh noise and runs the recipe's steps ``t_0 > t_1 > ...`` (after the warp); at step ``i`` the DiT's
   flow prediction ``v`` gives the clean estimate ``x0 = x - sigma_i v`` (``recipe.sigma``), and, before any step
   but the last, the next input is ``x0`` noised again to the next level with fresh noise,
   ``(1 - sigma_{i+1}) x0 + sigma_{i+1} noise``;
2. the last ``x0`` is the chunk; the VAE decodes it with its causal feature cache
   (:class:`fastwan.vae.stream.StreamDecoder`) and its frames leave: at once, or, with ``overlap_decode`` (the
   default on CUDA), once the next chunk's DiT work is queued, its decode on a side CUDA stream running beside that
   DiT (:mod:`fastwan.pipelines.stream_decode`);
3. before the next chunk's steps, the DiT runs once more on the clean chunk at timestep ``context_noise`` with
   ``write=True``, so the cache holds its keys and values (:func:`write_chunk`, :class:`fastwan.models.wan.causal.
   CausalRun`). A chunk's frames never wait for its own write: a chunk that leaves at once (serial; the first
   chunk overlapped) is handed out before its write is queued; one that stays queued (overlapped) has its write
   queued before the host waits for the chunk ahead of it, so the device has that work in hand meanwhile. The
   last chunk of a finite stream has no write (no chunk reads it).

The stream has no length limit when ``num_frames`` is None: with the recipe's (or the caller's) window of frames
the caches stay one size. :meth:`VideoStream.switch_prompt` changes the text of the chunks that follow.
"""
from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch

from fastwan.checkpoint.causal import CausalRecipe
from fastwan.errors import InvalidArgument, InvalidArgumentType
from fastwan.models.wan.causal import CausalRun
from fastwan.hooks import HookRegistry
from fastwan.pipelines.inputs import check_frame_size, random_seed
from fastwan.pipelines.params import check_field
from fastwan.pipelines.setup import on_device
from fastwan.pipelines.stream_decode import DecodeQueue
from fastwan.pipelines.text import encode_prompts


@dataclass(frozen=True)
class StreamChunk:
    """One chunk of a stream: ``frames`` uint8 [t, H, W, 3], the index of its first frame in the video
    (``first_frame``), its chunk ``index``, the ``prompt`` it was made from, and ``timings`` in seconds: ``text``
    (encoding a new prompt, else 0), ``dit`` (the denoising steps), ``kv_write`` (the cache write that ran before
    this chunk's steps: the previous chunk's, 0 for the first), ``decode`` (the VAE decode and the frames' copy to
    the host), and ``elapsed`` (host time from the start of the stream until these frames were on the host).
    Serial, the first four are host times with the device synchronised around each, and they add up to the time
    between the previous chunk's hand-out and this one's. Overlapped on CUDA they are GPU times between CUDA events
    on the stream that ran the work: ``text``, ``dit`` and ``kv_write`` on the main stream, ``decode`` on the side
    stream, where it shared the GPU with the next chunk's DiT; they add up to more than the wall time, and
    ``elapsed`` between chunks is the sustained rate."""
    frames: np.ndarray
    first_frame: int
    index: int
    prompt: str
    timings: dict


def sample_chunk(run: CausalRun, noise: torch.Tensor, text: torch.Tensor, recipe: CausalRecipe,
                 generator: torch.Generator) -> torch.Tensor:
    """A chunk's steps by the recipe's rule (step 1 of the module docstring): ``noise`` [B, C, f, h, w] fp32 at the
    run's next frame -> the clean chunk [B, C, f, h, w] fp32 (not yet in the cache: :func:`write_chunk`).
    ``generator`` draws the noise of each re-noising, in order."""
    schedule = recipe.schedule()
    x = noise
    x0 = None
    dtype = next(run.model.parameters()).dtype
    for i, t in enumerate(schedule):
        flow = run.forward(x.to(dtype), torch.full((1,), t, device=x.device, dtype=torch.float32), text)
        x0 = x - recipe.sigma(t) * flow.float()
        if i + 1 < len(schedule):
            s = recipe.sigma(schedule[i + 1])
            fresh = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
            x = (1.0 - s) * x0 + s * fresh
    return x0


def write_chunk(run: CausalRun, x0: torch.Tensor, text: torch.Tensor, recipe: CausalRecipe) -> None:
    """Step 3 of the module docstring: the clean chunk ``x0`` [B, C, f, h, w] (from :func:`sample_chunk`, with the
    ``text`` it was made from) runs at timestep ``recipe.context_noise`` with a cache write; the run moves past it."""
    dtype = next(run.model.parameters()).dtype
    run.forward(x0.to(dtype), torch.full((1,), recipe.context_noise, device=x0.device, dtype=torch.float32), text,
                write=True)  # timesteps made on the device without a host copy: nothing here waits for the GPU


def chunk_plan(num_frames: int | None, recipe: CausalRecipe, temporal: int) -> int | None:
    """The number of chunks of a ``num_frames`` video (None: endless). Rule: the video's latent frames,
    (num_frames - 1) / temporal + 1, are a whole number of chunks."""
    if num_frames is None:
        return None
    f = recipe.frames_per_chunk
    if isinstance(num_frames, bool) or not isinstance(num_frames, int):
        raise InvalidArgumentType(f"num_frames={num_frames!r} must be an int or None (endless).", field="num_frames")
    latent, rest = divmod(num_frames - 1, temporal)
    if num_frames < 1 or rest or (latent + 1) % f:
        step = temporal * f  # video frames per chunk after the first chunk's
        below = (num_frames + temporal - 1) // step
        options = [step * k - (temporal - 1) for k in (below, below + 1) if k >= 1]
        raise InvalidArgument(
            f"num_frames={num_frames}: a causal stream makes {f} latent frames per chunk, so num_frames must be "
            f"{step} x chunks - {temporal - 1} ({step - temporal + 1}, {2 * step - temporal + 1}, ...); use "
            f"{' or '.join(map(str, options))}, or None to stream without end.", field="num_frames")
    return (latent + 1) // f


@dataclass(frozen=True)
class StreamSettings:
    """A stream's checked settings (see :func:`stream_video`)."""
    height: int
    width: int
    num_frames: int | None
    seed: int
    fps: int
    recipe: CausalRecipe
    chunks: int | None  # chunks of the video (:func:`chunk_plan`); None: endless
    overlap_decode: bool  # a chunk's decode overlaps the next chunk's DiT (:mod:`fastwan.pipelines.stream_decode`)
    cuda_graphs: bool = False  # chunk forwards replay CUDA graphs (:mod:`fastwan.models.wan.causal_graph`)


def stream_settings(gen, *, height=None, width=None, num_frames=None, seed=None, fps=None,
                    window_frames: int | None | str = "recipe", sink_frames: int | str = "recipe",
                    overlap_decode: bool | None = None, cuda_graphs: bool | None = None) -> StreamSettings:
    """Check a stream's arguments for ``gen`` before any compute (every rule named with its fix): height, width,
    seed and fps by the request fields' own rules (:func:`~fastwan.pipelines.params.check_field`), the frame size
    by the checkpoint's (:func:`~fastwan.pipelines.inputs.check_frame_size`), num_frames by the chunks'."""
    recipe = gen.checkpoint.causal
    if recipe is None:
        raise InvalidArgument(
            f"{gen.checkpoint.root} is not a causal checkpoint: stream_video needs a causal (Self-Forcing, "
            "CausVid) DiT; load one (a WanCausalDMDPipeline folder, or causal_weights=<generator file>), or use "
            "generate_video for this one.")
    if gen.parallel is not None:
        raise InvalidArgument("stream_video runs in one process: num_gpus > 1 is not supported for causal "
                              "streams; load with num_gpus=1.")
    if gen.cache is not None:
        raise InvalidArgument(f"a step cache (cache={gen.cache!r}) does not apply to a causal stream's few steps; "
                              "load without cache=.")
    if getattr(gen.attention, "sparse", False):
        raise InvalidArgument("a causal stream needs a dense attention backend (its chunks attend to a cache); "
                              "load with a dense attention_backend (e.g. TORCH_SDPA, FLASH_ATTN).")
    preset = gen.preset
    height, width, seed, fps = (check_field(name, value) for name, value in
                                (("height", height), ("width", width), ("seed", seed), ("fps", fps)))
    height = preset.height if height is None else height
    width = preset.width if width is None else width
    check_frame_size(height, width, spatial=gen.vae_scale_factors[1],
                     patch=gen.checkpoint.transformer_config.patch_size)
    chunks = chunk_plan(num_frames, recipe, gen.vae_scale_factors[0])
    changes = {}
    if window_frames != "recipe":
        changes["window_frames"] = window_frames
    elif recipe.window_frames is None and (chunks is None or chunks * recipe.frames_per_chunk > recipe.context_frames):
        changes["window_frames"] = recipe.context_frames  # longer than the trained context: its window, rolled
    if sink_frames != "recipe":
        changes["sink_frames"] = sink_frames
    recipe = dataclasses.replace(recipe, **changes) if changes else recipe
    fps = preset.fps if fps is None else fps
    if overlap_decode is None:
        overlap_decode = gen.device.type == "cuda"
    elif not isinstance(overlap_decode, bool):
        raise InvalidArgumentType(f"overlap_decode={overlap_decode!r} must be True, False or None (True on CUDA).")
    cuda_graphs = check_cuda_graphs(cuda_graphs, gen, recipe)
    seed = random_seed() if seed is None else seed
    return StreamSettings(height, width, num_frames, seed, fps, recipe, chunks, overlap_decode, cuda_graphs)


def check_cuda_graphs(cuda_graphs, gen, recipe: CausalRecipe) -> bool:
    """Rule: ``cuda_graphs`` is True, False or None (True where it can run); True needs a CUDA device, a rolling
    window (the caches keep one set of buffers only at a window's size; without one they grow, and every chunk
    attends to more frames) and no other hook on the DiT (block streaming moves weights in Python between blocks).
    -> whether the stream replays graphs."""
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise InvalidArgumentType(f"cuda_graphs={cuda_graphs!r} must be True, False or None (True where it can run).")
    model = gen.transformers[0]
    hooks = [name for name in HookRegistry.of(model).names() if name != CausalRun.name]
    why = ("this stream has no window (every earlier frame is kept); pass window_frames=N"
           if recipe.window_frames is None else
           f"this generator is on {gen.device}" if gen.device.type != "cuda" else
           f"the DiT carries hooks {hooks} (e.g. block streaming under a memory budget)" if hooks else None)
    if cuda_graphs and why is not None:
        raise InvalidArgument(f"cuda_graphs=True replays chunk forwards captured on a CUDA device, on caches of a "
                              f"window's size, through the DiT alone, and {why}; or leave cuda_graphs unset.")
    return why is None if cuda_graphs is None else cuda_graphs


class VideoStream:
    """An iterator of :class:`StreamChunk` (see :func:`stream_video`); ``switch_prompt`` changes the text of the
    chunks made after it; ``close()`` (or leaving a ``with`` block, or the end) frees the caches and the
    generator."""

    def __init__(self, gen, prompt: str, settings: StreamSettings, *, locked: bool = False):
        self.gen, self.settings = gen, settings
        self.seed = settings.seed
        self._prompt = _check_prompt(prompt)
        from fastwan.vae.stream import StreamDecoder

        vae = gen.tiny_vae if gen.tiny_vae is not None else gen.vae  # its tiling rule checked here, before compute
        self._decoder = StreamDecoder(vae, gen.vae_chunk_frames, height=settings.height, width=settings.width)
        self._chunks = self._run(contextlib.nullcontext() if locked else gen._lock)

    def switch_prompt(self, prompt: str) -> None:
        """The chunks started from now on follow ``prompt`` (the frames already made, and the cache, stay). With
        ``overlap_decode`` the chunk after the last one handed out is already started: the switch applies from
        the one after it."""
        self._prompt = _check_prompt(prompt)

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        return next(self._chunks)

    def close(self) -> None:
        self._chunks.close()
        self._decoder.close()

    def __enter__(self) -> VideoStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _run(self, lock) -> Iterator[StreamChunk]:
        gen, s, decoder = self.gen, self.settings, self._decoder
        recipe, dev = s.recipe, gen.device
        model = gen.transformers[0]
        _, spatial = gen.vae_scale_factors
        chunks = s.chunks
        shape = (1, model.config.in_channels, recipe.frames_per_chunk, s.height // spatial, s.width // spatial)
        start = time.perf_counter()
        with lock, on_device(dev), torch.no_grad():
            generator = torch.Generator(device=dev).manual_seed(self.seed)
            texts: dict[str, torch.Tensor] = {}
            graphs = gen.stream_graphs if s.cuda_graphs else None
            with CausalRun(model, recipe.window_frames, recipe.sink_frames, graphs) as run, decoder:
                queue = DecodeQueue(decoder, dev, s.overlap_decode, gen.decode_stream)
                clock = queue.clock
                timed = _Timed(run, clock)
                index, first = 0, 0
                due = None  # (x0, text) of the last chunk made: its cache write runs before the next chunk's steps
                try:
                    while chunks is None or index < chunks:
                        if due is not None:
                            timed.write_chunk(*due, recipe)
                        prompt = self._prompt
                        text = None
                        if prompt not in texts:  # one encoding per prompt (the DiT keys its text once per prompt)
                            t0 = clock.mark()
                            texts.clear()
                            texts[prompt] = encode_prompts([prompt], gen.tokenizer, gen.text_encoder, device=dev,
                                                           dtype=gen.dtype)
                            text = (t0, clock.mark())
                        t1 = clock.mark()
                        noise = torch.randn(shape, generator=generator, device=dev, dtype=torch.float32)
                        x0 = sample_chunk(run, noise, texts[prompt], recipe, generator)
                        index += 1
                        stays = queue.may_wait(index, index == chunks)
                        queue.put(x0, _Made(index - 1, prompt, text, (t1, clock.mark()), timed.write),
                                  at_once=not stays)
                        due = x0, texts[prompt]
                        if stays and index != chunks:  # its frames leave later: the write goes before the wait
                            timed.write_chunk(*due, recipe)
                            due = None
                        while queue.waiting > stays:
                            chunk = _hand_out(queue, first, start)
                            first += len(chunk.frames)
                            yield chunk
                finally:
                    queue.drop()


@dataclass(frozen=True)
class _Made:
    """A chunk in the decode queue: its index, prompt, and clock marks (text: None when no prompt was encoded)."""
    index: int
    prompt: str
    text: tuple | None
    steps: tuple  # around the chunk's noise and steps
    write: tuple  # around the previous chunk's cache write, which ran before them (empty: none)


def _hand_out(queue: DecodeQueue, first: int, start: float) -> StreamChunk:
    """The queue's oldest chunk, once on the host, with its timings (:class:`StreamChunk`)."""
    frames, decode_s, made = queue.pop()
    seconds = queue.clock.seconds
    write = seconds(*made.write) if made.write else 0.0
    timings = {"text": 0.0 if made.text is None else seconds(*made.text), "dit": seconds(*made.steps),
               "kv_write": write, "decode": decode_s, "elapsed": time.perf_counter() - start}
    return StreamChunk(frames, first, made.index, made.prompt, timings)


class _Timed:
    """The cache writes of a :class:`CausalRun`, timed by ``clock`` (``write``: the last one's two marks)."""

    def __init__(self, run: CausalRun, clock):
        self._run, self._clock = run, clock
        self.write: tuple = ()

    def write_chunk(self, x0: torch.Tensor, text: torch.Tensor, recipe: CausalRecipe) -> None:
        t0 = self._clock.mark()
        write_chunk(self._run, x0, text, recipe)
        self.write = (t0, self._clock.mark())


def _check_prompt(prompt) -> str:
    if not isinstance(prompt, str) or not prompt.strip():
        raise InvalidArgument(f"prompt={prompt!r} must be a non-empty string.")
    return prompt


def stream_video(gen, prompt: str, **kwargs) -> VideoStream:
    """A :class:`VideoStream` of ``prompt`` from the causal generator ``gen``; every argument is checked before any
    compute (:func:`stream_settings`). ``num_frames`` None streams without end (stop by closing the stream);
    ``window_frames`` / ``sink_frames`` override the checkpoint's recipe (None: every earlier frame). Without a window
    in the recipe or the call, a stream longer than the recipe's ``context_frames`` rolls a window of that many.
    ``overlap_decode`` (None: True on CUDA, False elsewhere) decodes each chunk while the next one's DiT runs
    (:mod:`fastwan.pipelines.stream_decode`); the frames are the same either way. ``cuda_graphs`` (None: True on
    CUDA with a window, the fast DiT and no block streaming) replays captured chunk forwards, kept by the generator
    for later streams (:mod:`fastwan.models.wan.causal_graph`; ``gen.stream_graphs.close()`` frees them and the
    caches they read); the frames are the same."""
    return VideoStream(gen, prompt, stream_settings(gen, **kwargs))


# the request fields a causal checkpoint's recipe decides (steps, sampling, guidance) or that it has no input for
NOT_CAUSAL = ("image", "last_image", "video", "mask", "reference_images", "conditioning_scale", "strength",
              "negative_prompt", "num_inference_steps", "guidance_scale", "guidance_scale_2", "sampler", "timesteps",
              "flow_shift", "parallel_sampling", "chords_cores", "chords_init")


def check_causal_request(request, recipe: CausalRecipe, temporal: int) -> None:
    """A generation request for a causal checkpoint: none of :data:`NOT_CAUSAL` set, no step cache, and a
    ``num_frames`` that is a whole number of chunks (:func:`chunk_plan`)."""
    for name in NOT_CAUSAL:
        value = getattr(request, name)
        if value is not None:
            raise InvalidArgument(
                f"{name}={value!r} does not apply to a causal checkpoint: it makes text-to-video chunk by chunk with "
                f"its own recipe ({len(recipe.timesteps)} steps per chunk of {recipe.frames_per_chunk} latent "
                "frames, no guidance); leave it unset.", field=name)
    if request.cache not in (None, "none"):
        raise InvalidArgument(f"cache={request.cache!r} does not apply to a causal checkpoint's few steps per chunk; "
                              "leave it unset.", field="cache")
    if request.num_frames is not None:
        chunk_plan(request.num_frames, recipe, temporal)


def causal_frames(gen, prompt: str, s, seed: int, on_step=None):
    """``generate``'s compute for a causal checkpoint (the caller holds the generator's lock): the stream of
    ``s``'s size and frames, its chunks joined -> (frames uint8 [T, H, W, 3], DiT forwards, timings, peak CUDA
    bytes or None, None). ``on_step(done, total)`` is called after each chunk (chunks, not steps)."""
    dev = gen.device
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    settings = stream_settings(gen, height=s.height, width=s.width, num_frames=s.num_frames, seed=seed, fps=s.fps)
    total = settings.chunks
    parts, sums, elapsed = [], {"text": 0.0, "dit": 0.0, "kv_write": 0.0, "decode": 0.0}, 0.0
    for chunk in VideoStream(gen, prompt, settings, locked=True):
        parts.append(chunk.frames)
        for key in sums:
            sums[key] += chunk.timings[key]
        elapsed = chunk.timings["elapsed"]
        if on_step is not None:
            on_step(chunk.index + 1, total)
    # overlapped decodes run beside the DiT: the total is the stream's wall time, not the parts' sum
    timings = {"text_encoding": sums["text"], "denoising": sums["dit"] + sums["kv_write"],
               "decoding": sums["decode"], "total": elapsed if settings.overlap_decode else sum(sums.values())}
    peak = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    forwards = total * (len(settings.recipe.timesteps) + 1) - 1  # the last chunk has no cache write
    return np.concatenate(parts), forwards, timings, peak, None


__all__ = ["NOT_CAUSAL", "StreamChunk", "VideoStream", "causal_frames", "check_causal_request", "chunk_plan",
           "sample_chunk", "stream_settings", "stream_video", "write_chunk"]
