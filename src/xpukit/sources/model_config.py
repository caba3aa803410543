"""Where a model comes from: a local directory, a Hub id, a built-in shape, or a config — and reading
its config, before any decision is taken.

Only ``config.json`` is read, never weights. A Hub id is read from the local cache when the Hub is
offline (``HF_HUB_OFFLINE``) or found unreachable by the bounded check of :mod:`xpukit.hub`, so a
silent endpoint costs seconds, not forever.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from xpukit.errors import InvalidRequestError
from xpukit.hub import RECHECK_HINT, hub_offline, hub_status

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

__all__ = ["BuiltinShapes", "ConfigRead", "is_path_like", "local_model_dir", "read_config"]


@dataclass(frozen=True, kw_only=True)
class BuiltinShapes:
    """The built-in shapes a model name may mean (planning's table,
    :data:`xpukit.planning.model.reference_models.BUILTIN_SHAPES`), handed to :func:`read_config`.

    Attributes:
        names: the shapes' names (lower case).
        hub_ids: shape name → the Hub model whose config it copies.
        build: a shape's config, built offline from its name.
    """

    names: frozenset[str] = frozenset()
    hub_ids: Mapping[str, str] = field(default_factory=dict)
    build: Callable[[str], PreTrainedConfig] | None = None


class ConfigRead(NamedTuple):
    """What :func:`read_config` read: the config, where the weights come from (``None``: nowhere, a
    built-in shape or a bare config), a display name, and the keywords the config consumed."""

    config: PreTrainedConfig
    source: str | None
    name: str
    consumed: frozenset[str]


# from_pretrained keywords that locate files; AutoConfig consumes them but the weights need them too.
_HUB_KWARGS = frozenset(
    {
        "revision",
        "token",
        "cache_dir",
        "subfolder",
        "trust_remote_code",
        "local_files_only",
        "force_download",
        "proxies",
        "code_revision",
        "_commit_hash",
    }
)
_HUB_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


def is_path_like(model: str) -> bool:
    """Whether a model string is meant as a filesystem path rather than a Hub id."""
    return model.startswith(("/", "./", "../", "~")) or "\\" in model or model.count("/") > 1


def local_model_dir(model: str | Path) -> Path | None:
    """The directory of a local model, ``None`` for a Hub id; errors for a bad path.

    Raises:
        InvalidRequestError: a path that does not exist, is not a directory, or has no config.json.
    """
    text = str(model)
    path = Path(text).expanduser()
    if not path.exists():
        if isinstance(model, Path) or is_path_like(text):
            raise InvalidRequestError(
                f"Model path {text!r} does not exist. Pass an existing model directory (with "
                "config.json and the weights) or a Hub model id such as 'Qwen/Qwen3-0.6B'."
            )
        return None
    if not path.is_dir():
        raise InvalidRequestError(
            f"Model path {text!r} is a file; pass the directory that holds config.json and the weights."
        )
    if not (path / "config.json").is_file():
        adapter = _adapter_problem(path, text)
        if adapter is not None:
            raise InvalidRequestError(adapter)
        raise InvalidRequestError(
            f"Model directory {text!r} has no config.json, so it is not a transformers model directory. "
            "Fix: pass the directory written by save_pretrained() (or a Hub id)."
        )
    return path


def _adapter_problem(path: Path, text: str) -> str | None:
    """The message for a LoRA adapter directory passed where a model goes, else ``None``: the
    adapter's own config names the base it was trained on (``base_model_name_or_path``)."""
    import json

    config = path / "adapter_config.json"
    if not config.is_file():
        return None
    try:
        data = json.loads(config.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        data = {}
    base = data.get("base_model_name_or_path") if isinstance(data, dict) else None
    base_text = repr(str(base)) if base else "'<its base model>'"
    return (
        f"{text!r} is a LoRA adapter (adapter_config.json found), not a model: it has no config.json and "
        f"no base weights. Fix: load it on its base, load_for_xpu({base_text}, lora={text!r}) (the "
        f"command line: xpukit merge {str(base) if base else 'BASE'} {text} OUT writes the merged model)."
    )


def read_config(model: object, kwargs: dict[str, Any], *, shapes: BuiltinShapes | None = None) -> ConfigRead:
    """The config, where the weights come from, a display name, and the kwargs the config consumed.

    ``shapes``: the built-in shapes a name may mean (none when not given).
    """
    shapes = BuiltinShapes() if shapes is None else shapes
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig, PreTrainedConfig

    given = kwargs.get("config")
    if given is not None:
        if not isinstance(given, PreTrainedConfig):
            raise InvalidRequestError(f"config={given!r} must be a transformers PretrainedConfig.")
        if (
            isinstance(model, (str, Path))
            and local_model_dir(model) is None
            and not _HUB_ID.match(str(model))
        ):
            raise InvalidRequestError(
                f"model={str(model)!r} is neither an existing directory nor a Hub model id."
            )
        # from_pretrained(model, config=config): the weights come from `model`, the config as given.
        weights = str(model) if isinstance(model, (str, Path)) else None
        return ConfigRead(given, weights, str(model), frozenset())
    if isinstance(model, PreTrainedConfig):
        named = str(getattr(model, "_name_or_path", "") or "")
        source = None
        if (named and Path(named).is_dir()) or (
            named and _HUB_ID.match(named) and named.lower() not in shapes.names
        ):
            source = named
        return ConfigRead(model, source, named or "<config>", frozenset())
    if not isinstance(model, (str, Path)):
        raise InvalidRequestError(
            f"model={model!r} ({type(model).__name__}) is not a Hub id, a local directory or a "
            "PretrainedConfig."
        )
    local = local_model_dir(model)
    text = str(model)
    config_kwargs = dict(kwargs)
    if local is None and shapes.build is not None and text.lower() in shapes.names:
        # a built-in shape, as `xpukit plan` takes it
        return ConfigRead(shapes.build(text), None, text.lower(), frozenset())
    if local is not None:
        try:
            config, unused = AutoConfig.from_pretrained(
                str(local), return_unused_kwargs=True, **config_kwargs
            )
        except (OSError, ValueError, StrictDataclassError) as exc:
            problem = local_config_problem(local, exc)
        else:
            return ConfigRead(config, str(local), text, _consumed(kwargs, unused))
        raise InvalidRequestError(problem)  # outside `except`: no chained transformers traceback
    if not _HUB_ID.match(text):
        raise InvalidRequestError(
            f"model={text!r} is neither an existing directory nor a Hub model id ('org/name'). Fix: pass the "
            "directory written by save_pretrained() or a Hub id such as 'Qwen/Qwen3-0.6B'."
        )
    if hub_offline():
        local_only, why = True, "HF_HUB_OFFLINE is set"
    else:
        status = hub_status()
        local_only, why = not status.usable, status.reason
    if local_only:
        config_kwargs["local_files_only"] = True
    try:
        config, unused = AutoConfig.from_pretrained(text, return_unused_kwargs=True, **config_kwargs)
    except StrictDataclassError as exc:
        problem = f"The config of {text!r} {_refused_value(exc)}"
    except (OSError, ValueError) as exc:
        if local_only:
            recheck = "" if hub_offline() else f" ({RECHECK_HINT})"
            dry_run = _shape_hint(text, shapes)
            raise InvalidRequestError(
                f"{text!r} is not a local directory, and its config is not in the local Hub cache "
                "while the Hub "
                f"cannot be used ({why}). Fix: download it while online (`hf download {text}`), or "
                f"pass a local directory{recheck}.{dry_run}"
            ) from exc
        raise InvalidRequestError(f"Could not read the config of {text!r} from the Hub: {exc}") from exc
    else:
        return ConfigRead(config, text, text, _consumed(kwargs, unused))
    raise InvalidRequestError(problem)  # outside `except`: no chained transformers traceback


def _shape_hint(text: str, shapes: BuiltinShapes) -> str:
    """For a Hub id that cannot be read: the built-in shape of that very model, or the one a name
    without an organisation was probably meant as (``qwen3-9b``); nothing for any other id."""
    same = next((k for k, hub_id in shapes.hub_ids.items() if hub_id.lower() == text.lower()), None)
    if same is not None:
        return (
            f" To plan without the download: the built-in shape {same!r} has {text}'s config "
            f"(plan_load({same!r}), `xpukit plan {same}`)."
        )
    close = difflib.get_close_matches(text.lower(), list(shapes.names), n=1) if "/" not in text else []
    return f" Did you mean the built-in shape {close[0]!r}?" if close else ""


def _refused_value(exc: Exception) -> str:
    """What transformers' strict config classes refused (a value of the wrong type or range), and the fix."""
    import transformers

    why = " ".join(str(exc).split())
    return (
        f"has a value transformers {transformers.__version__} refuses ({why}). Fix: correct that value in "
        "config.json (as save_pretrained() wrote it), or download the model again."
    )


def local_config_problem(local: Path, exc: Exception) -> str:
    """Why transformers could not read the config.json of a local directory, with the fix."""
    import json

    import transformers
    from huggingface_hub.errors import StrictDataclassError
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if isinstance(exc, StrictDataclassError):
        return f"Model directory '{local}': config.json {_refused_value(exc)}"
    path = local / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as bad:
        return (
            f"Model directory '{local}': config.json is not valid JSON ({bad}). Fix: restore the file "
            "save_pretrained() wrote (or download the model again)."
        )
    model_type = data.get("model_type") if isinstance(data, dict) else None
    if model_type is None:
        return (
            f"Model directory '{local}': config.json has no model_type, so transformers cannot tell the "
            f"architecture ({exc}). Fix: use the config.json save_pretrained() wrote."
        )
    if model_type not in CONFIG_MAPPING:
        return (
            f"Model directory '{local}': config.json has model_type={model_type!r}, which transformers "
            f"{transformers.__version__} does not know. Fix: upgrade transformers (pip install -U "
            "transformers) if the architecture is newer than this release; a model that ships its own "
            "modelling code needs trust_remote_code=True, which xpukit never sets for you (docs/security.md)."
        )
    return f"Model directory '{local}': transformers could not read config.json: {exc}"


def _consumed(kwargs: dict[str, Any], unused: dict[str, Any]) -> frozenset[str]:
    # Config overrides (e.g. rope_scaling=...) are applied to the config; file-locating keywords are
    # still needed for the weights.
    return frozenset(set(kwargs) - set(unused) - _HUB_KWARGS)
