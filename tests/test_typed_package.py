"""harken is typed for its users (PEP 561), and `harken.*` resolves for static tools in the checkout.

The wheel carries `harken/py.typed` (pyproject package-data; one marker covers every `harken.*`
subpackage), so an application that installs the wheel and runs mypy sees the SDK's real types
rather than `Any` and "module is installed, but missing library stubs or py.typed marker". The
test builds the wheel from a copy of the checkout, installs it with `--no-deps` into a fresh venv
(no system site-packages, no harken on its path otherwise) and runs the project's mypy on an
application snippet with `--python-executable` pointing at that venv. Removing the installed marker
must bring the untyped failure back, which also shows mypy read the installed copy.

In the checkout itself, editors and import-graph tools resolve `harken.*` through the symlinks
harken/edge, harken/cloud, ... (jedi is the editor's engine here; pyright does the same).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

APP = """\
from harken.cloud.inference.engine import Engine
from harken.edge.client import ClientOptions, Meeting, TranscriptionClient

reveal_type(TranscriptionClient("localhost:50051"))
reveal_type(ClientOptions())
reveal_type(Meeting("localhost:50051"))


def serve(engine: Engine) -> None:
    reveal_type(engine)


wrong: int = ClientOptions(language="en")
TranscriptionClient("localhost:50051", options=3)
"""


def _run(cmd: list[str], cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _copy_checkout(dst: Path) -> Path:
    """The files a wheel is built from: pyproject, its readme and licence, harken/ and the folders its
    symlinks point at (the package-dir map of pyproject.toml), without caches or node_modules."""
    dst.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(ROOT / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", ".mypy_cache", "node_modules", "dist")
    shutil.copytree(ROOT / "harken", dst / "harken", symlinks=True, ignore=ignore)
    for link in (ROOT / "harken").iterdir():
        if link.is_symlink():
            target = link.resolve()
            shutil.copytree(target, dst / target.relative_to(ROOT), symlinks=True, ignore=ignore)
    return dst


def _mypy(app: Path, python: Path, cache: Path) -> str:
    # The project's own mypy, checking against the fresh venv's site-packages only; a config file
    # of its own so that no [tool.mypy] of the checkout applies.
    proc = _run([sys.executable, "-m", "mypy", "--config-file", str(app / "mypy.ini"),
                 "--python-executable", str(python), "--cache-dir", str(cache), "app.py"], cwd=app)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: the snippet's errors
    return proc.stdout


def test_wheel_is_typed_for_an_application(tmp_path: Path) -> None:
    src = _copy_checkout(tmp_path / "src")
    wheels = tmp_path / "wheels"
    built = _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                  "--no-index", "-w", str(wheels), str(src)], cwd=tmp_path)
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = wheels.glob("harken-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "harken/py.typed" in names
    assert "harken/edge/client/grpc_client.py" in names and "harken/cloud/inference/engine.py" in names
    # one import name; the product without its lab (bench, training) or synth-en's weights (a wheel of
    # their own), small enough for an edge agent's install
    assert {n.split("/")[0] for n in names} == {"harken", wheel.name.split("-py")[0] + ".dist-info"}, names
    assert not [n for n in names if n.startswith(("harken/bench/", "harken/training/", "harken/synth_en/"))]
    assert wheel.stat().st_size <= 8 * 2**20, wheel.stat().st_size

    venv_dir = tmp_path / "app-venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(venv_dir)], cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    python = venv_dir / "bin" / "python"
    installed = _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q",
                      "--no-deps", "--no-index", str(wheel)], cwd=tmp_path)
    assert installed.returncode == 0, installed.stdout + installed.stderr

    app = tmp_path / "app"
    app.mkdir()
    (app / "app.py").write_text(APP)
    (app / "mypy.ini").write_text("[mypy]\n")
    where = _run([str(python), "-c", "import harken; print(harken.__file__)"], cwd=app)
    assert where.returncode == 0, where.stderr
    package = Path(where.stdout.strip()).parent
    assert package.is_relative_to(venv_dir), package  # the installed wheel, not the checkout

    out = _mypy(app, python, tmp_path / "cache")
    revealed = re.findall(r'^app\.py:(\d+): note: Revealed type is "(.*)"$', out, re.M)
    assert revealed == [
        ("4", "harken.edge.client.grpc_client.TranscriptionClient"),
        ("5", "harken.edge.client.options.ClientOptions"),
        ("6", "harken.edge.client.meeting.Meeting"),
        ("10", "harken.cloud.inference.engine.Engine"),
    ], out
    errors = re.findall(r"^app\.py:(\d+): error: (.*)$", out, re.M)
    assert errors == [
        ("13", 'Incompatible types in assignment (expression has type "ClientOptions", '
               'variable has type "int")  [assignment]'),
        ("14", 'Argument "options" to "TranscriptionClient" has incompatible type "int"; '
               'expected "ClientOptions | None"  [arg-type]'),
    ], out

    # The control: the same wheel without its marker is what the issue saw.
    (package / "py.typed").unlink()
    untyped = _mypy(app, python, tmp_path / "cache-untyped")
    assert "missing library stubs or py.typed marker" in untyped, untyped
    assert 'Revealed type is "Any"' in untyped, untyped


def test_checkout_resolves_for_editors(tmp_path: Path) -> None:
    """An editor's engine (jedi) opened on the checkout goes from `harken.*` imports to the files,
    through the harken/* symlinks and harken.edge's TYPE_CHECKING re-exports, with an interpreter
    that has no harken installed: the checkout alone resolves them."""
    import jedi

    bare = tmp_path / "bare-venv"
    made = _run([sys.executable, "-m", "venv", "--without-pip", str(bare)], cwd=tmp_path)
    assert made.returncode == 0, made.stdout + made.stderr
    environment = jedi.create_environment(str(bare / "bin" / "python"), safe=False)
    code = ("from harken.cloud.inference.engine import Engine\n"
            "from harken.edge.client import ClientOptions, Meeting, TranscriptionClient\n")
    script = jedi.Script(code, path=ROOT / "app.py", project=jedi.Project(ROOT),
                         environment=environment)
    found = {}
    for line, name in ((1, "Engine"), (2, "ClientOptions"), (2, "Meeting"),
                       (2, "TranscriptionClient")):
        column = code.splitlines()[line - 1].rindex(name)
        (definition,) = script.goto(line, column, follow_imports=True)
        assert definition.module_path is not None, name
        found[definition.full_name] = Path(definition.module_path).resolve().relative_to(ROOT)
    assert found == {
        "harken.cloud.inference.engine.Engine": Path("cloud/inference/engine.py"),
        "harken.edge.client.options.ClientOptions": Path("edge/client/options.py"),
        "harken.edge.client.meeting.Meeting": Path("edge/client/meeting.py"),
        "harken.edge.client.grpc_client.TranscriptionClient": Path("edge/client/grpc_client.py"),
    }


def test_the_install_exposes_only_harken(tmp_path: Path) -> None:
    """`make`'s editable install (setuptools' default mode) puts no folder of the tree on sys.path:
    from anywhere but the checkout's root, the design card's folders import only under `harken`, so
    there is one class per name (an `except` of `harken.shared.errors.HarkenError` catches them all)."""
    for name in ("shared", "cloud", "edge", "bench", "training", "lab", "synth_en"):
        proc = _run([sys.executable, "-c", f"import {name}"], cwd=tmp_path)
        assert proc.returncode == 1 and "ModuleNotFoundError" in proc.stderr, (name, proc.stdout, proc.stderr)
    proc = _run([sys.executable, "-c", "import harken, harken.edge.client, harken.cloud.base.errors as e; "
                 "print(harken.__version__, issubclass(harken.TransportError, harken.HarkenError))"], cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.split() == ["0.1.0", "True"], proc.stdout + proc.stderr
