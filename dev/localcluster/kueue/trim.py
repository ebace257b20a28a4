"""Make the stand-in copies of Kueue's CRDs in this folder from Kueue's own.

    python -m liveshard.dev.localcluster.kueue.trim <kueue checkout>/config/components/crd/bases

Each CRD keeps only its storage version and, of its schema, only the fields the operator and
the stand-in admission controller (``kueue_standin.py``) read or write: every kept field is
Kueue's own node, copied as it is (names, types, enums, limits, list types, CEL rules), so an
object valid against the copy is valid against Kueue's full CRD.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import yaml

HERE = Path(__file__).parent
KUEUE_VERSION = "v0.19.2"

# dotted paths kept in each schema (``a[].b``: ``b`` of the items of the array ``a``; a
# leaf is copied whole)
KEEP: dict[str, list[str]] = {
    "workloads": [
        "spec.active", "spec.maximumExecutionTimeSeconds", "spec.priority", "spec.priorityClassRef",
        "spec.queueName", "spec.podSets[].name", "spec.podSets[].count", "spec.podSets[].minCount",
        "spec.podSets[].template.metadata",
        "spec.podSets[].template.spec.containers[].name", "spec.podSets[].template.spec.containers[].image",
        "spec.podSets[].template.spec.containers[].resources",
        "spec.podSets[].template.spec.nodeSelector", "spec.podSets[].template.spec.tolerations",
        "spec.podSets[].template.spec.priorityClassName", "spec.podSets[].template.spec.schedulingGates",
        "status.admission.clusterQueue", "status.admission.podSetAssignments[].name",
        "status.admission.podSetAssignments[].count", "status.admission.podSetAssignments[].flavors",
        "status.admission.podSetAssignments[].resourceUsage", "status.conditions",
        "status.requeueState", "status.reclaimablePods",
    ],
    "clusterqueues": [
        "spec.cohortName", "spec.namespaceSelector", "spec.preemption", "spec.queueingStrategy",
        "spec.resourceGroups", "spec.stopPolicy",
        "status.admittedWorkloads", "status.pendingWorkloads", "status.reservingWorkloads",
        "status.conditions", "status.flavorsUsage",
    ],
    "localqueues": ["spec.clusterQueue", "spec.stopPolicy", "status.admittedWorkloads",
                    "status.pendingWorkloads", "status.reservingWorkloads", "status.conditions"],
    "resourceflavors": ["spec.nodeLabels", "spec.nodeTaints", "spec.tolerations"],
    "workloadpriorityclasses": ["value", "description"],
}


def _tree(paths: list[str]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for p in paths:
        node = tree
        for part in p.split("."):
            node = node.setdefault(part, {})
    return tree


def _trim(schema: dict[str, Any], tree: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with only the properties ``tree`` names (an empty tree: the whole node); an
    array's tree names its items' properties."""
    if not tree:
        return copy.deepcopy(schema)
    if schema.get("type") == "array":
        return {**{k: copy.deepcopy(v) for k, v in schema.items() if k != "items"},
                "items": _trim(schema["items"], tree)}
    out = {k: copy.deepcopy(v) for k, v in schema.items() if k not in ("properties", "required")}
    out["properties"] = {name: _trim(schema["properties"][name], sub) for name, sub in tree.items()}
    required = [r for r in schema.get("required", []) if r in out["properties"]]
    if required:
        out["required"] = required
    return out


def trim(crd: dict[str, Any], plural: str) -> dict[str, Any]:
    version = next(v for v in crd["spec"]["versions"] if v.get("storage"))
    schema = version["schema"]["openAPIV3Schema"]
    keep = _tree([p.replace("[]", "") for p in KEEP[plural]])
    kept = _trim(schema, {**{k: {} for k in ("apiVersion", "kind", "metadata")}, **keep})
    rules = schema.get("x-kubernetes-validations")
    if rules:
        kept["x-kubernetes-validations"] = rules
    version = {**version, "schema": {"openAPIV3Schema": kept}}
    out = copy.deepcopy(crd)
    out["spec"]["versions"] = [version]
    out["spec"].pop("conversion", None)
    out["metadata"] = {"name": crd["metadata"]["name"]}
    return out


def main(bases: str) -> None:
    for plural in KEEP:
        crd = yaml.safe_load((Path(bases) / f"kueue.x-k8s.io_{plural}.yaml").read_text())
        out = trim(crd, plural)
        header = (f"# A stand-in copy of Kueue {KUEUE_VERSION}'s {crd['spec']['names']['kind']} CRD "
                  f"(config/components/crd/bases/kueue.x-k8s.io_{plural}.yaml), for tests and\n"
                  "# `local-cluster up --kueue`: its storage version only, trimmed to the fields liveshard reads and\n"
                  "# writes (each one Kueue's own, unchanged). On a real cluster install Kueue itself.\n"
                  "# Made by dev/localcluster/kueue/trim.py.\n")
        (HERE / f"kueue.x-k8s.io_{plural}.yaml").write_text(header + yaml.safe_dump(out, sort_keys=False, width=110))


if __name__ == "__main__":
    main(sys.argv[1])
