"""Build hook: generate the gRPC code of dlrm_lab/serve/inference.proto.

Hatchling runs it for wheels and for editable installs, so the generated modules exist
wherever the package is installed but are never committed (see .gitignore).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PROTO = "dlrm_lab/serve/inference.proto"
GENERATED = ("inference_pb2.py", "inference_pb2.pyi", "inference_pb2_grpc.py")


class ProtoBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        from grpc_tools import protoc

        root = Path(self.root)
        well_known = resources.files("grpc_tools") / "_proto"
        # -I <root> with the proto's path under it: the generated imports read
        # `from dlrm_lab.serve import inference_pb2`.
        args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known}", f"--python_out={root}", f"--pyi_out={root}",
                f"--grpc_python_out={root}", str(root / PROTO)]  # fmt: skip
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO} (see the messages above)")
        out = Path(PROTO).parent
        build_data.setdefault("artifacts", []).extend(str(out / name) for name in GENERATED)
