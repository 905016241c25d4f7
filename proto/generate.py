"""Generate the Python stubs of proto/harken.proto with grpcio-tools (`make proto`).

The stubs are committed so the edge needs no protoc; tests/test_proto.py regenerates them into a
temporary folder and fails when the committed ones differ.
"""

from __future__ import annotations

import re
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).parent
PROTO = PROTO_DIR / "harken.proto"
OUTPUTS = ("harken_pb2.py", "harken_pb2.pyi", "harken_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    from grpc_tools import protoc

    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_dir}", f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}", str(PROTO)]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    paths = [out_dir / name for name in OUTPUTS]
    grpc_stub = out_dir / "harken_pb2_grpc.py"
    # protoc writes an absolute-style import; the stubs live inside the harken.proto package
    text = re.sub(r"^import harken_pb2 as", "from . import harken_pb2 as",
                  grpc_stub.read_text(), flags=re.M)
    grpc_stub.write_text(text)
    return paths


def main() -> int:
    with tempfile.TemporaryDirectory() as d:
        for p in generate(Path(d)):
            (PROTO_DIR / p.name).write_text(p.read_text())
            print(f"wrote proto/{p.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
