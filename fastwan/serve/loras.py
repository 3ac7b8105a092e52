"""LoRAs by name (``fastwan serve --lora-dir DIR``): a create body's ``lora`` checked against the folder and the
loaded checkpoint, and each worker's merge of a job's LoRAs into its model.

Rules:

- A name is the file name of a LoRA in DIR without its ``.safetensors`` suffix: ``style`` is
  ``DIR/style.safetensors``, directly inside DIR (a symbolic link there is followed: the server's operator put it
  there). A name is 1-128 of ``A-Z a-z 0-9 _ - .``, starts with a letter or a digit and holds no ``..``; anything
  else (a path separator, a leading dot, a space, ...) is refused (400), so no name reaches outside DIR. Other files
  in DIR (another suffix, a name outside the rule) are never served.
- ``lora`` is a list of items, each a name or ``{"name", "scale" (a finite number, default 1.0), "expert" (0: the
  high-noise, 1: the low-noise DiT of a Wan2.2 A14B checkpoint; default: every DiT)}``; one item may come without
  the list (``null`` or ``[]``: none), and a text starting with ``[`` or ``{`` is read as JSON (how a multipart
  form carries it: the field ``lora`` once, or ``lora[]`` once per item). At most :data:`MAX_LORAS` items; one
  file twice for one DiT is refused (:func:`fastwan.lora.merge.check_repeats`).
- Checked before the job is accepted: the names, the files, the experts against the checkpoint, and each file's
  tensors against the checkpoint's DiT built on the meta device (:func:`fastwan.lora.merge.check_loras`); a file
  that fits is remembered by its size and modification time, so it is read once. Whether a scale keeps the merged
  weights within their dtype is known only when they merge: a job whose LoRA overflows fails, saying so.
- A worker merges a job's LoRAs just before it runs, and keeps them merged while the following jobs ask for the same
  set (names, scales, experts, files unchanged); before a job that asks for another set, none included, the base
  weights are restored bit for bit (``VideoGenerator.unload_lora``). So a job is never affected by another job's
  LoRAs.
- A message names a LoRA by its name, never by its path on the server.
"""
from __future__ import annotations

import json
import logging
import re
import threading
import weakref
from pathlib import Path

from fastwan.errors import InvalidArgument, MissingFileError, UserError, one_line
from fastwan.lora.files import finite
from fastwan.lora.merge import check_loras, check_repeats
from fastwan.serve.errors import ApiError, from_user_error

logger = logging.getLogger("fastwan.serve")

SUFFIX = ".safetensors"
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")
NAME_RULE = ("a LoRA name is a file name in the server's LoRA folder without '.safetensors': 1-128 letters, digits, "
             "'_', '-' or '.', starting with a letter or a digit, without '..' (no path)")
MAX_LORAS = 8  # LoRAs in one request
MAX_REMEMBERED = 1024  # files remembered as fitting (a new version of a file is a new entry)
JOB_KEY = "_lora"  # the job's LoRAs in its stored fields: [{"name", "scale", "expert"}]
ITEM_KEYS = ("name", "scale", "expert")
EXAMPLE = '[{"name": "style", "scale": 0.8}]'


def _bad(message: str, code: str = "invalid_value") -> ApiError:
    return ApiError(400, message, code=code, param="lora")


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError as exc:
        raise _bad(f"lora={text!r} is not valid JSON ({exc}); send e.g. {EXAMPLE}.") from None


def _items(value) -> list:
    """``lora``'s value -> its list of items (a name or an object each); JSON text read."""
    if isinstance(value, str) and value.lstrip()[:1] in ("[", "{"):
        value = _json(value)
    if value is None:  # JSON null: no LoRA
        return []
    if isinstance(value, (str, dict)):
        value = [value]
    if not isinstance(value, list):
        raise _bad(f"lora={value!r} must be a list of LoRAs, each a name or {{\"name\", \"scale\", \"expert\"}}, e.g. "
                   f"{EXAMPLE}.", code="invalid_type")
    return [_json(item) if isinstance(item, str) and item.lstrip()[:1] == "{" else item for item in value]


