"""Offline validation of rendered Kubernetes objects, as strict as `kubectl apply --validate=strict`:
core objects (Service, Deployment, ConfigMap, PodDisruptionBudget, ServiceAccount, Role, RoleBinding)
through the official client's models (kubernetes 37: pydantic models that reject unknown fields, missing
required fields and wrong types), LeaderWorkerSet and RoleBasedGroup through their CRDs' OpenAPI v3
schemas (LWS v0.10.0, rbg v0.8.0-alpha.5; tests/launch/data, source in each file's $comment), their
metadata and pod templates through the client's ObjectMeta and PodTemplateSpec models as well."""

from __future__ import annotations

import gzip
import json
from functools import cache
from pathlib import Path
from typing import Any, Mapping

import jsonschema
import pydantic
from sglang_p2p_backend.launch.rbg import leader_template
from kubernetes.client import (
    V1ConfigMap, V1Deployment, V1ObjectMeta, V1PodDisruptionBudget, V1PodTemplateSpec, V1Role, V1RoleBinding,
    V1Service, V1ServiceAccount,
)

LWS_VERSION = "v0.10.0"
LWS_SCHEMA = Path(__file__).parent / "data" / f"lws-{LWS_VERSION}-crd-schema.json.gz"
RBG_VERSION = "v0.8.0-alpha.5"
RBG_SCHEMA = Path(__file__).parent / "data" / f"rbg-{RBG_VERSION}-crd-schema.json.gz"
CORE_MODELS = {
    ("v1", "Service"): V1Service, ("apps/v1", "Deployment"): V1Deployment, ("v1", "ConfigMap"): V1ConfigMap,
    ("policy/v1", "PodDisruptionBudget"): V1PodDisruptionBudget, ("v1", "ServiceAccount"): V1ServiceAccount,
    ("rbac.authorization.k8s.io/v1", "Role"): V1Role, ("rbac.authorization.k8s.io/v1", "RoleBinding"): V1RoleBinding,
}


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
def crd_validator(path: Path) -> jsonschema.Draft4Validator:
    schema = _closed(json.loads(gzip.decompress(path.read_bytes())))
    jsonschema.Draft4Validator.check_schema(schema)
    return jsonschema.Draft4Validator(schema)


def _schema_problems(path: Path, obj: Mapping[str, Any]) -> list[str]:
    return [f"{'.'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in crd_validator(path).iter_errors(obj)]


def _model_problems(model: type[pydantic.BaseModel], data: Any, where: str) -> list[str]:
    try:
        model.model_validate(data)
    except pydantic.ValidationError as exc:
        return [f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
    return []


def _lws_problems(obj: Mapping[str, Any]) -> list[str]:
    found = _schema_problems(LWS_SCHEMA, obj) + _model_problems(V1ObjectMeta, obj.get("metadata"), "metadata")
    template = obj.get("spec", {}).get("leaderWorkerTemplate", {})
    for key in ("leaderTemplate", "workerTemplate"):
        if key in template:
            found += _model_problems(V1PodTemplateSpec, template[key], f"spec.leaderWorkerTemplate.{key}")
    return found


def _rbg_problems(obj: Mapping[str, Any]) -> list[str]:
    """The CRD schema, plus what its CEL rules and webhook check that a JSON schema cannot: the pod
    templates as pods, one pattern a role, dependencies naming roles of the group."""
    found = _schema_problems(RBG_SCHEMA, obj) + _model_problems(V1ObjectMeta, obj.get("metadata"), "metadata")
    roles = obj.get("spec", {}).get("roles", [])
    names = [r.get("name") for r in roles]
    for i, role in enumerate(roles):
        where = f"spec.roles.{i}"
        patterns = [p for p in ("standalonePattern", "leaderWorkerPattern", "customComponentsPattern") if p in role]
        if len(patterns) != 1:
            found.append(f"{where}: exactly one pattern, got {patterns}")
        for p in patterns[:1]:
            if "template" in role[p]:
                found += _model_problems(V1PodTemplateSpec, role[p]["template"], f"{where}.{p}.template")
            if "leaderTemplatePatch" in role[p]:  # a raw patch to the schema: check the leader's pod it makes
                found += _model_problems(V1PodTemplateSpec, leader_template(role[p]), f"{where}.{p}.leaderTemplatePatch")
        found += [f"{where}.dependencies: no role {d!r}" for d in role.get("dependencies", []) if d not in names]
    if len(set(names)) != len(names):
        found.append(f"spec.roles: names repeat: {names}")
    return found


def problems(obj: Mapping[str, Any]) -> list[str]:
    """Everything the API server (with the LWS and RBG CRDs installed) would reject or silently drop."""
    api, kind = obj.get("apiVersion"), obj.get("kind")
    if (api, kind) == ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"):
        return _lws_problems(obj)
    if (api, kind) == ("workloads.x-k8s.io/v1alpha2", "RoleBasedGroup"):
        return _rbg_problems(obj)
    model = CORE_MODELS.get((api, kind))
    if model is None:
        return [f"no schema for {api}/{kind}: add its model to CORE_MODELS"]
    return _model_problems(model, obj, kind or "")
