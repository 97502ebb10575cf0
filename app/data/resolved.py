"""A run's data as the driver resolves it, once per process: the sources, the tokenizer, the template.

    resolve_data(data, max_length)                     (preflight calls it, before Ray starts)
        ├── resolve_sources(data.sources or data.path) each dataset's files in read order, format, columns,
        │                                              rows, take (app/data/sources.py; not synthetic)
        │   or read_manifest(data.path)                data.source=prepared: the manifest, read once; its
        │                                              identity checked against this config (check_identity)
        ├── resolve_source(data.eval_path)             only with data.eval_path; errors name that key
        ├── load_tokenizer(data.tokenizer)
        ├── TemplateSettings (a data.chat_template file is read here) + check_chat_template, and each
        │   source's first rows rendered with it (check_sources_render)
        └── data_fingerprint of every resolved source  what a resume compares
    ─▶ ResolvedData: the pipeline (tokenized_dataset), the driver (example row, snapshot), the cost model
       and the model spec take it, so nothing of it is resolved or loaded a second time in the driver.

Ray Data's tokenize tasks run in other processes and load the tokenizer by name there (app/data/ray_ops.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from app.config import DataConfig
from app.data import DataError
from app.data.chat_template import (
    check_chat_template,
    is_template_file,
    read_template_file,
    resolve_template,
)
from app.data.fingerprint import data_fingerprint
from app.data.formats import check_format_settings
from app.data.prepared import Manifest, check_identity, identity_of, prepared_fingerprint, read_manifest
from app.data.readers import DataSource, resolve_source
from app.data.sources import ResolvedSource, check_sources_render, resolve_sources
from app.data.split import as_eval_path_error, eval_data_config
from app.data.template import TemplateSettings
from app.data.tokenizer import TextTokenizer, load_tokenizer


@dataclass(frozen=True, eq=False)
class ResolvedData:
    """Everything the driver resolved about data.* (see the module docstring)."""

    config: DataConfig
    tokenizer: TextTokenizer
    settings: TemplateSettings
    """The template knobs with the run's maximum sequence length."""
    source: DataSource | None
    """data.path's files (a prepared set: its shards); None for data.source=synthetic and data.sources."""
    eval_source: DataSource | None = None
    """data.eval_path's files; None without data.eval_path."""
    fingerprints: dict[str, Any] = dataclasses.field(default_factory=dict)
    """{"data.path" or "data.sources[i]" each: ..., "data.eval_path": ... (only with it)}:
    app/data/fingerprint.py."""
    manifest: Manifest | None = None
    """data.source=prepared: the prepared set's manifest (`source` holds its shards); None otherwise."""
    sources: tuple[ResolvedSource, ...] = ()
    """The datasets the run tokenizes (data.sources, or data.path as one): app/data/sources.py; () for
    synthetic and prepared data."""

    @property
    def chat_template_text(self) -> str | None:
        """The Jinja text the run renders chats with (None for data.chat_template=none)."""
        return resolve_template(self.tokenizer, self.config.chat_template, self.settings.template_text).text

    def eval_data(self) -> ResolvedData | None:
        """data.eval_path read with this run's tokenizer and template, or None without data.eval_path."""
        if self.eval_source is None:
            return None
        config = eval_data_config(self.config)
        (entry,) = config.source_configs()
        source = ResolvedSource(index=0, id=entry.source_id, config=entry, data=self.eval_source,
                                settings=dataclasses.replace(self.settings, format_type=config.format_type,
                                                             columns=config.columns),
                                take=None, key="data.eval_path")
        return dataclasses.replace(self, config=config, source=self.eval_source, eval_source=None,
                                   manifest=None, sources=(source,))

    def identity(self) -> dict[str, Any]:
        """What these rows depend on, by config knob (app/data/prepared.py): a prepared set's manifest."""
        return identity_of(self.config, self.tokenizer, self.settings, self.chat_template_text)


def template_settings(data: DataConfig, max_length: int | None) -> TemplateSettings:
    """The data.* template knobs; a data.chat_template file is read here, on the driver (DataError)."""
    template_text = read_template_file(data.chat_template) if is_template_file(data.chat_template) else ""
    return TemplateSettings(chat_template=data.chat_template, labels=data.labels, max_length=max_length,
                            too_long=data.too_long, truncate_side=data.truncate_side,
                            format_type=data.format_type, columns=data.columns, add_eos=data.add_eos,
                            template_text=template_text)


def resolve_data(data: DataConfig, *, max_length: int) -> ResolvedData:
    """Resolve data.* once; a DataError (a ConfigError) names the knob when anything is unusable."""
    check_format_settings(data.format_type, data.columns)  # app/data/formats/
    settings = template_settings(data, max_length)
    manifest = read_manifest(data) if data.source == "prepared" else None
    sources = resolve_sources(data, settings)  # () for synthetic and prepared data
    if manifest is not None:
        source: DataSource | None = manifest.data_source()
    else:
        source = sources[0].data if len(sources) == 1 and not data.sources else None
    eval_source = _eval_source(data)
    tokenizer = load_tokenizer(data.tokenizer)
    if data.synthetic:
        tokenizer.require_chat_ids()
    check_chat_template(tokenizer, settings)  # app/data/chat_template.py
    if data.sources:
        check_sources_render(sources, tokenizer)  # app/data/sources.py
    if manifest is not None:
        template = resolve_template(tokenizer, data.chat_template, settings.template_text).text
        check_identity(manifest, identity_of(data, tokenizer, settings, template), data)
        fingerprints = {"data.path": prepared_fingerprint(manifest, data)}
    else:
        fingerprints = source_fingerprints(data, sources)
    if eval_source is not None:
        fingerprints["data.eval_path"] = data_fingerprint(data, eval_source, data.eval_path)
    return ResolvedData(config=data, tokenizer=tokenizer, settings=settings, source=source,
                        eval_source=eval_source, fingerprints=fingerprints, manifest=manifest,
                        sources=sources)


def source_fingerprints(data: DataConfig, sources: tuple[ResolvedSource, ...]) -> dict[str, Any]:
    """{"data.path": ...} of the one source (or the synthetic parameters), {"data.sources[i]": ...} of a mix
    (the weights and max_samples are the config's math keys: app/rundir/snapshot.py)."""
    if not data.sources:
        return {"data.path": data_fingerprint(data, sources[0].data if sources else None)}
    return {source.key: data_fingerprint(data, source.data, source.config.path) for source in sources}


def _eval_source(data: DataConfig) -> DataSource | None:
    """data.eval_path's DataSource (its errors name data.eval_path), or None without it."""
    if not data.eval_path:
        return None
    try:
        return resolve_source(eval_data_config(data))
    except DataError as err:
        raise as_eval_path_error(err, data) from None
