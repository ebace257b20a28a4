"""What this operator allows a job, beyond what the CRD says: cluster-wide rules an administrator
sets with ``liveshard operator`` flags (chart values), not the job's owner. Pure, no kopf.

* hostPath checkpoint volumes are refused unless ``--allow-host-path-checkpoints``: a hostPath
  volume breaks the PodSecurity ``restricted`` profile the job's pods otherwise pass, gives the
  pods a node's filesystem, and ties a checkpoint to one node's disk (a worker that moves to
  another node does not find it).
* the egress the job's NetworkPolicies allow (``Egress``): the job's own pods, DNS, and for the
  coordinator the API server; workers get more only through ``spec.network.extraEgress``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from liveshard.runtime.errors import ConfigError

ALLOW_HOST_PATH_FLAG = "--allow-host-path-checkpoints"
ALLOW_HOST_PATH_VALUE = "operator.allowHostPathCheckpoints"  # the chart value that passes the flag

DNS_KUBE_DNS = "kube-dns"  # port 53 to pods labelled k8s-app=kube-dns, in any namespace
DNS_ANY = "any"  # port 53 to any address (NodeLocal DNSCache, a DNS server outside the cluster)
DNS_CHOICES = (DNS_KUBE_DNS, DNS_ANY)
KUBE_DNS_LABELS = {"k8s-app": "kube-dns"}  # CoreDNS and kube-dns pods carry it on kubeadm, EKS, GKE, AKS
DNS_PORT = 53

# Where the API server is: the kubernetes Service's ClusterIP is translated to the endpoints'
# addresses before most CNIs apply policy, so the rule names the endpoints' ports (443 on
# managed clusters, 6443 on kubeadm-style ones) at any address unless narrowed.
DEFAULT_API_SERVER_CIDRS = ("0.0.0.0/0", "::/0")
DEFAULT_API_SERVER_PORTS = (443, 6443)


@dataclass(frozen=True)
class Egress:
    """Egress of the job's pods (``liveshard operator --no-egress-policy`` etc.)."""

    enabled: bool = True  # False: the job's NetworkPolicies limit ingress only
    dns: str = DNS_KUBE_DNS
    api_server_cidrs: tuple[str, ...] = DEFAULT_API_SERVER_CIDRS
    api_server_ports: tuple[int, ...] = DEFAULT_API_SERVER_PORTS


@dataclass(frozen=True)
class JobPolicy:
    allow_host_path_checkpoints: bool = False
    egress: Egress = field(default_factory=Egress)


DEFAULT_POLICY = JobPolicy()


def refusal(spec: dict[str, Any], policy: JobPolicy) -> ConfigError | None:
    """Why this operator refuses a job whose spec is otherwise valid, or None."""
    volume = ((spec or {}).get("checkpoint") or {}).get("volume") or {}
    if isinstance(volume, dict) and "hostPath" in volume and not policy.allow_host_path_checkpoints:
        return ConfigError(
            "spec.checkpoint.volume.hostPath",
            "hostPath checkpoint volumes are refused by this operator (they give the pods a node's "
            "filesystem and tie checkpoints to one node's disk)",
            "use a volume every worker can reach, e.g. {persistentVolumeClaim: {claimName: ckpt}} on a "
            f"ReadWriteMany class, or run the operator with {ALLOW_HOST_PATH_FLAG} "
            f"(chart: {ALLOW_HOST_PATH_VALUE}=true)")
    return None


__all__ = ["DEFAULT_POLICY", "Egress", "JobPolicy", "refusal"]
