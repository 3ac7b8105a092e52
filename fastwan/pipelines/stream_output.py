"""An mp4 that plays while it grows: a streamed video (``fastwan generate --stream``) written chunk by chunk at the
user's path, each frame readable as soon as the encoder has it.

:class:`VideoStreamWriter` follows :mod:`fastwan.pipelines.output`'s rules for where the video goes (a checked
:class:`~fastwan.pipelines.output.OutputTarget`; an explicit file that exists is refused unless ``overwrite``; an
automatic name takes its first free ``-2``, ``-3``, ... variant) and its encoder (H.264, yuv420p, the same quality:
:data:`~fastwan.pipelines.output.ENCODER`). Rules of the stream:

- The name is claimed when the writer is made (an exclusive create: an empty file appears at once, so no other
  writer takes it while the first chunk is computed); ffmpeg starts at the first :meth:`~VideoStreamWriter.append`,
  which fixes the frame size.
- Fragmented mp4 (``-movflags frag_every_frame+empty_moov+default_base_moof``: the header first, then one fragment a
  frame), each packet flushed to the file (``-flush_packets 1``) and the encoder without lookahead or B-frames
  (``-tune zerolatency``; x264 would otherwise hold ~40 frames). The muxer writes a frame's fragment when the next
  frame reaches it, so once ffmpeg has read an appended chunk, every frame but its last is in the file, and that
  one follows with the next chunk or :meth:`~VideoStreamWriter.close`. A reader of the growing file sees a valid
  mp4 of those frames.
- Never half-write a user's file: a stream that does not reach :meth:`~VideoStreamWriter.close` (an exception or an
  interrupt in the ``with`` block, :meth:`~VideoStreamWriter.abort`, an encoder failure) is removed, and a file it
  replaced under ``overwrite`` (moved aside to a hidden temporary name in the folder while the stream is written)
  is put back. A removed stream is not kept as a shorter video: its prefix would pass for the whole one.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fastwan.checkpoint.files import FILE_MODE
from fastwan.errors import InvalidArgument, InvalidArgumentType, OutputExistsError, OutputPathError, VideoWriteError
from fastwan.pipelines.output import ENCODER, OutputTarget, _new_temp, _numbered, _remove_quietly

STREAM_FLAGS = ("-tune", "zerolatency", "-flush_packets", "1",
                "-movflags", "frag_every_frame+empty_moov+default_base_moof")


class VideoStreamWriter:
    """Write a video chunk by chunk to ``target`` (the module's rules).

    target: a checked destination (:func:`~fastwan.pipelines.output.check_output_path`, then
    :func:`~fastwan.pipelines.output.prepare_output`); auto_name: the file name when ``target`` names a folder
    (:func:`~fastwan.pipelines.output.automatic_name`); fps: frames per second.
    """

    def __init__(self, target: OutputTarget, auto_name: str, fps: int):
        if isinstance(fps, bool) or not isinstance(fps, int) or fps <= 0:
            raise InvalidArgument(f"fps={fps!r} must be a positive int.")
        self._fps = fps
        self._writer = None
        self._size: tuple[int, int] | None = None  # (height, width) of the first chunk
        self._frames = 0
        self._done = False
        self._backup: Path | None = None  # the file replaced under overwrite, kept aside until close
        self.path = self._claim(target, target.explicit or target.folder / auto_name)

    @property
    def frames_written(self) -> int:
        """Frames appended so far."""
        return self._frames

    def append(self, frames: np.ndarray) -> None:
        """Send ``frames`` (uint8 [t, H, W, 3], every chunk the first one's H x W; even sizes, as yuv420p needs) to
        the encoder. An encoder failure removes the stream (the module's rules) and raises
        :class:`~fastwan.errors.VideoWriteError`."""
        if self._done:
            raise ValueError(f"VideoStreamWriter.append after the stream to {self.path} was closed or aborted.")
        self._check(frames)
        try:
            if self._writer is None:
                self._writer = self._start()
            for frame in frames:
                self._writer.append_data(frame)
        except BaseException as exc:
            self._fail(exc, "writing")
        self._frames += len(frames)

    def close(self) -> Path:
        """Finish the video (the encoder writes its last frames) -> its path. A stream with no frames, or an encoder
        that fails here, is removed and raises :class:`~fastwan.errors.VideoWriteError`."""
        if self._done:
            raise ValueError(f"VideoStreamWriter.close: the stream to {self.path} was already closed or aborted.")
        if self._writer is None:
            self.abort()
            raise VideoWriteError(f"the video {self.path} got no frames; the stream was removed.")
        writer, self._writer = self._writer, None
        try:
            writer.close()
        except BaseException as exc:
            self._fail(exc, "finishing")
        self._done = True
        if self._backup is not None:
            _remove_quietly(self._backup)
        return self.path

    def abort(self) -> None:
        """Stop the encoder, remove the stream and put back the file it replaced (idempotent; never raises an
        error of its own, so it cannot hide the one that caused it)."""
        if self._done:
            return
        self._done = True
        writer, self._writer = self._writer, None
        if writer is not None:
            try:
                writer.close()
            except Exception:
                pass
        _remove_quietly(self.path)
        if self._backup is not None:
            try:
                os.replace(self._backup, self.path)
            except OSError:
                pass

    def __enter__(self) -> VideoStreamWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.close()

    # ---- internals ------------------------------------------------------------------------------------------------
    def _fail(self, exc: BaseException, doing: str) -> None:
        """Abort the stream, then raise: an interrupt as it is, an error as a VideoWriteError naming the path."""
        self.abort()
        if not isinstance(exc, Exception):
            raise exc
        raise VideoWriteError(f"{doing} the video {self.path} failed: {type(exc).__name__}: {exc}; the stream was "
                              "removed.") from exc

    def _claim(self, target: OutputTarget, dest: Path) -> Path:
        """Create ``dest`` (an exclusive create), or the first free numbered variant of an automatic name; under
        ``overwrite`` an existing ``dest`` is first moved aside to a hidden temporary file."""
        try:
            if target.overwrite and os.path.lexists(dest) and not dest.is_dir():
                self._backup = _new_temp(target.folder)
                os.replace(dest, self._backup)
            for candidate in (_numbered(dest) if target.explicit is None else (dest,)):
                try:
                    os.close(os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE))
                    return candidate
                except FileExistsError:
                    continue
        except OSError as exc:
            self._put_back(dest)
            raise OutputPathError(f"the video {dest} cannot be written ({exc.strerror or exc}); choose a file "
                                  "or folder you can write to.") from None
        self._put_back(dest)
        if target.explicit is not None:
            raise OutputExistsError(f"output file {dest} exists; pass overwrite=True (CLI: --overwrite) to replace "
                                    "it, or choose another file name or a folder.")
        raise OutputPathError(f"{dest} and its numbered variants all exist; choose another output folder.")

    def _put_back(self, dest: Path) -> None:
        if self._backup is not None:
            try:
                os.replace(self._backup, dest)
            except OSError:
                pass
            self._backup = None

    def _check(self, frames) -> None:
        if not isinstance(frames, np.ndarray):
            raise InvalidArgumentType(f"VideoStreamWriter.append takes a numpy array of uint8 frames [t, H, W, 3], "
                                      f"not {type(frames).__name__}.")
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
            raise InvalidArgument(f"VideoStreamWriter.append: frames of shape {frames.shape} and dtype {frames.dtype} "
                                  "must be uint8 [t, H, W, 3].")
        size = frames.shape[1:3]
        if self._size is None:
            if size[0] % 2 or size[1] % 2 or 0 in size:
                raise InvalidArgument(f"VideoStreamWriter.append: frames of {size[0]}x{size[1]} pixels; H.264 in "
                                      "yuv420p needs an even, nonzero height and width.")
            self._size = size
        elif size != self._size:
            raise InvalidArgument(f"VideoStreamWriter.append: frames of {size[0]}x{size[1]} pixels after frames of "
                                  f"{self._size[0]}x{self._size[1]}; every frame of a video has the same size.")

    def _start(self):
        import imageio.v2 as imageio

        return imageio.get_writer(str(self.path), fps=self._fps, output_params=list(STREAM_FLAGS), **ENCODER)
