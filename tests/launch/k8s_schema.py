"""Offline validation of rendered Kubernetes objects, as strict as `kubectl apply --validate=strict`:
core objects (Service, Deployment) through the official client's models (kubernetes 37: pydantic models
that reject unknown fields, missing required fields and wrong types), LeaderWorkerSet through the CRD's
OpenAPI v3 schema of LWS v0.10.0 (tests/launch/data), its metadata and pod templates through the client's
ObjectMeta and PodTemplateSpec models as well."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import pydantic
from kubernetes.client import V1Deployment, V1ObjectMeta, V1PodTemplateSpec, V1Service

LWS_VERSION = "v0.10.0"
LWS_SCHEMA = Path(__file__).parent / "data" / f"lws-{LWS_VERSION}-crd-schema.json"
CORE_MODELS = {("v1", "Service"): V1Service, ("apps/v1", "Deployment"): V1Deployment}


def _closed(node: Any) -> Any:
    """The schema with every declared object closed: the API server prunes fields a structural schema does
    not declare (and strict validation rejects them), so an unknown field is an error here."""
    if not isinstance(node, dict):
        return node
    out = dict(node)
    if "properties" in out:
        out["properties"] = {k: _closed(v) for k, v in out["properties"].items()}
        if "additionalProperties" not in out and not out.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    for key in ("items", "additionalProperties", "not"):
        if isinstance(out.get(key), dict):
            out[key] = _closed(out[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in out:
            out[key] = [_closed(s) for s in out[key]]
    return out


@cache
def lws_validator() -> jsonschema.Draft4Validator:
    schema = _closed(json.loads(LWS_SCHEMA.read_text()))
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def _model_problems(model: type[pydantic.BaseModel], data: Any, where: str) -> list[str]:
    try:
        model.model_validate(data)
    except pydantic.ValidationError as exc:
        return [f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return []


def _lws_problems(obj: Mapping[str, Any]) -> list[str]:
    found = [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in lws_validator().iter_errors(obj)]
    found += _model_problems(V1ObjectMeta, obj.get("metadata"), "metadata")
    template = obj.get("spec", {}).get("leaderWorkerTemplate", {})
    for key in ("leaderTemplate", "workerTemplate"):
        if key in template:
            found += _model_problems(V1PodTemplateSpec, template[key], f"spec.leaderWorkerTemplate.{key}")
    return found


def problems(obj: Mapping[str, Any]) -> list[str]:
    """Everything the API server (with the LWS CRD installed) would reject or silently drop."""
    api, kind = obj.get("apiVersion"), obj.get("kind")
    if (api, kind) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"):
        return _lws_problems(obj)
    model = CORE_MODELS.get((api, kind))
    if model is None:
        return [f"no schema for {api}/{kind}: add its model to CORE_MODELS"]
    return _model_problems(model, obj, kind or "")
