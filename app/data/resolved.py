"""A run's data as the driver resolves it, once per process: the sources, the tokenizer, the template.

    resolve_data(data, max_length)                     (preflight calls it, before Ray starts)
        ├── resolve_source(data.path)                  files in read order, format, columns (not synthetic)
        │   or read_manifest(data.path)                data.source=prepared: the manifest, read once; its
        │                                              identity checked against this config (check_identity)
        ├── resolve_source(data.eval_path)             only with data.eval_path; errors name that key
        ├── load_tokenizer(data.tokenizer)
        ├── TemplateSettings (a data.chat_template file is read here) + check_chat_template
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
    """data.path's files; None for data.source=synthetic."""
    eval_source: DataSource | None = None
    """data.eval_path's files; None without data.eval_path."""
    fingerprints: dict[str, Any] = dataclasses.field(default_factory=dict)
    """{"data.path": ..., "data.eval_path": ... (only with it)}: app/data/fingerprint.py."""
    manifest: Manifest | None = None
    """data.source=prepared: the prepared set's manifest (`source` holds its shards); None otherwise."""

    @property
    def chat_template_text(self) -> str | None:
        """The Jinja text the run renders chats with (None for data.chat_template=none)."""
        return resolve_template(self.tokenizer, self.config.chat_template, self.settings.template_text).text

    def eval_data(self) -> ResolvedData | None:
        """data.eval_path read with this run's tokenizer and template, or None without data.eval_path."""
        if self.eval_source is None:
            return None
        return dataclasses.replace(self, config=eval_data_config(self.config), source=self.eval_source,
                                   eval_source=None, manifest=None)

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
    manifest = read_manifest(data) if data.source == "prepared" else None
    if manifest is not None:
        source: DataSource | None = manifest.data_source()
    else:
        source = resolve_source(data) if data.source != "synthetic" else None
    eval_source = _eval_source(data)
    tokenizer = load_tokenizer(data.tokenizer)
    if data.source == "synthetic":
        tokenizer.require_chat_ids()
    settings = template_settings(data, max_length)
    check_chat_template(tokenizer, settings)  # app/data/chat_template.py
    if manifest is not None:
        template = resolve_template(tokenizer, data.chat_template, settings.template_text).text
        check_identity(manifest, identity_of(data, tokenizer, settings, template), data)
        fingerprints = {"data.path": prepared_fingerprint(manifest, data)}
    else:
        fingerprints = {"data.path": data_fingerprint(data, source)}
    if eval_source is not None:
        fingerprints["data.eval_path"] = data_fingerprint(data, eval_source, data.eval_path)
    return ResolvedData(config=data, tokenizer=tokenizer, settings=settings, source=source,
                        eval_source=eval_source, fingerprints=fingerprints, manifest=manifest)


def _eval_source(data: DataConfig) -> DataSource | None:
    """data.eval_path's DataSource (its errors name data.eval_path), or None without it."""
    if not data.eval_path:
        return None
    try:
        return resolve_source(eval_data_config(data))
    except DataError as err:
        raise as_eval_path_error(err, data) from None