def form_items(items: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], str | list[str] | None]:
    """Multipart text fields -> (the fields that are not ``lora``'s, ``lora``'s text or texts; None when absent).
    ``lora`` comes once (a JSON list, an object or a name) or as ``lora[]`` once per item; the ``openai`` client's
    spelling of a list of objects (``lora[][name]``, ``lora[][scale]``, ...) is refused: it loses which keys go
    together."""
    rest, texts, spellings = [], [], set()
    for key, value in items:
        if key.split("[", 1)[0] != "lora":
            rest.append((key, value))
            continue
        if key not in ("lora", "lora[]"):
            raise _bad(f"the form field {key!r} spells LoRAs as separate keys, which loses which go together; send "
                       f"lora as one field of JSON text, e.g. with the openai client extra_body={{\"lora\": "
                       f"json.dumps({EXAMPLE})}}.")
        spellings.add(key)
        texts.append(value)
    if not texts:
        return rest, None
    if spellings == {"lora[]"}:
        return rest, texts
    if spellings == {"lora"} and len(texts) == 1:
        return rest, texts[0]
    raise _bad("the form gives lora more than once; send it once, as JSON text (e.g. " + EXAMPLE + "), or as one "
               "lora[] field per LoRA.")


def _renamed(message: str, paths: dict[str, str]) -> str:
    """``message`` with each LoRA file's server path written as its name."""
    for path, name in paths.items():
        message = message.replace(path, name)
    return message


