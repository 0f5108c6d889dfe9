"""A library that can live inside someone else's process: importing spec_runtime (and every
submodule) installs no signal handler, reads or changes no sys.argv, prints nothing, starts no
thread and configures no logging; loading and generating print nothing either, write nothing
outside the bundle (ONNX Runtime's telemetry is off) and leave the environment as it was.
Generators are safe to use from several threads."""

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

import spec_runtime

SCRIPT = textwrap.dedent(
    """
    import importlib, io, json, logging, os, pkgutil, signal, sys, threading

    bundle = sys.argv[1]  # "-": import only
    argv = sys.argv = ["host-program", "--not-for-the-library"]
    saved_argv = list(argv)
    signals = [s for s in signal.Signals if s not in (signal.SIGKILL, signal.SIGSTOP)]
    handlers = {s: signal.getsignal(s) for s in signals}
    threads = threading.active_count()
    root_handlers = list(logging.root.handlers)
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()

    import spec_runtime
    for mod in pkgutil.walk_packages(spec_runtime.__path__, "spec_runtime."):  # apps too
        importlib.import_module(mod.name)
    after_import = threading.active_count()
    if bundle != "-":
        gen = spec_runtime.load(bundle)
        gen.generate([5, 6, 7], max_new_tokens=6, temperature=1.0, seed=0)
        list(gen.stream("hi", max_new_tokens=4))

    printed = sys.stdout.getvalue() + sys.stderr.getvalue()
    sys.stdout, sys.stderr = out, err
    print(json.dumps({
        "printed": printed,
        "telemetry_env": os.environ.get("ORT_DISABLE_TELEMETRY"),
        "argv_same_object": sys.argv is argv,
        "argv_unchanged": sys.argv == saved_argv,
        "changed_handlers": [s.name for s in signals if signal.getsignal(s) != handlers[s]],
        "threads": [threads, after_import, threading.active_count()],
        "root_handlers_unchanged": logging.root.handlers == root_handlers,
        "root_level": logging.root.level,
    }))
    """
)


