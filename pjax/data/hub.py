"""HuggingFace `datasets` as a text source (the optional `hub` extra, imported only here): a hub name or
a `save_to_disk` folder, one split and text column, memory-mapped whole or streamed as training
consumes it, never held in memory or tokenized ahead."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

from mesh.errors import ConfigError, cut, first_line

_SAVED_MARKERS = ("dataset_dict.json", "state.json")


def is_saved_dataset(path: Path) -> bool:
    """Whether `path` is a folder written by `Dataset.save_to_disk` or `DatasetDict.save_to_disk`."""
    return path.is_dir() and any((path / marker).is_file() for marker in _SAVED_MARKERS)


def _datasets(spec: str) -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ConfigError(f"data.path={spec} is a HuggingFace dataset; run `pip install 'pjax[hub]'` (or `pip "
                          f"install datasets`), or point data.path at a local .txt/.jsonl/.parquet file.") from e
    return datasets


def _open_saved(datasets: Any, path: Path, split: str, streaming: bool) -> Any:
    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as e:
        raise ConfigError(f"data.path={path} looks like a saved dataset but does not load ({first_line(e, 30)}); "
                          f"write it again with save_to_disk.") from None
    if isinstance(saved, datasets.DatasetDict):
        if split not in saved:
            raise ConfigError(f"data.split={split} is not a split of {path} (it has {cut(', '.join(saved), 40)}); "
                              f"choose one of them.")
        saved = saved[split]
    elif split not in ("train", str(saved.split)):  # one saved Dataset is one split, whatever its name
        raise ConfigError(f"data.split={split} is not the split saved in {path} ({saved.split or 'unnamed'}); "
                          f"leave data.split at train.")
    return saved.to_iterable_dataset() if streaming else saved


def _open_hub(datasets: Any, name: str, split: str, streaming: bool) -> Any:
    try:
        return datasets.load_dataset(name, split=split, streaming=streaming)
    except Exception as e:
        raise ConfigError(f"data.path={name} is no local path, and the HuggingFace hub did not load its split "
                          f"{split} ({first_line(e, 30)}): check both, or use a local file.") from e


def hub_documents(spec: str, saved: Path | None, split: str, column: str, start: int = 0,
                  streaming: bool = False) -> Iterator[Any]:
    """The `column` of every row of the split from row `start` on, unchecked; `saved`: a save_to_disk folder."""
    datasets = _datasets(spec)
    dataset = _open_saved(datasets, saved, split, streaming) if saved is not None else \
        _open_hub(datasets, spec, split, streaming)
    names = dataset.column_names  # None for a hub stream whose features are not declared
    if names is not None and column not in names:
        raise ConfigError(f"data.path={spec} (split {split}) has no column {column!r} (it has "
                          f"{cut(', '.join(names), 40)}); set data.column to the text's column.")
    if names is not None and len(names) > 1:
        dataset = dataset.select_columns([column])
    if start:
        dataset = dataset.skip(start)
    for row in dataset:
        if column not in row:
            raise ConfigError(f"data.path={spec} (split {split}) has rows without a {column!r} column; set "
                              f"data.column to the one holding the text.")
        yield row[column]
