"""Validating admission: what the CRD schema and its CEL rules cannot say.

The schema checks types, ranges and cross-field rules; this checks the model itself (a valid
ModelSpec, a known preset) and that the parallelism constraints fit it. It serves only when the
operator runs with an admission webhook server (``liveshard operator --webhook``); without one
the job loop reports the same problem in the job's status (phase Failed, condition Ready).
"""

from __future__ import annotations

from typing import Any

import kopf

from liveshard.operator.builders import GROUP, PLURAL, VERSION
from liveshard.operator.jobspec import validate_spec


@kopf.on.validate(GROUP, VERSION, PLURAL, id="spec", operations=["CREATE", "UPDATE"])
def check_spec(spec: kopf.Spec, **_: Any) -> None:
    problem = validate_spec(dict(spec))
    if problem:
        raise kopf.AdmissionError(problem, code=422)
