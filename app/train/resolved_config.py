"""The configuration a run would use (`python -m app config show`): defaults filled, and every `auto` (or
0-means-derived) value that can be known without a GPU replaced by the value the run derives.

    key                        written  resolved to                           by
    scheduling.bucket_size     auto     C tokens per rank                     app/profiling/memory.py
    scheduling.cp_degrees      auto     every power of two dividing N         scheduling/dacp_degrees.py
    data.max_length            0        C x N (the hard limit)                max_sequence_length
    data.tokenizer             auto     the model's own tokenizer, or qwen    app/config.py
    data.chat_template         auto     model (the tokenizer's own) | chatml (it has none)
    parallel.backend           auto     nccl with GPUs, gloo without
    model.attention_backend    auto     torch on CPU workers (on GPUs it depends on the workers'
                                        flash-attn: left auto)
    resources.num_cpus         0        this machine's cores + 2              an embedded Ray only
    data.tokenize_concurrency  auto     the CPUs the training reservation leaves (app/data/concurrency.py)
    run.name, train.steps      "", 0    not resolved (known when `train` starts): a note says so

The last two depend on the machine: they are resolved only for an embedded Ray here (no RAY_ADDRESS) that
can hold the run; otherwise they stay as written and the note says what they follow. Each resolution is a
`Resolution` (key, setting as written, value, source, why); a value that cannot be resolved here (a hub
tokenizer that does not load offline) stays as written with the reason.
"""

from __future__ import annotations

import copy
import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from app.config import SkrullConfig, load_config, load_yaml, parse_override, resolve_config_path


@dataclass(frozen=True)
class Resolution:
    """One value the shown config holds in place of what was written."""

    key: str
    setting: Any
    """As written in the file or --set (or the default)."""
    value: Any
    """What the run uses (the setting itself when it cannot be resolved here)."""
    source: str
    """Where the value comes from: config | memory | model | tokenizer | this machine | not resolved."""
    why: str

    @property
    def changed(self) -> bool:
        return self.value != self.setting

    def as_json(self) -> dict[str, Any]:
        return {"setting": _plain(self.setting), "value": _plain(self.value), "source": self.source,
                "why": self.why}


@dataclass(frozen=True)
class ShownConfig:
    config: SkrullConfig
    """The config with every resolved value in place (loadable again: as_tree)."""
    resolutions: list[Resolution]
    derived: dict[str, Any]
    """Values no key holds: DP size, worker range, the run's longest sequence."""

    def as_tree(self) -> dict[str, Any]:
        """The config as YAML/JSON-ready nested dicts (tuples as lists), in the tree's order."""
        return _plain(self.config.to_dict())


Resolver = Callable[[SkrullConfig, dict[str, Any]], tuple[SkrullConfig, Resolution | None]]


def written_tree(path: str | None, overrides: list[str] | tuple[str, ...]) -> dict[str, Any]:
    """The keys as written in the file and the overrides (no defaults), to tell `auto` from a number."""
    tree = load_yaml(resolve_config_path(path)) if path else {}
    tree = copy.deepcopy(tree) if isinstance(tree, dict) else {}
    for text in overrides:
        key, value = parse_override(text)
        node = tree
        for part in key.split(".")[:-1]:
            node = node.setdefault(part, {}) if isinstance(node, dict) else {}
        if isinstance(node, dict):
            node[key.split(".")[-1]] = value
    return tree


def written(tree: dict[str, Any], key: str, default: Any) -> Any:
    node: Any = tree
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def _replace(config: SkrullConfig, key: str, value: Any) -> SkrullConfig:
    section, name = key.split(".")
    return dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section),
                                                                       **{name: value})})


