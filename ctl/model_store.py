"""The models folder as a store of models by name: which models lie there, which file a name
means, and removing one (``ntxctl list``, ``ntxctl rm``, ``--model NAME``).

A model is a ``.gguf`` file in :func:`ntx.ctl.models.models_dir` (where ``ntxctl pull`` puts
them), or a split set in llama.cpp's gguf-split names (``STEM-00001-of-00003.gguf`` …), which is
one model named STEM. A single file's name is its file name less ``.gguf``; a shard's own stem
(``STEM-00001-of-00003``) names its set too. Hidden files (a pull's ``.NAME.part``) and sidecars
(``NAME.gguf.json``) are not models.

``--model`` takes a path or a name: a text that is an existing path, or that holds a ``/``, is a
path as before; any other is looked up here, and a name found nowhere is one line that lists the
local models and says how to fetch one (:func:`resolve_model`, called from ctl/cli.py's one place
that turns ``--model`` into a file).
"""

from __future__ import annotations

import os
import pathlib
from dataclasses import dataclass

from ntx.ctl.models import models_dir, sidecar_path
from ntx.shared.config import format_bytes
from ntx.shared.errors import ModelError, NtxError
from ntx.shared.gguf_index import open_model, read_header, split_file_name, split_name

GGUF_SUFFIX = ".gguf"


@dataclass(frozen=True)
class LocalModel:
    """One model of the models folder: its name and files (every shard of a split set, in order;
    ``missing`` names the shards a set lacks)."""

    name: str
    paths: tuple[pathlib.Path, ...]
    missing: tuple[str, ...] = ()

    @property
    def path(self) -> pathlib.Path:
        """The file ``--model`` names: the model's file, or its set's first shard."""
        return self.paths[0]

    @property
    def size_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.paths)

    def answers_to(self, name: str) -> bool:
        """Whether ``name`` (with or without ``.gguf``) names this model."""
        stem = name.removesuffix(GGUF_SUFFIX)
        return stem == self.name or any(p.name.removesuffix(GGUF_SUFFIX) == stem for p in self.paths)


@dataclass(frozen=True)
class ModelFacts:
    """What ``ntxctl list`` shows of a model beyond its name and size: its type (``general.file_type``,
    else the dominant matrix type), its layer count, and why ntx cannot load it (None: it can)."""

    type_name: str
    n_layers: int | None
    problem: str | None


def local_models() -> list[LocalModel]:
    """The models in the models folder, by name."""
    folder = models_dir()
    try:
        names = sorted(p.name for p in folder.iterdir()
                       if p.name.endswith(GGUF_SUFFIX) and not p.name.startswith(".") and p.is_file())
    except OSError:  # no models folder yet
        return []
    singles: list[LocalModel] = []
    sets: dict[tuple[str, int], dict[int, pathlib.Path]] = {}
    for n in names:
        split = split_name(n)
        if split is None or not 1 <= split[1] <= split[2]:
            singles.append(LocalModel(n.removesuffix(GGUF_SUFFIX), (folder / n,)))
        else:
            stem, no, count = split
            sets.setdefault((stem, count), {})[no] = folder / n
    for (stem, count), shards in sets.items():
        missing = tuple(split_file_name(stem, i, count) for i in range(1, count + 1) if i not in shards)
        singles.append(LocalModel(stem, tuple(shards[i] for i in sorted(shards)), missing))
    return sorted(singles, key=lambda m: m.name)


def find_model(name: str) -> LocalModel | None:
    """The local model ``name`` names (file stem, with or without ``.gguf``), or None."""
    return next((m for m in local_models() if m.answers_to(name)), None)


def known_models_text() -> str:
    """The local models' names for a message: ``local models: a, b`` or that there are none."""
    names = [m.name for m in local_models()]
    return f"local models: {', '.join(names)}" if names else f"no local models in {models_dir()}"


def resolve_model(text: str, flag: str = "--model") -> str:
    """The file ``--model TEXT`` means: TEXT itself when it is an existing path or holds a ``/``
    (a path: opening it says what is wrong with it), else the local model of that name. A name
    found nowhere, or a split set that lacks shards, is one NtxError line with the fix, quoting
    ``flag`` (empty for an argument)."""
    if os.path.exists(text) or os.sep in text or "/" in text:
        return text
    model = find_model(text)
    given = f"{flag} {text}" if flag else text
    if model is None:
        raise NtxError(f"{given}: no such file, and no local model of that name ({known_models_text()}); "
                       f"give a GGUF path, or fetch it with `ntxctl pull URL` (or hf://OWNER/REPO/FILE.gguf)")
    if model.missing:
        raise NtxError(f"{given}: the split model {model.name} lacks {', '.join(model.missing)}; fetch the "
                       f"whole set again with `ntxctl pull URL` of any of its parts")
    return str(model.path)


def model_facts(model: LocalModel) -> ModelFacts:
    """Type and layer count of ``model`` from its header (no tensor data is read); a model that
    ntx cannot load still shows what its header says, with the reason."""
    try:
        index = open_model(model.path)
        return ModelFacts(_file_type_name(index.metadata) or index.file_type, index.hparams.n_layers, None)
    except ModelError as e:
        problem = str(e)
    try:
        md = read_header(model.path).metadata
    except ModelError:
        return ModelFacts("?", None, problem)
    layers = md.get(f"{md.get('general.architecture')}.block_count")
    return ModelFacts(_file_type_name(md) or "?", layers if isinstance(layers, int) else None, problem)


def _file_type_name(md: dict) -> str | None:
    """``general.file_type`` as llama.cpp names it (``Q4_K_M``, ``F16``), or None."""
    from gguf import LlamaFileType

    code = md.get("general.file_type")
    try:
        name = LlamaFileType(code).name if isinstance(code, int) else None
    except ValueError:
        return None
    return name.removeprefix("MOSTLY_").removeprefix("ALL_") if name else None


def remove_model(name: str, in_use: dict[str, list[str]]) -> tuple[LocalModel, int]:
    """Delete local model ``name``'s files, their sidecars and any unfinished pull of them;
    returns the model and the bytes freed. ``in_use``: the model files each running instance
    holds (instance name -> paths); a model one of them runs is refused, naming the instance."""
    model = find_model(name)
    if model is None:
        raise NtxError(f"no local model named {name} ({known_models_text()}); `ntxctl list` shows them")
    files = {os.path.realpath(p) for p in model.paths}
    for instance, paths in sorted(in_use.items()):
        if any(os.path.realpath(p) in files for p in paths):
            raise NtxError(f"model {model.name} is in use by running instance {instance!r}; stop it first "
                           f"(`ntxctl stop --name {instance}`)")
    size = model.size_bytes
    for p in model.paths:
        for f in (p, sidecar_path(p), p.with_name(f".{p.name}.part")):
            try:
                f.unlink()
            except FileNotFoundError:
                pass
            except OSError as e:
                raise NtxError(f"cannot remove {f}: {e.strerror or e}") from None
    return model, size


def describe_removed(model: LocalModel, size_bytes: int) -> str:
    """The one line ``ntxctl rm`` prints."""
    files = f"{len(model.paths)} files" if len(model.paths) > 1 else model.path.name
    return f"removed {model.name} ({files}, {format_bytes(size_bytes)}) from {model.path.parent}"

