"""Validating admission: what the CRD schema and its CEL rules cannot say.

The schema checks types, ranges and cross-field rules; this checks the model itself (a valid
ModelSpec, a known preset) and that the parallelism constraints fit it. It is registered only
when the operator serves an admission webhook (``liveshard operator --webhook-port``): kopf
refuses to start with admission handlers and no webhook server. Without it the job loop reports
the same problem in the job's status (phase Failed, condition Ready).
"""

from __future__ import annotations

from typing import Any

import kopf

from liveshard.runtime.contract.crd import GROUP, PLURAL, VERSION
from liveshard.runtime.contract.jobspec import validate_spec

_registered = False


def check_spec(spec: Any, **_: Any) -> None:
    problem = validate_spec(dict(spec or {}))
    if problem:
        raise kopf.AdmissionError(problem, code=422)


def register() -> None:
    global _registered
    if not _registered:
        kopf.on.validate(GROUP, VERSION, PLURAL, id="spec", operations=["CREATE", "UPDATE"])(check_spec)
        _registered = True
