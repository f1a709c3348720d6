"""Build hook: generate the gRPC code of dlrm_lab/serve/*.proto (the lab's protocol, the Open Inference Protocol).

Hatchling runs it for wheels and for editable installs, so the generated modules exist
wherever the package is installed but are never committed (see .gitignore).
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

from hatchling.builders.hooks.plugin.interface import BuildHookInterface

PROTOS = ("dlrm_lab/serve/inference.proto", "dlrm_lab/serve/open_inference.proto")
GENERATED = tuple(f"{Path(p).stem}{suffix}" for p in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


class ProtoBuildHook(BuildHookInterface):
    PLUGIN_NAME = "custom"

    def initialize(self, version: str, build_data: dict[str, Any]) -> None:
        from grpc_tools import protoc

        root = Path(self.root)
        well_known = resources.files("grpc_tools") / "_proto"
        # -I <root> with the proto's path under it: the generated imports read
        # `from dlrm_lab.serve import inference_pb2`.
        args = ["grpc_tools.protoc", f"-I{root}", f"-I{well_known}", f"--python_out={root}", f"--pyi_out={root}",
                f"--grpc_python_out={root}", *(str(root / p) for p in PROTOS)]  # fmt: skip
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {', '.join(PROTOS)} (see the messages above)")
        out = Path(PROTOS[0]).parent
        build_data.setdefault("artifacts", []).extend(str(out / name) for name in GENERATED)
