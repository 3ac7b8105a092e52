"""Where :meth:`VideoGenerator.generate_video` writes its mp4, and how: never a clobbered or half-written file.

Rules (checked by :func:`check_output_path` and :func:`prepare_output` before any compute):

- ``output_path`` names a *file* when its suffix is ``.mp4`` (any case) and it does not end in a path separator;
  otherwise it names a *folder*, and the video gets an automatic name in it. The suffixes of other video and
  image formats (:data:`REFUSED_SUFFIXES`, e.g. ``.mov``, ``.avi``) are refused: only mp4 is written.
- ``~`` and ``~user`` expand to the home folder.
- The folder is created, and a probe file is created and removed in it, so an unwritable folder or a file in the
  way fails at once. A ``.mp4`` path that is an existing folder is an error, and so is a file name the file system
  refuses (e.g. too long) or a NUL character; an existing ``.mp4`` file is an error unless ``overwrite=True``.
- A last part that is ``.mp4`` (or another format's suffix) alone, or such a suffix followed by blank space
  (``clip.mp4 ``), is an error (not a folder) unless the path ends in a separator.
- Automatic name: ``<ASCII slug of the prompt>_<seed>_<digest>.mp4``; the digest covers everything that determines
  the video (model, prompt, negative prompt, settings, seed), so different videos get different names. A taken
  name is never replaced unless ``overwrite=True``: the video gets the first free ``-2``, ``-3``, ... variant, claimed
  atomically (a hard link, which fails if the name exists; an exclusive create where hard links are unsupported).

Writing (:func:`save_video`): the video is encoded into a hidden temporary file in the target folder and moved into
place only when complete; on any failure or interrupt (``KeyboardInterrupt`` included) the temporary file is
removed and the destination is left as it was.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import unicodedata
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import numpy as np

from fastwan.errors import InvalidArgument, InvalidArgumentType, OutputExistsError, OutputPathError, VideoWriteError
from fastwan.checkpoint.files import FILE_MODE, new_temp_file

VIDEO_SUFFIX = ".mp4"
# Suffixes that name a video or image file of a format fastwan does not write (refused rather than made a folder).
REFUSED_SUFFIXES = frozenset({
    # video
    ".mov", ".avi", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".wmv", ".flv", ".ogv", ".3gp", ".3g2", ".ts",
    ".mts", ".m2ts", ".mxf", ".vob", ".f4v", ".h264", ".h265", ".hevc", ".y4m",
    # image
    ".gif", ".png", ".jpg", ".jpeg", ".jpe", ".jfif", ".webp", ".apng", ".bmp", ".tif", ".tiff", ".avif", ".heic",
    ".heif", ".jxl", ".jp2", ".ico", ".tga", ".exr", ".svg",
})
SLUG_CHARS = 60  # the readable part of an automatic name
DIGEST_HEX = 10  # hex digits of the settings digest in an automatic name
MAX_NUMBERED = 10_000  # "-2" ... "-N" variants tried when an automatic name is taken
TEMP_PREFIX = ".fastwan-"  # hidden temporary files in the target folder (the encoder picks mp4 by the ".mp4" end)
TEMP_SUFFIX = ".partial.mp4"
# The encoder of every mp4 fastwan writes (imageio's ffmpeg writer arguments: H.264, yuv420p, its quality 8 = CRF 10,
# any frame size); the streamed writer (fastwan.pipelines.stream_output) uses the same.
ENCODER = MappingProxyType({"codec": "libx264", "quality": 8, "macro_block_size": 1, "ffmpeg_log_level": "error"})


@dataclass(frozen=True)
class OutputTarget:
    """A checked destination: the folder, the explicit file name (None = automatic) and the overwrite choice."""

    folder: Path
    file_name: str | None
    overwrite: bool

    @property
    def explicit(self) -> Path | None:
        """The explicit destination file, or None when the name is automatic."""
        return None if self.file_name is None else self.folder / self.file_name


# ---- checks (before any compute) ----------------------------------------------------------------------------------
def check_output_path(output_path, overwrite) -> OutputTarget:
    """Apply the file-versus-folder rule to ``output_path`` (no file system writes)."""
    if not isinstance(overwrite, bool):
        raise InvalidArgumentType(f"overwrite={overwrite!r} must be True or False.", field="overwrite")
    text = os.fspath(output_path) if isinstance(output_path, (str, os.PathLike)) else None
    if not isinstance(text, str):
        raise InvalidArgumentType(
            f"output_path={output_path!r} must be a str or a path: a folder, or a file ending in .mp4.",
            field="output_path")
    if not text.strip():
        raise InvalidArgument(f"output_path={output_path!r} is empty; pass a folder (e.g. 'outputs/') or a .mp4 file.",
                              field="output_path")
    if "\0" in text:
        raise InvalidArgument(f"output_path={text!r} contains a NUL character, which no file name may hold; "
                              "remove it.", field="output_path")
    path = _expand_home(text)
    names_folder = text.endswith(("/", os.sep)) or (os.altsep is not None and text.endswith(os.altsep))
    if not names_folder:
        _check_file_name(text, path)
    suffix = path.suffix.lower()
    if suffix == VIDEO_SUFFIX and not names_folder:
        return OutputTarget(path.parent, path.name, overwrite)
    if suffix in REFUSED_SUFFIXES and not names_folder:
        raise InvalidArgument(
            f"output_path={text!r} names a {suffix} file, but only mp4 videos are written; "
            f"use '{path.with_suffix(VIDEO_SUFFIX)}', or end the path with '/' to make it a folder.",
            field="output_path")
    return OutputTarget(path, None, overwrite)


def _check_file_name(text: str, path: Path) -> None:
    """A last part that is a video or image suffix alone (``.mp4``: a file name with nothing before it), or such a
    suffix followed by blank space (``clip.mp4 ``), names no file the user can have meant: refused, not made a
    folder."""
    name = path.name
    known = REFUSED_SUFFIXES | {VIDEO_SUFFIX}
    if name.lower() in known:
        raise InvalidArgument(
            f"output_path={text!r} ends in {name!r}, a file name with nothing before its suffix; name the video, "
            f"e.g. '{path.with_name('video' + VIDEO_SUFFIX)}', or end the path with '/' to make it a folder.",
            field="output_path")
    stripped = name.rstrip()
    if stripped != name and (stripped.lower() in known or Path(stripped).suffix.lower() in known):
        raise InvalidArgument(
            f"output_path={text!r} ends in blank space after {Path(stripped).suffix or stripped!r}; remove it, "
            f"e.g. '{path.with_name(stripped)}'.", field="output_path")


def _expand_home(text: str) -> Path:
    """``text`` as a Path with ``~`` / ``~user`` expanded."""
    try:
        return Path(text).expanduser()
    except RuntimeError as exc:  # no home folder known for '~' or '~user'
        raise InvalidArgument(f"output_path={text!r}: '~' cannot be expanded ({exc}); pass the full path.",
                              field="output_path") from None


def prepare_output(target: OutputTarget) -> None:
    """Create the folder and prove it writable; refuse an explicit file that is a folder, or exists without
    ``overwrite``. Raises :class:`OutputPathError` / :class:`OutputExistsError` naming the path and the fix."""
    folder = target.folder
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        blocker = _file_in_the_way(folder)
        if blocker is not None:
            raise OutputPathError(
                f"output folder {folder} cannot be created: {blocker} is a file, not a folder. "
                "Choose another output folder, or move that file away."
            ) from None
        raise OutputPathError(f"output folder {folder} cannot be created ({exc.strerror or exc}); "
                              "choose a folder you can write to.") from None
    _probe(folder)
    dest = target.explicit
    if dest is None:
        return
    try:
        dest.lstat()  # a name the file system refuses (e.g. longer than it allows) fails here, not after compute
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise OutputPathError(f"output file {dest} cannot be written ({exc.strerror or exc}); "
                              "choose a shorter or different file name.") from None
    if dest.is_dir():
        raise OutputPathError(
            f"output_path {dest} is an existing folder, but a path ending in .mp4 names the video file. "
            f"Pass a file inside it (e.g. '{dest / 'video.mp4'}'), end the path with '/' to use it as the output "
            "folder, or remove the folder."
        )
    if os.path.lexists(dest) and not target.overwrite:
        raise OutputExistsError(
            f"output file {dest} exists; pass overwrite=True (CLI: --overwrite) to replace it, "
            "or choose another file name or a folder (automatic names never replace a file)."
        )


def _file_in_the_way(folder: Path) -> Path | None:
    """The nearest existing path of ``folder`` or its parents when it is not a folder (else None)."""
    for p in (folder, *folder.parents):
        if os.path.lexists(p):
            return None if p.is_dir() else p
    return None


def _probe(folder: Path) -> None:
    """Create and remove a file in ``folder``: proves, before any compute, that the video can be written there."""
    try:
        tmp = _new_temp(folder)
    except OSError as exc:
        raise OutputPathError(f"output folder {folder} is not writable ({exc.strerror or exc}); "
                              "choose a folder you can write to.") from None
    _remove_quietly(tmp)


# ---- names ----------------------------------------------------------------------------------------------------------
def automatic_name(prompt: str, seed: int, identity: Mapping[str, Any]) -> str:
    """``<slug>_<seed>_<digest>.mp4``: the digest covers the prompt, the seed and ``identity`` (everything else
    that determines the video: model, negative prompt, settings)."""
    record = {"prompt": prompt, "seed": int(seed), **identity}
    blob = json.dumps(record, sort_keys=True, default=str, ensure_ascii=False).encode("utf-8")
    digest = hashlib.sha256(blob).hexdigest()[:DIGEST_HEX]
    return f"{slug(prompt)}_{int(seed)}_{digest}{VIDEO_SUFFIX}"


def slug(text: str) -> str:
    """A readable ASCII file-name part of ``text``: accents dropped, other runs of non-alphanumerics as '_',
    lower case, at most SLUG_CHARS characters; "video" when nothing ASCII is left."""
    ascii_text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    s = re.sub(r"[^A-Za-z0-9]+", "_", ascii_text).strip("_").lower()
    return s[:SLUG_CHARS].rstrip("_") or "video"


def _numbered(dest: Path) -> Iterator[Path]:
    """``dest``, then ``<stem>-2<suffix>``, ``<stem>-3<suffix>``, ... (MAX_NUMBERED names in all)."""
    yield dest
    for k in range(2, MAX_NUMBERED + 1):
        yield dest.with_name(f"{dest.stem}-{k}{dest.suffix}")


# ---- writing --------------------------------------------------------------------------------------------------------
def save_video(target: OutputTarget, auto_name: str, frames: np.ndarray, fps: int) -> Path:
    """Encode ``frames`` (uint8 [T, H, W, 3]) to a temporary file in the target folder, then move it into place
    by the rules above. Returns the path written. Rules for what changed during the compute: a target folder
    removed since its check is made again; a finished video that cannot take its name (an explicit file that
    appeared, every numbered name taken) is kept beside it as ``<stem>-unsaved[-k].mp4``, which the error names."""
    dest = target.explicit or target.folder / auto_name
    try:
        target.folder.mkdir(parents=True, exist_ok=True)
        tmp = _new_temp(target.folder)
    except OSError as exc:
        raise OutputPathError(f"the video {dest} cannot be written: its folder is not writable "
                              f"({exc.strerror or exc}).") from exc
    try:
        write_frames(tmp, frames, fps, dest=dest)
        try:
            return _finalize(tmp, dest, numbered=target.explicit is None, overwrite=target.overwrite)
        except (OutputExistsError, OutputPathError) as exc:
            kept = _keep(tmp, dest)
            if kept is None:
                raise
            raise type(exc)(f"{exc} The finished video was kept as {kept}.") from exc
    finally:
        _remove_quietly(tmp)  # gone already when the file was moved into place


def _keep(tmp: Path, dest: Path) -> Path | None:
    """The finished video ``tmp`` under the first free ``<dest stem>-unsaved[-k].mp4`` beside ``dest`` (never
    replacing a file), or None when none can be claimed."""
    try:
        for candidate in _numbered(dest.with_name(f"{dest.stem}-unsaved{dest.suffix}")):
            if _claim(tmp, candidate):
                return candidate
    except OSError:
        pass
    return None


def write_frames(path: Path, frames: np.ndarray, fps: int, *, dest: Path) -> None:
    """Encode ``frames`` as H.264 mp4 at ``path``; an encoder failure, or an empty result, raises
    :class:`VideoWriteError` naming ``dest`` (the file the user asked for)."""
    import imageio.v2 as imageio

    try:
        with imageio.get_writer(str(path), fps=fps, **ENCODER) as writer:
            for frame in frames:
                writer.append_data(frame)
    except Exception as exc:
        raise VideoWriteError(f"writing the video {dest} failed: {type(exc).__name__}: {exc}; "
                              "nothing at that path was changed.") from exc
    size = path.stat().st_size if path.is_file() else 0
    if size == 0:
        raise VideoWriteError(f"writing the video {dest} failed: the encoder wrote nothing; "
                              "nothing at that path was changed.")


def _finalize(tmp: Path, dest: Path, *, numbered: bool, overwrite: bool) -> Path:
    """Move the complete video ``tmp`` to ``dest``: replacing it if ``overwrite``; else claiming ``dest`` (or, if
    ``numbered``, its first free numbered variant) without ever replacing a file."""
    try:
        if overwrite:
            os.replace(tmp, dest)
            return dest
        for candidate in (_numbered(dest) if numbered else (dest,)):
            if _claim(tmp, candidate):
                return candidate
    except OSError as exc:
        raise OutputPathError(f"moving the finished video to {dest} failed ({exc.strerror or exc}).") from exc
    if not numbered:
        raise OutputExistsError(f"output file {dest} appeared while the video was made; it was left unchanged. "
                                "Pass overwrite=True (CLI: --overwrite) to replace it, or choose another name.")
    raise OutputPathError(f"{dest} and its {MAX_NUMBERED - 1} numbered variants all exist; "
                          "choose another output folder.")


def _claim(tmp: Path, candidate: Path) -> bool:
    """Give the finished video ``tmp`` the name ``candidate`` if that name is free (atomically); False if taken."""
    try:
        os.link(tmp, candidate)  # fails if candidate exists
        return True
    except FileExistsError:
        return False
    except OSError:
        pass  # no hard links on this file system: reserve the name with an exclusive create, then move onto it
    try:
        fd = os.open(candidate, os.O_CREAT | os.O_EXCL | os.O_WRONLY, FILE_MODE)
    except FileExistsError:
        return False
    os.close(fd)
    os.replace(tmp, candidate)
    return True


def _new_temp(folder: Path) -> Path:
    """Create a new empty hidden file in ``folder`` (:func:`fastwan.checkpoint.files.new_temp_file`: exclusive create,
    mode 0o666 less the umask, like any file)."""
    return new_temp_file(folder, TEMP_PREFIX, TEMP_SUFFIX)


def _remove_quietly(path: Path) -> None:
    """Remove ``path`` if it exists (cleanup must not hide the error that caused it)."""
    try:
        os.unlink(path)
    except OSError:
        pass


@dataclass
class GenerationResult:
    frames: np.ndarray | None  # uint8 [T, H, W, 3]
    video_path: str | None
    seed: int  # the seed used (drawn at random for seed=None): pass it back to make the same video again
    timings: dict[str, float]  # seconds: text_encoding, denoising, decoding, saving, total
    attention_backend: str
    peak_memory: int | None  # bytes (CUDA max allocated), None on CPU
    num_transformer_forwards: int = 0
    settings: dict[str, Any] = field(default_factory=dict)
    # the step cache's report: {"type", "computed": {"cond": [steps], "uncond": [...]}[, "calibration"]}, or None
    cache: dict[str, Any] | None = None
