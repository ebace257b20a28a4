"""Validate a custom resource against its CRD the way kube-apiserver does.

Three steps, in the API server's order: structural defaults, the ``openAPIV3Schema`` (checked
with jsonschema; ``validate`` reports unknown fields too, as a strict check of a manifest), then the
CEL ``x-kubernetes-validations`` rules (evaluated with cel-python, transition rules against the
old object on update). Errors read like the API server's: ``spec.workers.max: Required value``.
``prune`` is the API server's structural pruning, with the paths it pruned: the emulator's
server-side field validation (``fieldValidation=Strict|Warn|Ignore``) is built on it.

Used by the emulator (liveshard.dev.localcluster.emulator) so that invalid manifests are refused over HTTP,
and directly by tests.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import celpy
import jsonschema

_MISSING = object()


class InvalidObject(Exception):
    def __init__(self, kind: str, name: str, errors: list[str]) -> None:
        self.errors = errors
        super().__init__(f'{kind} "{name}" is invalid: ' + "; ".join(errors))


@dataclass
class _Rule:
    rule: str
    message: str
    program: Any
    transition: bool
    field_path: str = ""  # the rule's fieldPath (".a.b"): where its error is reported


_CEL_TYPES = ((bool, "boolean"), (dict, "object"), (list, "array"), (str, "string"), (int, "integer"),
              (float, "number"))


def _type_name(value: Any) -> str:
    """The schema type the API server names in a rule's error (``Invalid value: "object"``)."""
    return next((name for t, name in _CEL_TYPES if isinstance(value, t)), "null")


def _rule_path(path: str, field_path: str) -> str:
    """Where a rule's error is reported: its node's path, or under it by ``fieldPath``; the
    root is ``<nil>``, as kube-apiserver prints an empty field path."""
    if field_path:
        path = _join(path, field_path.lstrip("."))
    return path or "<nil>"


