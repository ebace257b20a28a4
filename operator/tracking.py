"""The operator's records of a job's failed pods: ``status.tracking``.

Not an interface: a user reads ``status.failures``, ``status.podFailures``, the conditions and
``status.message``. The records are

* ``countedPods``: UIDs of the failed pods already counted (the newest ``COUNTED_LIMIT``), so
  none counts twice while it still exists (a failed pod is kept for its logs once the job fails);
* ``recreateAfter``: per worker pod, the time before which its failed predecessor's
  replacement is not created (the pod back-off);
* ``configError``: the one-line message worker pods exited 2 with, how many in a row, and the
  job generation they ran.

They live in the status, not in an annotation or a ConfigMap, because one status patch has to
change them together with the counts they guard: a pod counted in one write and not in the
other would, after a crash between the two, count twice or never. (A Kubernetes Job keeps its
``status.uncountedTerminatedPods`` for the same reason.) Operators before liveshard 0.3 kept
them at the top of the status as ``countedFailures``, ``podBackoff`` and ``configError``.

Moving them must survive a cluster whose CRD is still the old one (Helm installs ``crds/`` only
on the first install): its schema has no ``tracking``, and the API server prunes it from every
write. So, while the status read has no ``tracking``, each record is written in both places
(``mirror``), and the old fields are removed only once a ``tracking`` written earlier came back
(``migration``): with an old CRD the old fields keep working, with the new one they go.
"""

from __future__ import annotations

from typing import Any

TRACKING = "tracking"
COUNTED = "countedPods"
RECREATE_AFTER = "recreateAfter"
CONFIG_ERROR = "configError"
COUNTED_LIMIT = 50
# the top-level status fields of operators before 0.3, and where each went
LEGACY = {"countedFailures": COUNTED, "podBackoff": RECREATE_AFTER, "configError": CONFIG_ERROR}


def tracking_of(status: dict[str, Any]) -> dict[str, Any]:
    """The job's records, from ``status.tracking`` or (a job an older operator tracked) the
    top-level fields it used; malformed ones read as empty."""
    raw = status.get(TRACKING)
    records = dict(raw) if isinstance(raw, dict) else {}
    for old, new in LEGACY.items():
        if new not in records and old in status:
            records[new] = status[old]
    counted = records.get(COUNTED)
    records[COUNTED] = [str(u) for u in counted] if isinstance(counted, list) else []
    after = records.get(RECREATE_AFTER)
    records[RECREATE_AFTER] = dict(after) if isinstance(after, dict) else {}
    error = records.get(CONFIG_ERROR)
    records[CONFIG_ERROR] = dict(error) if isinstance(error, dict) else None
    return records


OLD_NAME = {new: old for old, new in LEGACY.items()}


def mirror(status: dict[str, Any]) -> bool:
    """Whether records written now also go to their old top-level fields: the status has no
    ``tracking`` yet (a new job, an older operator's job, or a CRD that prunes it)."""
    return TRACKING not in status


def migration(status: dict[str, Any]) -> dict[str, Any]:
    """The status merge patch that moves an older operator's top-level records: copied into
    ``tracking`` while it is missing; removed once ``tracking`` was stored (empty: nothing to do)."""
    present = [old for old in LEGACY if old in status]
    if not present:
        return {}
    if TRACKING in status:  # the server keeps tracking: the old fields can go
        return {old: None for old in present}
    records = tracking_of(status)
    return {TRACKING: {LEGACY[old]: records[LEGACY[old]] for old in present}}
