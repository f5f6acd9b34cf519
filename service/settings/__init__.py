"""The one settings tree: env vars `NOBACKFILL_*` (nested with `__`) over an optional YAML file.

    tree.py      Settings: the sources (kwargs > env > the YAML file NOBACKFILL_CONFIG_FILE names), the refusals
    sections.py  its sections (encoders, cache, index, compat, api, traffic, cascade), one field a setting
    checks.py    settings that can never work together
    names.py     a setting's env var and how a refusal speaks of it

Nothing else in the service reads the environment.  What it exports is imported from here.
"""

from service.settings.checks import MODEL_FOLDER_BACKENDS, ONNX_BACKEND
from service.settings.names import ENV_PREFIX, NESTED, env_name
from service.settings.sections import (
    ARTIFACTS,
    NO_MODEL,
    ApiSettings,
    CacheSettings,
    CascadeSettings,
    CompatSettings,
    EncoderSettings,
    IndexSettings,
    Section,
    TrafficSettings,
)
from service.settings.tree import CONFIG_FILE_ENV, Settings

__all__ = [
    "ARTIFACTS",
    "CONFIG_FILE_ENV",
    "ENV_PREFIX",
    "MODEL_FOLDER_BACKENDS",
    "NESTED",
    "NO_MODEL",
    "ONNX_BACKEND",
    "ApiSettings",
    "CacheSettings",
    "CascadeSettings",
    "CompatSettings",
    "EncoderSettings",
    "IndexSettings",
    "Section",
    "Settings",
    "TrafficSettings",
    "env_name",
]