def run_script(bundle_arg: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", SCRIPT, bundle_arg], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    assert out.stderr == "", out.stderr  # nothing at interpreter exit either
    return json.loads(out.stdout)


def test_import_has_no_side_effects():
    r = run_script("-")
    assert r["printed"] == ""
    assert r["argv_same_object"] and r["argv_unchanged"]
    assert r["changed_handlers"] == []
    assert r["threads"][0] == r["threads"][1] == r["threads"][2]
    assert r["root_handlers_unchanged"] and r["root_level"] == 30  # logging.WARNING, untouched


def test_load_and_generate_print_nothing_and_leave_the_process_alone(llama_pair):
    r = run_script(str(llama_pair[2]))
    assert r["printed"] == "", r["printed"]
    assert r["argv_unchanged"] and r["changed_handlers"] == []
    assert r["threads"][2] == r["threads"][0]  # ONNX Runtime's pool is native, not Python threads
    assert r["root_handlers_unchanged"]


def files_under(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_load_and_generate_write_nothing_under_home(llama_pair, tmp_path, monkeypatch):
    """ONNX Runtime's POSIX builds write a telemetry device id under ~/.cache unless
    ORT_DISABLE_TELEMETRY is set when they are imported: the runtime sets it for that import
    only, and a host's own choice stands (with 0, the file appears: the switch is what keeps
    the home directory clean)."""
    monkeypatch.delenv("ORT_DISABLE_TELEMETRY", raising=False)
    home = tmp_path / "home"
    home.mkdir()
    r = run_script(str(llama_pair[2]), HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"))
    assert r["printed"] == "" and r["telemetry_env"] is None
    assert files_under(home) == []

    (tmp_path / "file").write_text("not a directory")  # a HOME no one can write to, root neither
    r = run_script(str(llama_pair[2]), HOME=str(tmp_path / "file" / "home"))
    assert r["printed"] == "", r["printed"]  # no warning about an unwritable cache

    r = run_script(str(llama_pair[2]), HOME=str(home), ORT_DISABLE_TELEMETRY="0")
    assert r["telemetry_env"] == "0"
    import onnxruntime

    if not any("DeveloperTools" in f for f in files_under(home)):
        print(f"onnxruntime {onnxruntime.__version__} writes no telemetry id even when allowed")


# `specrun serve` and its Ray Serve form: application code that starts worker threads and
# handles SIGTERM, in spec_runtime/apps/; `import spec_runtime` never imports them (tested below)
SERVER_MODULES = {"slots.py", "run_server.py", "ray_serve.py"}
RUNTIME = Path(spec_runtime.__file__).parent


def test_importing_the_runtime_imports_no_server_module():
    code = ("import sys, spec_runtime; spec_runtime.load; print(sorted(m for m in sys.modules if "
            "m.startswith(('spec_runtime.apps', 'fastapi', 'pydantic', 'uvicorn', 'ray', "
            "'prometheus_client'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_the_numeric_core_never_imports_its_apps():
    """One direction: spec_runtime/apps/ (server, Ray Serve, bench, check, chat, list) uses the
    core; no module of the core (its subpackages included) imports an app, not even inside a
    function."""
    core = sorted(p for p in RUNTIME.rglob("*.py") if "apps" not in p.relative_to(RUNTIME).parts)
    assert len(core) > 10 and (RUNTIME / "apps" / "server.py").is_file()
    assert RUNTIME / "decode" / "loop.py" in core  # the scan reaches the subpackages
    for path in core:
        imported = _runtime_imports(path) | _relative_imports(path)
        apps = sorted(m for m in imported if m.startswith("spec_runtime.apps"))
        assert apps == [], (path.name, apps)


# spec_runtime's layers, bottom first: a module imports only from its own layer and those below
# (DESIGN.md). By top-level name: a subpackage is one layer.
LAYERS = [
    {"errors"},
    {"bundle"},  # the contract, manifest, checks, files, where bundles are
    {"engines"},
    {"decode"},  # sampling, the loop, drafts, γ, stats
    {"request", "text", "chat", "chat_limits", "chat_sandbox", "limits", "audio", "speech",
     "tools", "settings"},
    {"generator", "speech_requests", "batch", "longform", "vad"},  # the model and its sequences
    {"loading"},  # the composition root: a bundle into a model
    {"apps"},
    {"__init__"},  # spec_runtime.load and the public names
]


def _layer(module: str) -> int:
    parts = module.split(".")[1:]
    name = parts[0] if parts else "__init__"
    if not ((RUNTIME / name).is_dir() or (RUNTIME / f"{name}.py").is_file()):
        name = "__init__"  # a name the package itself defines (spec_runtime.load)
    found = [i for i, names in enumerate(LAYERS) if name in names]
    assert found, f"{module}: put it in a layer of LAYERS"
    return found[0]


def test_the_layers_point_only_down():
    """No module of spec_runtime imports one of a layer above its own, not even inside a
    function (loading.py wires the layers; the bundle is the bottom, not also the top)."""
    up = []
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME.parent).with_suffix("").parts
        me = ".".join(rel)
        imported = _runtime_imports(path) | _relative_imports(path)
        up += [(me, m) for m in sorted(imported) if _layer(m) > _layer(me)]
    assert up == []
    # the oracle: a known arrow up is seen as one
    assert _layer("spec_runtime.request") > _layer("spec_runtime.decode.loop")
    assert _layer("spec_runtime.loading") > _layer("spec_runtime.bundle.reader")


def test_the_runtimes_modules_import_each_other_without_a_cycle():
    """Inside spec_runtime the imports, function-level ones included, form no cycle: with the
    layers, each module can be read (and changed) after those it uses."""
    modules = {}
    for path in sorted(RUNTIME.rglob("*.py")):
        rel = path.relative_to(RUNTIME.parent).with_suffix("").parts
        modules[".".join(rel[:-1] if rel[-1] == "__init__" else rel)] = path
    graph = {}
    for name, path in modules.items():
        imported = _runtime_imports(path) | _relative_imports(path)
        # a name the package defines (`from .. import load`) is an import of the package
        graph[name] = sorted({m if m in modules else m.rsplit(".", 1)[0] for m in imported}
                             - {name})
    assert len(graph) > 40 and "spec_runtime.decode.drafts" in graph["spec_runtime.decode.loop"]
    assert _a_cycle(graph) is None, _a_cycle(graph)


WEB_STACK = {"fastapi", "starlette", "pydantic", "pydantic_core", "uvicorn"}


def test_only_the_apps_import_the_web_stack():
    """pydantic (the OpenAI API's models) and the web framework are the serve extra's: no
    module of the core imports them, not even inside a function; the server's own do."""
    import ast

    def web_imports(path):
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
        return found & WEB_STACK

    for path in RUNTIME.rglob("*.py"):
        if "apps" not in path.relative_to(RUNTIME).parts:
            assert web_imports(path) == set(), (path.name, web_imports(path))
    assert "pydantic" in web_imports(RUNTIME / "apps" / "openai_protocol.py")  # the scan sees


def _relative_imports(path) -> set[str]:
    """What a core module imports relatively (`from .x import`, `from ..x import y`, `from .
    import x`), named absolutely (spec_runtime.x...)."""
    import ast

    package = list(path.relative_to(RUNTIME.parent).with_suffix("").parts)
    package = package if path.name == "__init__.py" else package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level >= 1:
            base = package[: len(package) - (node.level - 1)]
            if node.module:
                found.add(".".join(base + node.module.split(".")))
            else:
                found |= {".".join(base + [a.name]) for a in node.names}
    return found


def test_relative_import_naming_oracle(tmp_path):
    """_relative_imports names what a module two levels down imports, by hand."""
    assert "spec_runtime.decode.gamma" in _relative_imports(RUNTIME / "request.py")
    assert "spec_runtime.engines.protocol" in _relative_imports(RUNTIME / "decode" / "loop.py")
    assert "spec_runtime.apps.openai_api" in _relative_imports(RUNTIME / "apps" / "server.py")


def test_runtime_logs_through_logging_not_print():
    import ast

    for path in RUNTIME.rglob("*.py"):
        tree = ast.parse(path.read_text())
        calls = [n.func.id for n in ast.walk(tree)
                 if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)]
        assert "print" not in calls, path.name
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        forbidden = {"basicConfig", "argv"}
        if path.name not in SERVER_MODULES:  # a server's own process: threads and signals are its job
            forbidden |= {"signal"}
        if path.name not in SERVER_MODULES | {"batch.py"}:  # and a batch's workers, one per
            forbidden |= {"Thread"}  # request in flight, joined before Generator.batch ends
        assert not attrs & forbidden, (path.name, attrs & forbidden)


REQUESTS = [
    dict(prompt="hello world", max_new_tokens=20),
    dict(prompt="The cat sat on", max_new_tokens=20, temperature=1.0, seed=3),
    dict(prompt=[5, 6, 7, 8], max_new_tokens=15, temperature=0.8, top_p=0.9, seed=11, gamma=2),
    dict(prompt="a", max_new_tokens=10, use_draft=False, temperature=1.0, seed=4),
]


def _run_all(gen, rounds=3):
    return [[gen.generate(**req).tokens for req in REQUESTS] for _ in range(rounds)]


def _in_two_threads(fn):
    """[fn(0), fn(1)], run in two threads; an exception in either is raised here (in a thread it
    would otherwise be lost)."""
    results, errors = [None, None], []

    def worker(i):
        try:
            results[i] = fn(i)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return results


def test_two_generators_in_two_threads_equal_sequential_calls(llama_pair):
    bundle = llama_pair[2]
    gens = [spec_runtime.load(bundle), spec_runtime.load(bundle)]
    sequential = _run_all(gens[0], rounds=1)[0]

    barrier = threading.Barrier(2)

    def work(i):
        barrier.wait()
        return _run_all(gens[i])

    for r in _in_two_threads(work):
        assert r == [sequential] * 3


def test_one_generator_shared_by_two_threads_serialises_requests(llama_pair):
    gen = spec_runtime.load(llama_pair[2])
    sequential = _run_all(gen, rounds=1)[0]
    assert _in_two_threads(lambda i: _run_all(gen)) == [[sequential] * 3] * 2


def test_a_request_while_a_stream_is_open_in_the_same_thread_raises_instead_of_hanging():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from toy_models import ToyEngine

    tok = Tokenizer(WordLevel({w: i for i, w in enumerate("abcdef")}, unk_token="a"))
    tok.pre_tokenizer = WhitespaceSplit()
    gen = spec_runtime.Generator(ToyEngine(vocab=6, seed=0), tokenizer=tok)
    stream = gen.stream("b c d", max_new_tokens=20)
    next(stream)
    with pytest.raises(RuntimeError, match="still streaming"):
        gen.generate("b c", max_new_tokens=2)
    stream.close()  # releases the generator
    assert len(gen.generate("b c", max_new_tokens=2).tokens) == 2


def _runtime_imports(path) -> set[str]:
    """The spec_runtime modules a file imports (a name imported from the package itself counts
    as the package, unless it is a module of it)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.split(".")[0] == "spec_runtime"}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                node.module.split(".")[0] == "spec_runtime":
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if _is_module(sub) else node.module)
    return found


def _is_module(name: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


# What the exporter uses of the runtime, and why (DESIGN.md, "Two packages, one direction"): the
# contract, the manifest and the errors, written once for both sides; where bundles live and the
# tokenizer's recorded identity (bundle); the devices and the builds that serve them (devices);
# and, for its parity runs and measurements, the runtime's own engines and decoding through
# their public entry points (engines.open_graph, engines.tensorrt_on, drafts, Generator, and
# loading for a whole bundle's costs), so
# that a graph is checked exactly the way a loaded bundle runs it; a trimmed draft head's kept
# ids are read and drafted with as a bundle does (draft_vocab); γ is read as a request reads it
# (gamma); a speech model's parity input is the log-mel a request computes (audio).
EXPORTER_USES = {"spec_runtime", "spec_runtime.bundle.contract", "spec_runtime.bundle.manifest", "spec_runtime.decode.gamma",
                 "spec_runtime.errors", "spec_runtime.engines.gqa_window", "spec_runtime.bundle.reader",
                 "spec_runtime.loading",
                 "spec_runtime.engines.devices", "spec_runtime.engines.opener", "spec_runtime.decode.drafts",
                 "spec_runtime.decode.draft_vocab", "spec_runtime.audio"}


def test_the_exporter_uses_only_the_runtime_modules_named_for_it():
    from pathlib import Path

    import spec_export

    used = {}
    root = Path(spec_export.__file__).parent
    for path in root.rglob("*.py"):  # the subpackages too
        for module in _runtime_imports(path):
            used.setdefault(module, []).append(str(path.relative_to(root)))
    assert "spec_runtime.bundle.contract" in used  # the scan sees the imports it should
    assert "bundle/options.py" in used["spec_runtime.decode.gamma"]  # and reaches the subpackages
    beyond = {m: files for m, files in used.items() if m not in EXPORTER_USES}
    assert beyond == {}, beyond


BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def _benchmark_imports(path, scripts) -> set[str]:
    """Which of `scripts` (benchmarks/*.py by stem: benchmarks/ is not a package, its scripts
    import each other by name) `path` imports, at the top or inside a function."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & scripts


def _a_cycle(graph: dict) -> list | None:
    """One cycle of `graph` ({node: nodes it points to}) as [a, b, ..., a], or None."""
    state, path = {}, []

    def visit(node):
        state[node] = "open"
        path.append(node)
        for nxt in graph.get(node, ()):
            if state.get(nxt) == "open":
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        state[node] = "done"
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_cycle_finder_oracle():
    assert _a_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": []}) == ["a", "b", "c", "a"]
    assert _a_cycle({"a": ["b", "c"], "b": ["c"], "c": [], "d": ["a"]}) is None
    assert _a_cycle({"a": ["a"]}) == ["a", "a"]


def test_the_benchmark_scripts_import_each_other_without_a_cycle():
    """The scripts of benchmarks/ import one another in one direction, function-level imports
    included: a script is read after those it uses, and no change to one can break an import of
    itself half-way through."""
    scripts = {p.stem: p for p in sorted(BENCHMARKS.glob("*.py"))}
    graph = {name: sorted(_benchmark_imports(path, set(scripts)))
             for name, path in scripts.items()}
    assert "pair" in graph["compare"] and "pair_report" in graph["pair"]  # the scan sees them
    cycle = _a_cycle(graph)
    assert cycle is None, "benchmarks/ import cycle: " + " → ".join(cycle)
