"""`harken health [HOST:PORT]`: ask a harken server's gRPC health service (`grpc.health.v1`).

The server reports SERVING for "" and "harken.v1.Transcription" once it listens with its model
loaded, and NOT_SERVING when its engine failed or while it shuts down (cloud/server.py). The
command prints the status and exits 0 for SERVING, 1 otherwise (not serving, unreachable, no
answer within the timeout): what a container healthcheck wants (Docker reserves exit code 2).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from ...shared.errors import HarkenError

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_SERVICE = "harken.v1.Transcription"


def check_health(target: str = DEFAULT_TARGET, service: str = DEFAULT_SERVICE, tls_ca: str | None = None,
                 timeout_s: float = 3.0) -> str:
    """The server's status name for `service` ("SERVING", "NOT_SERVING", ...). HarkenError when it
    cannot be asked (unreachable, no health service, no answer in time)."""
    if "grpc" not in sys.modules:  # gRPC's C core would log a failed handshake on stderr as well
        os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    import grpc

    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc
    except ImportError as e:
        raise HarkenError("harken health needs grpcio-health-checking (pip install 'harken[cloud]')") from e
    if tls_ca:
        try:
            root = Path(tls_ca).read_bytes()
        except OSError as e:
            raise HarkenError(f"{tls_ca}: cannot read the CA certificate ({e.strerror})") from e
        channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=root))
    else:
        channel = grpc.insecure_channel(target)
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=timeout_s)
        except grpc.RpcError as e:
            code, details = (e.code().name, e.details() or "") if isinstance(e, grpc.Call) else ("UNKNOWN", str(e))
            raise HarkenError(f"{target}: no health answer ({code}: {' '.join(details.split())})") from e
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def health_command(target: str = DEFAULT_TARGET, service: str = DEFAULT_SERVICE, tls_ca: str | None = None,
                   timeout_s: float = 3.0) -> int:
    """Print the status; 0 for SERVING, else 1 (one line on stderr when the server cannot be asked)."""
    try:
        status = check_health(target, service, tls_ca, timeout_s)
    except HarkenError as e:
        print(f"harken health: {e}", file=sys.stderr)
        return 1
    print(f"{target} {service or '(server)'}: {status}")
    return 0 if status == "SERVING" else 1


__all__ = ["check_health", "health_command", "DEFAULT_TARGET", "DEFAULT_SERVICE"]
