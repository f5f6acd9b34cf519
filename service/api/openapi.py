"""The published OpenAPI document states this deployment's request limits, not only the types.

Pydantic knows the body's shape; the limits come from settings (api.max_queries, max_k, ...) and are
enforced by the pipeline with a 400 / 413.  Writing them into the schema lets generated clients and
schemathesis produce requests the service accepts, and know which ones it refuses.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI

from service.settings import ApiSettings
from service.vocabulary import Mode


def state_limits(schema: dict[str, Any], api: ApiSettings) -> None:
    """Write the request limits of `api` into the SearchRequest and QueryIn schemas of `schema`, in place."""
    components = schema["components"]["schemas"]
    search = components["SearchRequest"]["properties"]
    search["queries"].update(minItems=1, maxItems=api.max_queries)
    search["k"].update(minimum=1, maximum=api.max_k)
    for name, bounds in (("alpha", {"minimum": 0.0, "maximum": 1.0}), ("nprobe", {"minimum": 1})):
        branches = search[name]["anyOf"]
        for branch in branches:
            if branch.get("type") != "null":
                branch.update(bounds)
    for branch in search["mode"]["anyOf"]:
        if branch.get("type") == "string":
            branch["enum"] = sorted(mode.value for mode in Mode)  # the loaded profile serves a subset (others: 400)
    query = components["QueryIn"]
    props = query["properties"]
    for branch in props["text"]["anyOf"]:
        if branch.get("type") == "string":
            branch.update(minLength=1, maxLength=api.max_text_chars, pattern=r"\S")
    for branch in props["image_b64"]["anyOf"]:
        if branch.get("type") == "string":
            branch.update(maxLength=api.max_image_bytes * 4 // 3 + 4)
    # Exactly one kind of query: text, or an image, or precomputed embeddings (one or both).
    query["oneOf"] = [
        {"required": ["text"], "properties": {"text": {"type": "string"}}},
        {"required": ["image_b64"], "properties": {"image_b64": {"type": "string"}}},
        {
            "anyOf": [
                {"required": ["old_embedding"], "properties": {"old_embedding": {"type": "array"}}},
                {"required": ["new_embedding"], "properties": {"new_embedding": {"type": "array"}}},
            ]
        },
    ]


def declare_only_configured_keys(schema: dict[str, Any], api: ApiSettings) -> None:
    """Drop from `schema`, in place, the bearer schemes whose key is not configured: a keyless deployment (as
    `make demo` is) would otherwise declare an Authorization header that it never asks for."""
    unset = {name for name, key in (("ApiKey", api.api_key), ("AdminKey", api.admin_key)) if key is None}
    for operations in schema.get("paths", {}).values():
        for operation in operations.values():
            if "security" not in operation:
                continue
            operation["security"] = [need for need in operation["security"] if not set(need) & unset]
            if not operation["security"]:
                del operation["security"]
    schemes = schema.get("components", {}).get("securitySchemes", {})
    for name in unset:
        schemes.pop(name, None)
    if not schemes:
        schema.get("components", {}).pop("securitySchemes", None)


def publish_limits(app: FastAPI, api: ApiSettings) -> None:
    """Make `app.openapi()` return FastAPI's document with the limits of `api` written in, and only its keys."""
    generate = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = generate()
            state_limits(schema, api)
            declare_only_configured_keys(schema, api)
        assert app.openapi_schema is not None
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
