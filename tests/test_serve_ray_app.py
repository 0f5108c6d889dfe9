"""spec_runtime/apps/ray_serve.py without a Ray instance: its argument checks (input errors,
before Ray starts), the builder that `serve run` calls with strings, one replica's app in
process (its health check and replica header), and README's Ray Serve config against Ray's own
schema. The cluster and run() are in test_serve_ray.py."""

import asyncio
import os
import subprocess
import sys

import pytest

from spec_runtime.errors import InputError
from spec_runtime.apps.ray_serve import (  # imports no ray itself
    REPLICA_HEADER,
    _check_health,
    _replica_app,
    app_builder,
    build_application,
    run,
)

ray = pytest.importorskip("ray", reason="the ray extra installs Ray Serve")
serve = pytest.importorskip("ray.serve", reason="the ray extra installs Ray Serve")
httpx = pytest.importorskip("httpx", reason="the test extra installs httpx")


def test_runtime_never_imports_ray():
    code = ("import sys, spec_runtime, spec_runtime.apps.server; "
            "assert 'ray' not in sys.modules, 'spec_runtime imported ray'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.parametrize("kwargs, words", [
    (dict(replicas=0), ["replicas 0", ">= 1"]),
    (dict(replicas="two"), ["replicas 'two'"]),
    (dict(slots=0), ["slots 0"]),
    (dict(queue=-1), ["queue -1"]),
    (dict(device="tpu"), ["device 'tpu'", "cpu"]),
    (dict(num_cpus=-1), ["num_cpus -1"]),
    (dict(api_key=""), ["api_key"]),
])
def test_bad_values_are_input_errors(llama_pair, kwargs, words):
    with pytest.raises(InputError) as e:
        build_application(llama_pair[2], **kwargs)
    for w in words:
        assert w in str(e.value)


def test_missing_bundle_and_bad_arguments(tmp_path, llama_pair):
    missing = tmp_path / "nowhere"
    with pytest.raises(InputError, match="no bundle at") as e:
        build_application(missing, replicas=2)
    assert str(missing) in str(e.value)
    with pytest.raises(InputError, match="unknown argument"):
        app_builder({"bundle": str(llama_pair[2]), "replica": "2"})
    with pytest.raises(InputError, match="replicas 'x'"):
        app_builder({"bundle": str(llama_pair[2]), "replicas": "x"})
    # run() checks what it can before Ray starts: no Ray instance is made here
    with pytest.raises(InputError, match="port 0"):
        run(llama_pair[2], port=0)
    with pytest.raises(InputError, match="no bundle at"):
        run(missing, port=8000)
    assert not ray.is_initialized()


def test_app_builder_takes_serve_run_arguments(llama_pair):
    """`serve run spec_runtime.apps.ray_serve:app_builder bundle=... replicas=2` passes strings."""
    app = app_builder({"bundle": str(llama_pair[2]), "replicas": "2", "slots": "2",
                       "queue": "3", "drain_seconds": "5"})
    assert isinstance(app, serve.Application)


def test_health_check_and_replica_header_in_process(llama_pair):
    """The builder's app names its replica in a header; check_health passes on a working app
    and raises once the app reports it is not taking requests."""
    app = _replica_app(str(llama_pair[2]), dict(slots=1, queue=2))

    async def main():
        await _check_health(app)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://replica") as c:
            r = await c.get("/health")
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == f"pid-{os.getpid()}"
        assert "x-specedge-replica" not in r.headers
        app.state.begin_drain(3600)
        with pytest.raises(RuntimeError, match="503"):
            await _check_health(app)

    asyncio.run(main())


def test_readme_serve_config_is_valid_for_ray(llama_pair):
    """The serving page's `serve run config.yaml` block: Ray's own schema accepts it, its import_path is
    our builder, and its args (the bundle swapped for a test bundle) build the application with
    the replicas it names."""
    import importlib
    import re
    from pathlib import Path

    import yaml
    from ray.serve.schema import ServeDeploySchema

    page = (Path(__file__).parent.parent / "docs" / "serving.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```$", page, flags=re.S | re.M)
    assert len(blocks) == 1, "docs/serving.md should show one Ray Serve config"
    config = yaml.safe_load(blocks[0])
    ServeDeploySchema.model_validate(config)  # raises on a config Ray would refuse
    (application,) = config["applications"]
    module, name = application["import_path"].split(":")
    builder = getattr(importlib.import_module(module), name)
    assert builder is app_builder
    args = dict(application["args"], bundle=str(llama_pair[2]))
    app = builder(args)
    assert isinstance(app, serve.Application)
    assert app._bound_deployment.num_replicas == application["args"]["replicas"]