class ServedLoras:
    """The LoRAs of ``folder`` (``--lora-dir``; None: the server serves none): :meth:`check` at create,
    :meth:`use` on each worker before a job runs."""

    def __init__(self, folder: str | Path | None):
        self.folder = None if folder is None else Path(folder).expanduser()
        if self.folder is not None and not self.folder.is_dir():
            if self.folder.exists():
                raise InvalidArgument(f"--lora-dir {folder}: not a folder; give the folder that holds the LoRA files "
                                      f"(<name>{SUFFIX}).")
            raise MissingFileError(f"--lora-dir {folder}: no such folder; create it and put the LoRA files "
                                   f"(<name>{SUFFIX}) in it.")
        self._fits: set[tuple] = set()  # (name, expert, size, mtime) of the files found to fit the checkpoint
        self._merged = weakref.WeakKeyDictionary()  # generator -> the set merged into it (:meth:`use`)
        self._lock = threading.Lock()

    def names(self) -> list[str]:
        """The names this server serves, sorted."""
        if self.folder is None:
            return []
        stems = (p.name[:-len(SUFFIX)] for p in self.folder.glob(f"*{SUFFIX}") if p.is_file())
        return sorted(s for s in stems if NAME.fullmatch(s) and ".." not in s)

    def path(self, name: str) -> Path:
        return self.folder / f"{name}{SUFFIX}"

    def _name(self, name) -> str:
        if not isinstance(name, str):
            raise _bad(f"lora name {name!r} must be text: {NAME_RULE}.", code="invalid_type")
        if not NAME.fullmatch(name) or ".." in name:
            raise _bad(f"lora name {name!r} is refused: {NAME_RULE}; send the name of one of the server's LoRAs, "
                       "e.g. \"style\" for style.safetensors.")
        if not self.path(name).is_file():
            names = self.names()
            listed = ", ".join(names[:20]) + (f" (and {len(names) - 20} more)" if len(names) > 20 else "")
            hint = f" (leave out '{SUFFIX}')" if name.endswith(SUFFIX) else ""
            raise _bad(f"lora name {name!r}: this server has no LoRA of that name{hint}; its LoRAs are: "
                       f"{listed or 'none (its LoRA folder is empty)'}.", code="lora_not_found")
        return name

    def _item(self, item) -> dict:
        """One item -> {"name", "scale", "expert"}."""
        if isinstance(item, str):
            item = {"name": item}
        if not isinstance(item, dict):
            raise _bad(f"lora item {item!r} must be a name or {{\"name\", \"scale\", \"expert\"}}, e.g. {EXAMPLE}.",
                       code="invalid_type")
        unknown = [k for k in item if k not in ITEM_KEYS]
        if unknown:
            raise _bad(f"lora item {item!r}: {unknown[0]!r} is not a key of a LoRA item; its keys are name, scale "
                       "and expert.", code="unknown_parameter")
        if "name" not in item:
            raise _bad(f"lora item {item!r} has no name; give the LoRA's name, e.g. {EXAMPLE}.",
                       code="missing_required_parameter")
        name, scale, expert = self._name(item["name"]), item.get("scale", 1.0), item.get("expert")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not finite(scale):
            raise _bad(f"lora {name!r}: scale={scale!r} must be a finite number (1.0 as trained, 0.5 for half "
                       "strength).")
        if expert is not None and (isinstance(expert, bool) or expert not in (0, 1) or not isinstance(expert, int)):
            raise _bad(f"lora {name!r}: expert={expert!r} must be 0 (the high-noise DiT of a Wan2.2 A14B "
                       "checkpoint), 1 (its low-noise DiT) or left out (every DiT).")
        return {"name": name, "scale": float(scale), "expert": expert}

    def check(self, value, checkpoint) -> list[dict]:
        """A create body's ``lora`` -> the job's LoRAs ([{"name", "scale", "expert"}]), checked against the folder
        and ``checkpoint`` (the loaded one); raises an :class:`ApiError` (400, param ``lora``)."""
        if self.folder is None:
            raise _bad("lora: this server serves no LoRAs; its operator starts it with --lora-dir DIR (a folder of "
                       f"<name>{SUFFIX} files) to serve them by name.", code="unsupported_parameter")
        items = _items(value)
        if len(items) > MAX_LORAS:
            raise _bad(f"lora lists {len(items)} LoRAs; a request takes {MAX_LORAS} at most.")
        loras = [self._item(item) for item in items]
        paths = {str(self.path(x["name"])): x["name"] for x in loras}
        try:
            check_repeats([(str(self.path(x["name"])), x["scale"], x["expert"]) for x in loras])
            for x in loras:
                path = self.path(x["name"])
                stat = path.stat()
                key = (x["name"], x["expert"], stat.st_size, stat.st_mtime_ns)
                if key in self._fits:
                    continue
                check_loras([(str(path), x["scale"], x["expert"])], checkpoint.transformer_config,
                            len(checkpoint.experts))
                with self._lock:
                    if len(self._fits) >= MAX_REMEMBERED:
                        self._fits.clear()
                    self._fits.add(key)
        except UserError as exc:
            error = from_user_error(exc, param="lora")
            error.message = _renamed(error.message, paths)
            raise error from None
        except OSError as exc:  # removed meanwhile
            raise _bad(f"lora: a LoRA file could not be read ({type(exc).__name__}); retry, or ask the server's "
                       "operator.") from None
        return loras

    def _stamp(self, name: str) -> tuple[int, int]:
        if self.folder is None:
            raise InvalidArgument(f"this video asks for the LoRA {name!r}, but the server was started without "
                                  "--lora-dir; start it with the folder that holds the LoRA, or create the video "
                                  "again without it.")
        try:
            stat = self.path(name).stat()
        except OSError:
            raise InvalidArgument(f"LoRA {name!r} is no longer in the server's LoRA folder (it was removed after "
                                  "the video was accepted); create the video again once it is back, or without "
                                  "it.") from None
        return stat.st_size, stat.st_mtime_ns

    def use(self, gen, fields: dict) -> None:
        """Merge the LoRAs of a job (its stored ``fields``) into ``gen``, the base weights restored first unless
        ``gen`` holds that very set already. A LoRA that fails to merge leaves the base weights and raises (a user
        error: the job fails, saying why)."""
        loras = fields.get(JOB_KEY) or []
        wanted = tuple((x["name"], x["scale"], x["expert"], self._stamp(x["name"])) for x in loras)
        with self._lock:  # the workers' generators are distinct keys; the mapping is shared
            held = self._merged.get(gen, ())
        if wanted == held:
            return
        if held:
            gen.unload_lora()
            with self._lock:
                self._merged[gen] = ()
            logger.info("LoRAs unloaded: %s", ", ".join(h[0] for h in held))
        paths = {str(self.path(x["name"])): x["name"] for x in loras}
        try:
            for x in loras:
                gen.load_lora(self.path(x["name"]), x["scale"], x["expert"])
        except UserError as exc:
            gen.unload_lora()
            raise InvalidArgument(_renamed(one_line(exc), paths)) from None
        except BaseException:
            gen.unload_lora()
            raise
        with self._lock:
            self._merged[gen] = wanted
        if loras:
            logger.info("LoRAs merged: %s", ", ".join(f"{x['name']} ({x['scale']:g})" for x in loras))