class CRDValidator:
    """Defaults and validation for one version of one CRD."""

    def __init__(self, crd: dict[str, Any], version: str | None = None) -> None:
        spec = crd["spec"]
        versions = spec["versions"]
        chosen = next((v for v in versions if v["name"] == version), None) if version else next(
            (v for v in versions if v.get("storage")), versions[0])
        if chosen is None:
            raise ValueError(f"CRD {crd['metadata']['name']} has no version {version}")
        self.kind = spec["names"]["kind"]
        self.group = spec["group"]
        self.version = chosen["name"]
        self.schema: dict[str, Any] = chosen["schema"]["openAPIV3Schema"]
        self.subresources: dict[str, Any] = chosen.get("subresources") or {}
        self._env = celpy.Environment()
        self._rules: dict[int, list[_Rule]] = {}
        self._compile(self.schema)
        self._jsonschema = jsonschema.Draft7Validator(_as_json_schema(self.schema))

    # ---- setup ------------------------------------------------------------------------------
    def _compile(self, node: dict[str, Any]) -> None:
        rules = []
        for item in node.get("x-kubernetes-validations") or []:
            program = self._env.program(self._env.compile(item["rule"]))
            rules.append(_Rule(item["rule"], item.get("message") or f"failed rule: {item['rule']}",
                               program, "oldSelf" in item["rule"], item.get("fieldPath") or ""))
        if rules:
            self._rules[id(node)] = rules
        for child in (node.get("properties") or {}).values():
            self._compile(child)
        if isinstance(node.get("items"), dict):
            self._compile(node["items"])
        if isinstance(node.get("additionalProperties"), dict):
            self._compile(node["additionalProperties"])

    # ---- public -----------------------------------------------------------------------------
    def default(self, obj: dict[str, Any]) -> dict[str, Any]:
        """A copy with the schema's defaults filled in (only inside objects that exist)."""
        out = copy.deepcopy(obj)
        _apply_defaults(self.schema, out)
        return out

    def errors(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> list[str]:
        errs: list[str] = []
        _unknown_fields(self.schema, obj, "", errs)
        for err in sorted(self._jsonschema.iter_errors(obj), key=lambda e: list(e.absolute_path)):
            errs.append(_describe(err))
        if not errs:  # CEL rules run on a well-typed object, as in the API server
            self._check_rules(self.schema, _cel_typed(self.schema, obj),
                              None if old is None else _cel_typed(self.schema, old), "", errs)
        return errs

    def prune(self, obj: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """A copy of ``obj`` without the fields its structural schema does not declare, and their
        paths (``spec.foo``, ``spec.items[0].bar``, ``metadata.foo``), sorted: the API server's
        pruning, whose paths its field validation reports as ``unknown field "spec.foo"``.
        ``x-kubernetes-preserve-unknown-fields`` keeps a node's undeclared fields (its declared
        ones are still pruned inside); ``apiVersion``, ``kind`` and ``metadata`` are always known at
        the root and in ``x-kubernetes-embedded-resource`` nodes."""
        out = copy.deepcopy(obj)
        pruned: list[str] = []
        _prune(self.schema, out, "", pruned, embedded=True)
        meta = out.get("metadata")
        if isinstance(meta, dict):
            for key in [k for k in meta if k not in _OBJECT_META_FIELDS]:
                del meta[key]
                pruned.append(f"metadata.{key}")
        return out, sorted(pruned)

    def validate(self, obj: dict[str, Any], old: dict[str, Any] | None = None) -> dict[str, Any]:
        """Default then validate; return the defaulted object or raise InvalidObject."""
        defaulted = self.default(obj)
        errs = self.errors(defaulted, old)
        if errs:
            name = (obj.get("metadata") or {}).get("name", "")
            raise InvalidObject(f"{self.kind}.{self.group}", name, errs)
        return defaulted

    # ---- CEL --------------------------------------------------------------------------------
    def _check_rules(self, node: dict[str, Any], value: Any, old: Any, path: str, errs: list[str]) -> None:
        if value is _MISSING or value is None:
            return
        for rule in self._rules.get(id(node), ()):
            if rule.transition and (old is _MISSING or old is None):
                continue  # transition rules only apply when there is an old value
            activation = {"self": celpy.json_to_cel(value)}
            if rule.transition:
                activation["oldSelf"] = celpy.json_to_cel(old)
            try:
                result = rule.program.evaluate(activation)
            except celpy.CELEvalError as e:
                result = e
            where = _rule_path(path, rule.field_path)
            if isinstance(result, celpy.CELEvalError):
                errs.append(f'{where}: Invalid value: "{_type_name(value)}": rule {rule.rule!r} failed to evaluate: '
                            f"{result}")
            elif not bool(result):
                errs.append(f'{where}: Invalid value: "{_type_name(value)}": {rule.message}')
        if isinstance(value, dict):
            for key, child in (node.get("properties") or {}).items():
                sub_old = old.get(key, _MISSING) if isinstance(old, dict) else _MISSING
                self._check_rules(child, value.get(key, _MISSING), sub_old, _join(path, key), errs)
            extra = node.get("additionalProperties")
            if isinstance(extra, dict):
                for key, item in value.items():
                    sub_old = old.get(key, _MISSING) if isinstance(old, dict) else _MISSING
                    self._check_rules(extra, item, sub_old, _join(path, key), errs)
        if isinstance(value, list) and isinstance(node.get("items"), dict):
            for i, item in enumerate(value):
                self._check_rules(node["items"], item, _MISSING, f"{path}[{i}]", errs)


def _as_json_schema(node: Any) -> Any:
    """A copy of an OpenAPI v3 (Kubernetes structural) schema that JSON Schema draft 7 reads alike.

    They differ where it matters here: OpenAPI's ``exclusiveMinimum``/``exclusiveMaximum`` are
    booleans beside ``minimum``/``maximum`` (draft 7 reads ``true`` as the number 1), and
    ``nullable: true`` lets a value be null.
    """
    if isinstance(node, list):
        return [_as_json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {k: _as_json_schema(v) for k, v in node.items()
           if k not in ("properties", "default", "example", "enum", "x-kubernetes-validations")}
    for key in ("properties", "default", "example", "enum"):
        if key in node:  # property names and literal values are not schemas
            out[key] = ({k: _as_json_schema(v) for k, v in node[key].items()} if key == "properties"
                        else copy.deepcopy(node[key]))
    for exclusive, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
        flag = out.pop(exclusive, None)
        if flag is True and bound in out:
            out[exclusive] = out.pop(bound)
        elif flag not in (None, True, False):
            out[exclusive] = flag  # already draft-7 style: a number
    if out.get("nullable") is True and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if out.get("x-kubernetes-int-or-string") is True:
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    return out


def _cel_typed(node: dict[str, Any] | None, value: Any) -> Any:
    """``value`` as CEL sees it under the schema: a ``type: number`` field is a double even when
    the JSON says ``1`` (kubectl sends a YAML ``1.0`` as ``1``), so ``self.weight > 0.0`` compares
    a double with a double, as on the API server."""
    node = node or {}
    kind = node.get("type")
    if kind == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties") if isinstance(node.get("additionalProperties"), dict) else None
        return {k: _cel_typed(props.get(k, extra), v) for k, v in value.items()}
    if isinstance(value, list):
        items = node.get("items") if isinstance(node.get("items"), dict) else None
        return [_cel_typed(items, v) for v in value]
    return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def _apply_defaults(node: dict[str, Any], value: Any) -> None:
    if isinstance(value, dict):
        for key, child in (node.get("properties") or {}).items():
            if key not in value and "default" in child:
                value[key] = copy.deepcopy(child["default"])
            if key in value:
                _apply_defaults(child, value[key])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            _apply_defaults(node["items"], item)


_EMBEDDED_META = ("apiVersion", "kind", "metadata")
_OBJECT_META_FIELDS = frozenset({
    "name", "generateName", "namespace", "selfLink", "uid", "resourceVersion", "generation", "creationTimestamp",
    "deletionTimestamp", "deletionGracePeriodSeconds", "labels", "annotations", "ownerReferences", "finalizers",
    "managedFields"})


def _prune(node: dict[str, Any] | None, value: Any, path: str, pruned: list[str], embedded: bool = False) -> None:
    """Structural pruning (k8s.io/apiextensions-apiserver's pruning.Prune), in place."""
    if node is None:
        node = {}
    preserve = bool(node.get("x-kubernetes-preserve-unknown-fields"))
    embedded = embedded or bool(node.get("x-kubernetes-embedded-resource"))
    if isinstance(value, dict):
        props = node.get("properties") or {}
        extra = node.get("additionalProperties")
        for key in list(value):
            if embedded and key in _EMBEDDED_META:
                continue
            if key in props:
                _prune(props[key], value[key], _join(path, key), pruned)
            elif isinstance(extra, dict):
                _prune(extra, value[key], _join(path, key), pruned)
            elif not (preserve or extra is True):
                del value[key]
                pruned.append(_join(path, key))
    elif isinstance(value, list):
        items = node.get("items") if isinstance(node.get("items"), dict) else None
        if items is None and preserve:
            return
        for i, item in enumerate(value):
            _prune(items, item, f"{path}[{i}]", pruned)


def _unknown_fields(node: dict[str, Any], value: Any, path: str, errs: list[str]) -> None:
    if node.get("x-kubernetes-preserve-unknown-fields"):
        return
    if isinstance(value, dict) and node.get("type") == "object":
        props = node.get("properties")
        extra = node.get("additionalProperties")
        if props is None and extra is None:
            return  # e.g. metadata: {type: object}, checked by the server elsewhere
        for key, item in value.items():
            if not path and key == "metadata":
                continue  # the object's ObjectMeta: the server checks it, whatever the schema declares of it
            if props is not None and key in props:
                _unknown_fields(props[key], item, _join(path, key), errs)
            elif isinstance(extra, dict):
                _unknown_fields(extra, item, _join(path, key), errs)
            elif extra is not True:
                errs.append(f'{_join(path, key)}: unknown field "{key}"')
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            _unknown_fields(node["items"], item, f"{path}[{i}]", errs)


def _describe(err: jsonschema.ValidationError) -> str:
    path = ""
    for part in err.absolute_path:
        path = f"{path}[{part}]" if isinstance(part, int) else _join(path, str(part))
    if err.validator == "required":
        missing = err.message.split("'")[1] if "'" in err.message else err.message
        return f"{_join(path, missing)}: Required value"
    if err.validator == "type":
        return f"{path}: Invalid value: {err.instance!r}: must be of type {err.validator_value}"
    if err.validator == "enum":
        allowed = ", ".join(f'"{v}"' for v in err.validator_value)
        return f"{path}: Unsupported value: {err.instance!r}: supported values: {allowed}"
    if err.validator in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
        op = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}[err.validator]
        return f"{path}: Invalid value: {err.instance!r}: must be {op} {err.validator_value}"
    return f"{path or '<root>'}: Invalid value: {err.message}"


__all__ = ["CRDValidator", "InvalidObject"]
