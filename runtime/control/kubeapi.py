"""The official Kubernetes client, configured once for the operator and the coordinator.

Imported only where the API is used (the operator; the coordinator's ``KubePlanSource``): the
``kubernetes`` package is in both images (the coordinator runs in the worker image).
"""

from __future__ import annotations

import kubernetes.client as k8s


def make_api_client(server: str | None = None, kubeconfig: str | None = None,
                    pool_size: int = 32) -> k8s.ApiClient:
    """An ApiClient from an explicit server URL, a kubeconfig file, or the pod's service account."""
    import kubernetes.config

    config = k8s.Configuration()
    if server:
        config.host = server
    elif kubeconfig:
        kubernetes.config.load_kube_config(config_file=kubeconfig, client_configuration=config)
    else:
        try:
            kubernetes.config.load_incluster_config(client_configuration=config)
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config(client_configuration=config)
    config.connection_pool_maxsize = pool_size
    return k8s.ApiClient(config)
