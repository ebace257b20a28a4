"""Which webhooks a request reaches and what a configuration may say: the emulator's admission
rules, as kube-apiserver's rule matcher and validation have them."""

from __future__ import annotations

import pytest

from liveshard.dev.localcluster.admission import matching, validate_configuration


def _config(rules: list, **hook) -> dict:
    return {"metadata": {"name": "c"}, "webhooks": [{"name": "v.example.com", "rules": rules, **hook}]}


def _reached(rule: dict, *, plural="elastictrainingjobs", subresource=None, operation="CREATE",
             namespace="ns", labels=None, **hook) -> bool:
    base = {"apiGroups": ["liveshard.io"], "apiVersions": ["v1alpha1"], "operations": ["CREATE", "UPDATE"]}
    return bool(matching([_config([{**base, **rule}], **hook)], group="liveshard.io", version="v1alpha1",
                         plural=plural, subresource=subresource, operation=operation, namespace=namespace,
                         namespace_labels={"kubernetes.io/metadata.name": namespace or "", **(labels or {})},
                         objects=[{"metadata": {"labels": {"team": "ml"}}}]))


@pytest.mark.parametrize(("resources", "subresource", "reached"), [
    (["elastictrainingjobs"], None, True),
    (["elastictrainingjobs"], "status", False),       # a resource alone is not its subresources
    (["elastictrainingjobs/status"], "status", True),
    (["elastictrainingjobs/status"], None, False),
    (["elastictrainingjobs/*"], None, True),          # "x/*": x and every subresource of it
    (["elastictrainingjobs/*"], "scale", True),
    (["*"], None, True),
    (["*"], "status", False),
    (["*/*"], None, True),
    (["*/*"], "status", True),
    (["*/scale"], "scale", True),
    (["*/scale"], "status", False),
    (["pods"], None, False),
])
def test_resources_match_as_the_api_servers_rule_matcher(resources, subresource, reached):
    assert _reached({"resources": resources}, subresource=subresource) is reached


def test_operations_scope_and_selectors():
    rule = {"resources": ["elastictrainingjobs"]}
    assert not _reached(rule, operation="DELETE")
    assert _reached({**rule, "operations": ["*"]}, operation="DELETE")
    assert _reached({**rule, "scope": None})  # unset: "*"
    assert not _reached({**rule, "scope": "Cluster"})
    assert _reached(rule, namespaceSelector={"matchLabels": {"kubernetes.io/metadata.name": "ns"}})
    assert not _reached(rule, namespaceSelector={"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "NotIn", "values": ["ns"]}]})
    assert _reached(rule, objectSelector={"matchLabels": {"team": "ml"}})
    assert not _reached(rule, objectSelector={"matchExpressions": [{"key": "team", "operator": "DoesNotExist"}]})


def test_a_configuration_is_checked_as_the_api_server_checks_it():
    ok = {"name": "v.example.com", "sideEffects": "None", "admissionReviewVersions": ["v1"],
          "clientConfig": {"url": "https://127.0.0.1:9443/validate"}, "rules": []}
    assert validate_configuration({"webhooks": [ok]}) == []
    # unset (null) policy and timeout take the server's defaults
    assert validate_configuration({"webhooks": [{**ok, "failurePolicy": None, "timeoutSeconds": None}]}) == []
    problems = validate_configuration({"webhooks": [
        {**ok, "name": "short.name", "sideEffects": "Some", "timeoutSeconds": 31, "rules": ["not-a-rule"],
         "clientConfig": {"url": "http://x/validate", "service": {"name": "s", "namespace": "n"}}}]})
    for field in ("webhooks[0].name", "webhooks[0].sideEffects", "webhooks[0].timeoutSeconds",
                  "webhooks[0].rules[0]", "webhooks[0].clientConfig: Required value", "webhooks[0].clientConfig.url"):
        assert any(p.startswith(field) for p in problems), (field, problems)
