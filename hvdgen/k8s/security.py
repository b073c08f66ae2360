"""Pod security: what would let a training job's pods reach into the node they run on.

The rules are those of the Kubernetes Pod Security Standards' "baseline" profile
(https://kubernetes.io/docs/concepts/security/pod-security-standards/) that apply to Linux pods, plus
"no privilege escalation" from the "restricted" profile. A Horovod job needs none of these: ranks
talk over the pod network, GPUs come from the device plugin's `nvidia.com/gpu` limit, checkpoints go
to a PersistentVolumeClaim.
"""

from __future__ import annotations

from hvdgen.k8s.pods import containers, mapping, pod_specs
from hvdgen.k8s.problems import Problem

HOST_NAMESPACES = {"hostNetwork": "network", "hostPID": "process", "hostIPC": "IPC"}
# The baseline profile's list; IPC_LOCK added because NCCL's RDMA (InfiniBand) transport pins memory.
ALLOWED_CAPABILITIES = frozenset({"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                                  "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT",
                                  "IPC_LOCK"})


def security_problems(job: dict) -> list[Problem]:
    problems = []
    for path, pod in pod_specs(job):
        for field, what in HOST_NAMESPACES.items():
            if pod.get(field) is True:
                problems.append(Problem(f"{path}.{field}", f"true shares the node's {what} namespace with the job: "
                                        "remove it (Horovod needs only the pod network)"))
        volumes = pod.get("volumes")
        for i, volume in enumerate(volumes if isinstance(volumes, list) else []):
            if isinstance(volume, dict) and "hostPath" in volume:
                problems.append(Problem(f"{path}.volumes[{i}].hostPath", f"volume {volume.get('name')!r} mounts a "
                                        "folder of the node: use a persistentVolumeClaim or an emptyDir instead"))
        problems += _context_problems(mapping(pod, "securityContext"), f"{path}.securityContext")
        for where, container in containers(pod, path):
            problems += _container_problems(container, where)
    return problems


def _context_problems(context: dict, where: str) -> list[Problem]:
    """Fields that a pod's and a container's securityContext share."""
    problems = []
    if mapping(context, "seccompProfile").get("type") == "Unconfined":
        problems.append(Problem(f"{where}.seccompProfile.type", "Unconfined turns off the system-call filter: "
                                "use RuntimeDefault, or leave it out"))
    return problems


def _container_problems(container: dict, where: str) -> list[Problem]:
    context = mapping(container, "securityContext")
    at = f"{where}.securityContext"
    problems = _context_problems(context, at)
    if context.get("privileged") is True:
        problems.append(Problem(f"{at}.privileged", "true gives the container the whole node: remove it "
                                "(GPUs come from the nvidia.com/gpu limit, not from privileges)"))
    if context.get("allowPrivilegeEscalation") is True:
        problems.append(Problem(f"{at}.allowPrivilegeEscalation", "true lets a process gain more privileges "
                                "than its parent: set it to false, or leave it out"))
    added = mapping(context, "capabilities").get("add")
    extra = sorted(str(c) for c in added if str(c).upper().removeprefix("CAP_") not in ALLOWED_CAPABILITIES) \
        if isinstance(added, list) else []
    if extra:
        problems.append(Problem(f"{at}.capabilities.add", f"adds {', '.join(extra)}, beyond the Pod Security "
                                "Standards' baseline: remove it"))
    if context.get("procMount") == "Unmasked":
        problems.append(Problem(f"{at}.procMount", "Unmasked exposes the node's /proc: remove it"))
    ports = container.get("ports")
    for i, port in enumerate(ports if isinstance(ports, list) else []):
        if isinstance(port, dict) and port.get("hostPort"):
            problems.append(Problem(f"{where}.ports[{i}].hostPort", "binds a port of the node: remove hostPort "
                                    "(the operator reaches workers through the pod network)"))
    return problems