def _checkpointing(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    """train.activation_checkpointing=auto: the planner's choice (app/profiling/checkpointing.py), which
    models steps over the data's sampled lengths; where the data cannot be read here (a cluster path, data
    not made yet) over the synthetic data.distribution's, and the line says so."""
    from app.data import DataError
    from app.profiling.checkpointing import choose_checkpointing

    if config.train.activation_checkpointing != "auto":
        return config, None
    note = ""
    try:
        choice = choose_checkpointing(config)
    except DataError as err:
        probe = dataclasses.replace(config, data=dataclasses.replace(config.data, source="synthetic"))
        choice = choose_checkpointing(probe)
        note = (f"; lengths sampled from the synthetic {config.data.distribution} distribution, because the "
                f"data cannot be read here ({err})")
    train = dataclasses.replace(config.train, **choice.chosen.setting.train_values())
    return (dataclasses.replace(config, train=train),
            Resolution("train.activation_checkpointing", "auto", train.activation_checkpointing,
                       "memory", choice.line() + note))


def _bucket_size(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution]:
    from app.profiling.budget import resolve_bucket_size

    setting = config.scheduling.bucket_size
    config, budget = resolve_bucket_size(config)
    return config, Resolution("scheduling.bucket_size", setting, budget.tokens, budget.source, budget.line())


def _cp_degrees(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    setting = config.scheduling.cp_degrees
    if setting != "auto":
        return config, None
    degrees = config.cp_degrees
    return (_replace(config, "scheduling.cp_degrees", degrees),
            Resolution("scheduling.cp_degrees", setting, degrees, "config",
                       f"auto: every power of two dividing parallel.cp_size={config.parallel.cp_size}"))


def _max_length(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    if config.data.max_length:
        return config, None
    limit = config.max_sequence_length
    why = (f"0: scheduling.bucket_size x parallel.cp_size = {config.scheduling.bucket_size:,} x "
           f"{config.parallel.cp_size}, the longest sequence one CP group holds")
    return _replace(config, "data.max_length", limit), Resolution("data.max_length", 0, limit, "config", why)


def _tokenizer(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    setting = written(tree, "data.tokenizer", "auto")
    if setting != "auto":
        return config, None
    # SkrullConfig resolved it at load (app/config.py default_tokenizer); the shown value says from what.
    return config, Resolution("data.tokenizer", setting, config.data.tokenizer, "model",
                              f"auto: model.name_or_path={config.model.name_or_path}'s own tokenizer "
                              "(qwen for a tiny preset or a model directory without tokenizer files)")


def _chat_template(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    setting = config.data.chat_template
    if setting != "auto":
        return config, None
    from app.data import DataError
    from app.data.tokenizer import load_tokenizer

    try:
        tokenizer = load_tokenizer(config.data.tokenizer)
    except (DataError, OSError, ValueError) as err:  # a hub tokenizer offline: the run's preflight says it
        first = str(err).splitlines()[0] if str(err) else type(err).__name__
        return config, Resolution("data.chat_template", setting, setting, "not resolved",
                                  f"data.tokenizer={config.data.tokenizer} does not load here: {first}")
    own = tokenizer.chat_template is not None
    value = "model" if own else "chatml"
    why = (f"auto: data.tokenizer={config.data.tokenizer} " +
           ("has a chat template of its own" if own else "has no chat template, so ChatML"))
    return _replace(config, "data.chat_template", value), Resolution(
        "data.chat_template", setting, value, "tokenizer", why)


def _backend(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    setting = config.parallel.backend
    if setting != "auto":
        return config, None
    on_gpu = config.resources.gpus_per_worker > 0
    value = "nccl" if on_gpu else "gloo"
    return _replace(config, "parallel.backend", value), Resolution(
        "parallel.backend", setting, value, "config",
        f"auto: resources.gpus_per_worker={config.resources.gpus_per_worker:g}")


def _attention(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    setting = config.model.attention_backend
    if setting != "auto":
        return config, None
    if config.resources.gpus_per_worker > 0:
        return config, Resolution("model.attention_backend", setting, setting, "not resolved",
                                  "auto on GPU workers: flash when flash-attn imports there, else "
                                  "torch-flash (decided on each worker)")
    return _replace(config, "model.attention_backend", "torch"), Resolution(
        "model.attention_backend", setting, "torch", "config", "auto on CPU workers: torch")


def _embedded_fit(config: SkrullConfig) -> str | None:
    """Why machine-dependent values are not resolved here (None: an embedded Ray here holds the run)."""
    from app.train.cluster import embedded_num_cpus
    from app.train.preflight import required_resources

    if os.environ.get("RAY_ADDRESS"):
        return "RAY_ADDRESS is set: the CPUs of that cluster decide"
    need, have = required_resources(config)["CPU"], embedded_num_cpus(config)
    if need > have:
        return (f"an embedded Ray on this machine cannot hold this run ({need:g} CPUs needed, {have:g} "
                "here): the CPUs of the cluster it runs on decide")
    return None


def _num_cpus(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    from app.train.cluster import embedded_num_cpus

    if config.resources.num_cpus:
        return config, None
    if (reason := _embedded_fit(config)) is not None:
        return config, Resolution("resources.num_cpus", 0, 0, "not resolved", reason)
    cpus = float(embedded_num_cpus(config))
    return _replace(config, "resources.num_cpus", cpus), Resolution(
        "resources.num_cpus", 0, cpus, "this machine",
        f"0: an embedded Ray on this machine declares its {os.cpu_count()} cores + 2 logical CPUs")


def _tokenize_concurrency(config: SkrullConfig, tree: dict[str, Any]
                          ) -> tuple[SkrullConfig, Resolution | None]:
    from app.data.concurrency import tokenize_tasks
    from app.train.cluster import embedded_num_cpus

    setting = config.data.tokenize_concurrency
    if setting != "auto":
        return config, None
    if (reason := _embedded_fit(config)) is not None:
        return config, Resolution("data.tokenize_concurrency", setting, setting, "not resolved", reason)
    cpus = embedded_num_cpus(config)
    tasks = tokenize_tasks(config, cpus, cores=os.cpu_count())
    res = config.resources
    why = (f"auto: ({cpus:g} CPUs - {config.parallel.worker_range[1]} workers x {res.cpus_per_worker:g} - "
           f"{res.planner_cpus:g} planner) / {res.data_cpus:g} per task, at most {os.cpu_count()} cores")
    return _replace(config, "data.tokenize_concurrency", tasks), Resolution(
        "data.tokenize_concurrency", setting, tasks, "this machine", why)


def _run_name(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    if config.run.name:
        return config, None
    return config, Resolution("run.name", "", "", "not resolved",
                              "empty: `train` names the run skrull-<timestamp>-<4 hex digits> when it starts")


def _steps(config: SkrullConfig, tree: dict[str, Any]) -> tuple[SkrullConfig, Resolution | None]:
    if config.train.steps:
        return config, None
    return config, Resolution("train.steps", 0, 0, "not resolved",
                              f"0: train.epochs={config.train.epochs} passes over the usable rows, which "
                              "`train` counts after tokenizing and prints")


RESOLVERS: tuple[Resolver, ...] = (_run_name, _steps, _checkpointing, _bucket_size, _cp_degrees, _max_length,
                                   _tokenizer, _chat_template, _backend, _attention, _num_cpus,
                                   _tokenize_concurrency)
"""In order: BucketSize needs the checkpointing setting, data.max_length the resolved BucketSize. One function
per key; a new auto key adds one."""


def show_config(path: str | None, overrides: list[str] | tuple[str, ...] = ()) -> ShownConfig:
    """The config of `path` + overrides with every resolution of RESOLVERS applied (see module docstring)."""
    config = load_config(path, overrides)
    tree = written_tree(path, overrides)
    resolutions = []
    for resolver in RESOLVERS:
        config, resolution = resolver(config, tree)
        if resolution is not None:
            resolutions.append(resolution)
    low, high = config.parallel.worker_range
    cp = config.parallel.cp_size
    derived = {"workers": [low, high], "dp_size": [low // cp, high // cp], "cp_size": cp,
               "max_sequence_length": config.max_sequence_length}
    return ShownConfig(config=config, resolutions=resolutions, derived=derived)


def _plain(value: Any) -> Any:
    """Tuples as lists, recursively (YAML and JSON write lists)."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def to_yaml(shown: ShownConfig, header: list[str]) -> str:
    """The shown config as YAML: `header` and the resolutions as comments, then the tree; each resolved
    key's line carries `# <setting> -> <source>`."""
    import yaml

    notes = {r.key: f"{_words(r.setting)} -> {r.source}" if r.changed else r.source
             for r in shown.resolutions}
    lines = [f"# {line}" if line else "#" for line in header]
    lines += ["# resolved:"] + [f"#   {r.key} = {_words(r.value)} ({r.source}): {r.why}"
                                for r in shown.resolutions]
    d = shown.derived
    lines.append(f"# derived: DP {_span(d['dp_size'])} x CP {d['cp_size']} over {_span(d['workers'])} "
                 f"workers; longest sequence {d['max_sequence_length']:,} tokens")
    for section, values in shown.as_tree().items():
        lines.append(f"{section}:")
        for key, value in values.items():
            # flow style: one line per key, so a resolved key's line carries its note
            text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6)
            text = text.removesuffix("\n...\n")
            note = notes.get(f"{section}.{key}")
            lines.append(f"  {key}: {text.strip()}" + (f"  # {note}" if note else ""))
    return "\n".join(lines) + "\n"


def _words(value: Any) -> str:
    return "[" + ", ".join(map(str, value)) + "]" if isinstance(value, tuple | list) else str(value)


def _span(pair: list[int]) -> str:
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}-{pair[1]}"
