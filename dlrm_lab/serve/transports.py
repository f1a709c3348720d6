"""The remote transports of `--target`, registered with `infer.targets` from above (as families and builds register):
each opener imports its client only when its scheme is used, so that an in-process run never loads gRPC.

    grpc://HOST:PORT            a `dlrm-lab serve`, over the lab's protocol (stream or unary)
    kserve://HOST:PORT[/MODEL]  any Open Inference Protocol (KServe v2) gRPC server
    http://HOST:PORT[/MODEL]    any Open Inference Protocol HTTP/REST server (rest: binary tensors where it lists
                                Triton's extension; rest-json)
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

from dlrm_lab.infer.targets import register_transport


def open_lab_server(*args: Any, **kwargs: Any) -> AbstractContextManager:
    from dlrm_lab.serve.connect import open_lab_server as opener

    return opener(*args, **kwargs)


def open_inference_server(*args: Any, **kwargs: Any) -> AbstractContextManager:
    from dlrm_lab.serve.connect import open_inference_server as opener

    return opener(*args, **kwargs)


def open_rest_server(*args: Any, **kwargs: Any) -> AbstractContextManager:
    from dlrm_lab.serve.rest_remote import open_rest_server as opener

    return opener(*args, **kwargs)


register_transport("grpc", open_lab_server, ("stream", "unary"))
register_transport("kserve", open_inference_server, ("oip",), names_model=True)
register_transport("http", open_rest_server, ("rest", "rest-json"), names_model=True)
