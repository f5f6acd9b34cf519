"""The one settings tree: env vars `NOBACKFILL_*` (nested with `__`) over an optional YAML file.

The YAML file is named by `NOBACKFILL_CONFIG_FILE`; env vars win over it, explicit kwargs win over both.
Nothing else in the service reads the environment.

What can never work is refused when Settings() is built, in one SettingsError line that names the
variables, the value and what is expected (the CLI prints it and exits 2, before anything starts):
a key no section has (env var or YAML), a NOBACKFILL_X__Y whose X is no section, a value of the wrong
type, and settings that contradict each other (checks.py).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError, model_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)
from pydantic_settings import SettingsError as PydanticSettingsError

from service.errors import SettingsError
from service.settings.checks import contradictions
from service.settings.names import ENV_PREFIX, NESTED, closest, env_name, problems
from service.settings.sections import (
    NO_MODEL,
    ApiSettings,
    CacheSettings,
    CascadeSettings,
    CompatSettings,
    EncoderSettings,
    IndexSettings,
    TrafficSettings,
)

CONFIG_FILE_ENV = "NOBACKFILL_CONFIG_FILE"


class Settings(BaseSettings):
    """Everything configurable, in one tree."""

    # extra="forbid": an unknown top-level key (kwargs, YAML) is refused.  Env vars are only ever read
    # for the fields (NOBACKFILL_API_KEY, NOBACKFILL_TEST_REDIS_URL, ... are no settings and stay
    # ignored); a NOBACKFILL_X__Y with no section X is refused by `_refuse_unknown_sections`.
    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter=NESTED,
        extra="forbid",
    )

    old: EncoderSettings = EncoderSettings(backend="synthetic-old")
    new: EncoderSettings = EncoderSettings(backend="synthetic-new")
    cache: CacheSettings = CacheSettings()
    index: IndexSettings = IndexSettings()
    compat: CompatSettings = CompatSettings()
    api: ApiSettings = ApiSettings()
    traffic: TrafficSettings = TrafficSettings()
    cascade: CascadeSettings = CascadeSettings()

    @property
    def cut_over(self) -> bool:
        """Whether the old model is gone (old.backend none): the new model alone over the finished segment."""
        return self.old.backend == NO_MODEL

    def __init__(self, **values: Any) -> None:
        """Kwargs over env over the YAML file; whatever can never work raises one SettingsError line."""
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(f"invalid settings: {'; '.join(problems(exc, Settings))}") from exc
        except yaml.YAMLError as exc:  # its message spans lines: where, then what
            where = " ".join(line.strip() for line in str(exc).splitlines())
            raise SettingsError(
                f"{CONFIG_FILE_ENV}={os.environ.get(CONFIG_FILE_ENV)} is not valid YAML: {where}"
            ) from exc
        except PydanticSettingsError as exc:  # NOBACKFILL_INDEX='not json' and the like
            what = " ".join(str(exc).split())
            raise SettingsError(
                f"invalid settings: {what} (a section set as one variable must be a JSON object)"
            ) from exc

    @model_validator(mode="before")
    @classmethod
    def _refuse_unknown_sections(cls, data: Any) -> Any:
        """A NOBACKFILL_X__Y env var whose X is no section is a typo: it would be ignored, so it is refused."""
        for name in os.environ:
            if not name.upper().startswith(ENV_PREFIX):
                continue
            section, nested, key = name.upper().removeprefix(ENV_PREFIX).partition(NESTED)
            if not nested or section.lower() in cls.model_fields:  # NOBACKFILL_API_KEY and the like: no setting
                continue
            close = closest(section, cls.model_fields)
            hint = f"; did you mean {env_name(close, key)}?" if close else ""
            problem = (
                f"{name} names no settings section {section.lower()!r}{hint} (they are {', '.join(cls.model_fields)})"
            )
            raise PydanticCustomError("unknown_section", "{problem}", {"problem": problem})
        return data

    @model_validator(mode="after")
    def _refuse_contradictions(self) -> Settings:
        """Settings that are each valid but can never work together: refused now, not at the first request."""
        problems = contradictions(self)
        if problems:
            raise PydanticCustomError("contradiction", "{problem}", {"problem": "; ".join(problems)})
        return self

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,  # noqa: ARG003 (pydantic passes it by name)
        file_secret_settings: PydanticBaseSettingsSource,  # noqa: ARG003
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Kwargs, then env, then the YAML file named by NOBACKFILL_CONFIG_FILE."""
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        config_file = os.environ.get(CONFIG_FILE_ENV)
        if config_file:
            if not Path(config_file).is_file():  # pydantic-settings would silently read nothing
                raise SettingsError(f"{CONFIG_FILE_ENV}={config_file}: no such file (expected a YAML settings file)")
            sources.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_file))
        return tuple(sources)
